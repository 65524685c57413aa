"""fourfold simulate: ranks of a large job built and stepped under the fake process group and
fake tensors, checked against the planner (bytes exact, memory close) and against each other
(the collectives of a group's ranks equal)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from fourfold.config import Config, model_config
from fourfold.models.init import TILE_COLS, TILE_ROWS
from fourfold.parallel.comm import CollectiveError, Comm
from fourfold.parallel.grid import AXES, Grid, GridShape
from fourfold.plan.machine_file import load_machine
from fourfold.simulate import (FIT_PHASES, PHASES, RankReport, check_reports, default_ranks,
                               first_trace_difference, format_report, planner_tensor_bytes,
                               simulate, SimulationError)

SHAPE = GridShape(data=2, z=4, y=2, x=4)  # 64 ranks


def _config() -> Config:
    cfg = Config()
    cfg.model = model_config("15m")
    cfg.train = dataclasses.replace(cfg.train, batch_size=16, seq_len=256, dtype="bfloat16",
                                    activation_checkpointing=True)
    return cfg


@pytest.fixture(scope="module")
def reports() -> list[RankReport]:
    # one resumed step reaches a run's peak; the end of a run has a test of its own
    return simulate(_config(), SHAPE, default_ranks(SHAPE), load_machine("dgx-h100"), steps=1,
                    resumed=True, whole_run=False)


def test_default_ranks_are_the_corners() -> None:
    ranks = default_ranks(SHAPE)
    assert len(ranks) == 16 and ranks[0] == 0 and ranks[-1] == SHAPE.size - 1
    assert {SHAPE.coords(r)["z"] for r in ranks} == {0, SHAPE.z - 1}


@pytest.mark.slow
def test_bytes_per_axis_equal_the_planner(reports: list[RankReport]) -> None:
    for r in reports:
        assert all(r.step_bytes[a] > 0 for a in AXES), r.step_bytes
        assert {a: r.step_bytes[a] for a in AXES} == r.planned_bytes, f"rank {r.rank}"


@pytest.mark.slow
def test_planner_tensor_terms_close_to_the_simulated_peak(reports: list[RankReport]) -> None:
    for r in reports:
        assert r.planned_memory is not None
        planned = planner_tensor_bytes(r.planned_memory)
        assert abs(r.peak / planned - 1) < 0.05, (r.rank, r.peak, planned, r.peaks)
        assert min(r.peaks[p] for p in PHASES) > 0


@pytest.mark.slow
def test_every_group_issues_the_same_collectives(reports: list[RankReport]) -> None:
    assert first_trace_difference(SHAPE, reports) is None
    check_reports(reports, SHAPE, load_machine("dgx-h100"))  # fits, agrees: no error


@pytest.mark.slow
def test_a_divergent_trace_is_named(reports: list[RankReport]) -> None:
    first, last = reports[0], reports[-1]  # one data group? no: they share only "all"
    x_peer = next(r for r in reports if r.rank != first.rank
                  and all(SHAPE.coords(r.rank)[a] == 0 for a in ("data", "z", "y")))
    calls = [i for i, c in enumerate(x_peer.trace) if c.axis == "x"]
    changed = x_peer.trace[calls[3]]
    trace = list(x_peer.trace)
    trace[calls[3]] = dataclasses.replace(changed, shape=(changed.shape[0] + 1,
                                                          *changed.shape[1:]))
    diverged = dataclasses.replace(x_peer, trace=trace)
    message = first_trace_difference(SHAPE, [first, diverged, last])
    assert message is not None
    assert f"ranks 0 and {x_peer.rank} share a x group" in message
    assert "collective 4 on it differs" in message
    with pytest.raises(SimulationError, match="would hang"):
        check_reports([first, diverged], SHAPE, load_machine("dgx-h100"))
    shorter = dataclasses.replace(x_peer, trace=[c for i, c in enumerate(x_peer.trace)
                                                 if i != calls[-1]])
    assert "issue" in (first_trace_difference(SHAPE, [first, shorter]) or "")


@pytest.mark.slow
def test_a_rank_that_does_not_fit_is_an_error(reports: list[RankReport]) -> None:
    tiny = dataclasses.replace(load_machine("dgx-h100"), reserved_gib=79.99)
    with pytest.raises(SimulationError, match="peaks at"):
        check_reports(reports[:1], SHAPE, tiny)


def test_comm_checks_gather_and_scatter_sizes_against_the_group() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        with FakeTensorMode():
            good = Grid(shape=GridShape(x=4), rank=1, backend="fake",
                        groups={"x": dist.new_group([0, 1, 2, 3])})
            comm = Comm(good)
            assert comm.all_gather(torch.ones(3, 2), "x").wait().shape == (12, 2)
            assert comm.reduce_scatter(torch.ones(8, 2), "x").wait().shape == (2, 2)
            # a group of 2 where the grid's axis has 4 ranks: a real backend would fail or hang
            wrong = Grid(shape=GridShape(x=4), rank=1, backend="fake",
                         groups={"x": dist.new_group([0, 1])})
            with pytest.raises(CollectiveError, match="the group has 2 ranks"):
                Comm(wrong).all_gather(torch.ones(3, 2), "x")
            with pytest.raises(CollectiveError, match="is not 4 x"):
                comm.reduce_scatter(torch.ones(6, 2), "x")  # 6 rows do not split 4 ways
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("args, message", [
    (["--grid", "2,2,2"], "--grid 2,2,2: give data,z,y,x"),
    (["--grid", "2,2,2,2", "--ranks", "16"], "--ranks 16: the grid"),
    (["--grid", "2,2,2,2", "--ranks", "a"], "--ranks a: give integers"),
])
def test_simulate_command_mistakes_are_one_line(tmp_path, capsys, args: list[str],
                                                message: str) -> None:
    from fourfold.cli import main

    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "debug"\n[parallel]\nmachine = "dgx-h100"\n')
    code = main(["simulate", str(config), "--world", "16", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[-1].startswith("error: ") and message in err[-1], err


def _debug_config() -> Config:
    cfg = Config()
    cfg.model = model_config("debug")
    cfg.train = dataclasses.replace(cfg.train, batch_size=8, seq_len=64)
    return cfg


@pytest.mark.slow
def test_a_rank_with_real_tensors_on_cpu_runs_the_code_the_fake_one_does() -> None:
    shape = GridShape(data=2, z=2, y=1, x=2)  # rank 5: data 1, z 0, x 1
    machine = load_machine("dgx-h100")
    (fake,) = simulate(_debug_config(), shape, [5], machine)
    (real,) = simulate(_debug_config(), shape, [5], machine, device="cpu")
    assert fake.device is None and not fake.losses and not fake.device_peaks
    assert real.device == "cpu" and len(real.losses) == 2
    assert all(math.isfinite(loss) and loss > 0 for loss in real.losses), real.losses
    # the same code: the same collectives, and the same tensors alive at each phase's peak
    assert real.step_bytes == fake.step_bytes
    assert [(c.op, c.axis, c.dtype, c.shape) for c in real.trace] == \
        [(c.op, c.axis, c.dtype, c.shape) for c in fake.trace]
    for phase in PHASES[1:] + FIT_PHASES:
        assert abs(real.peaks[phase] / fake.peaks[phase] - 1) < 0.01, (phase, real.peaks,
                                                                       fake.peaks)
    # fake shards get no initial values: the build leaves out the initialisation's tile
    assert 0 <= real.peaks["build"] - fake.peaks["build"] <= TILE_ROWS * TILE_COLS * 4
    assert real.device_peaks["forward"] > 0 and real.planned_compute_s is not None
    text = format_report([real], shape, machine)
    assert "real peak resident growth on cpu" in text and "loss per step" in text


@pytest.mark.slow
def test_a_whole_run_is_simulated_through_fit() -> None:
    """Trainer.fit runs the steps, the logged step's straggler report, validations, the
    checkpoint's staging, the streamed export and the sample through the trainer's own code;
    on a GPU machine the snapshot is a copy (checkpoint.async "auto"), which the checkpoint
    phase's peak shows, and rank 0 assembles full tensors."""
    shape = GridShape(data=2, z=2, y=1, x=2)
    machine = load_machine("dgx-h100")
    first, other = simulate(_debug_config(), shape, [0, 5], machine)
    (steps_only,) = simulate(_debug_config(), shape, [0], machine, whole_run=False)
    for r in (first, other):
        assert all(r.peaks[p] > 0 for p in FIT_PHASES), r.peaks
        assert r.staged_bytes > 0
    # the steps inside fit() are the steps alone: the same bytes, the same peaks (give or
    # take what fit() holds beside them: its cached validation batch, its counters)
    assert first.step_bytes == steps_only.step_bytes
    for phase in PHASES[1:]:
        assert 0 <= first.peaks[phase] - steps_only.peaks[phase] < 0.01 * first.peaks[phase]
    # after the steps, the logged step gathers every rank's time (the straggler report), and
    # the two ranks issue the same collectives on the groups they share
    after = first.trace[len(steps_only.trace):]
    assert any(c.op == "all-gather" and c.axis == "all" for c in after), after
    assert first_trace_difference(shape, [first, other]) is None
    # rank 5 sends its shards and holds nothing more: its export is the state at rest, and the
    # snapshot's copies come on top of that state
    grown = other.peaks["checkpoint"] - other.peaks["export"]
    assert abs(grown / other.staged_bytes - 1) < 0.05, (grown, other.staged_bytes)
    assert other.export_largest == 0 and first.export_largest > 0
    assert first.peaks["export"] > other.peaks["export"]  # rank 0 assembles each full tensor
    text = format_report([first], shape, machine)
    assert "the rest of fit() (no tensor written): validation" in text
    assert "the export's largest full tensor" in text


@pytest.mark.slow
def test_steps_only_leaves_the_end_of_a_run_out(tmp_path, capsys) -> None:
    from fourfold.cli import main

    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "debug"\n')
    code = main(["simulate", str(config), "--world", "4", "--grid", "1,1,2,2", "--ranks", "3",
                 "--steps-only"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the rest of fit(): not run (the steps only)" in out, out


def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    from fourfold.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "debug"\n')
    code = main(["simulate", str(config), "--world", "4", "--grid", "1,1,2,2",
                 "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[-1].startswith("error: --device cuda: no CUDA device"), err


@pytest.mark.slow
def test_plan_simulate_runs_the_top_row(tmp_path, capsys) -> None:
    from fourfold.cli import main

    config = tmp_path / "c.toml"
    config.write_text('[model]\npreset = "debug"\n[train]\nbatch_size = 8\nseq_len = 64\n')
    code = main(["plan", "--model", str(config), "--gpus", "4", "--machine", "dgx-h100",
                 "--top", "1", "--simulate"])
    printed = capsys.readouterr()
    out = printed.out
    assert code == 0, out
    # its progress lines, also while the simulated run's own output is swallowed
    assert "step 2 of 2" in printed.err and "the run's end" in printed.err, printed.err
    top = out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.lstrip().startswith("1 ")))]
    d, z, y, x = (int(v) for v in top.split()[1].split(","))
    shape = GridShape(data=d, z=z, y=y, x=x)
    # the table of the top row's default ranks, under the plan's
    assert out.index("to run #1") < out.index("peak live tensors by phase")
    for rank in default_ranks(shape):
        assert f"rank {rank} (" in out and f"of grid {shape} on dgx-h100" in out
    assert "simulated peak" in out


@pytest.mark.parametrize("args, message", [
    (["--json", "--simulate"], "--simulate prints a table"),
    (["--sweep", "--simulate"], "--simulate runs the top row"),
])
def test_plan_simulate_mistakes_are_one_line(capsys, args: list[str], message: str) -> None:
    from fourfold.cli import main

    code = main(["plan", "--model", "debug", "--gpus", "4", "--machine", "dgx-h100", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[-1].startswith("error: ") and message in err[-1], err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lomo", "adalomo", "mezo", "es", "galore"])
def test_every_method_runs_a_whole_run(method: str) -> None:
    """A method's step that reads numbers on the host (its loss, a projected gradient) gets
    healthy ones; the ranks of a group agree, and the engine moves the planner's bytes (GaLore
    less its basis refresh, which the planner spreads over train.method.gap steps)."""
    cfg = _debug_config()
    cfg.train = dataclasses.replace(cfg.train, optimizer=method)
    shape = GridShape(data=2, z=2, y=1, x=2)
    reports = simulate(cfg, shape, [0, 7], load_machine("dgx-h100"))
    assert first_trace_difference(shape, reports) is None
    for r in reports:
        # (no optimizer phase: these methods update inside backward, or have none)
        assert all(r.peaks[p] > 0 for p in ("build", "forward") + FIT_PHASES), r.peaks
        moved = {a: r.step_bytes.get(a, 0) for a in AXES}
        if method == "galore":
            assert all(moved[a] <= r.planned_bytes[a] for a in AXES), (moved, r.planned_bytes)
        else:
            assert moved == r.planned_bytes, (moved, r.planned_bytes)


@pytest.mark.slow
def test_a_step_that_selects_by_value_needs_real_tensors() -> None:
    cfg = _debug_config()
    cfg.train = dataclasses.replace(cfg.train, optimizer="blockllm")
    with pytest.raises(SimulationError, match="--device cpu or --device cuda"):
        simulate(cfg, GridShape(data=2, z=2, y=1, x=2), [0], load_machine("dgx-h100"))
