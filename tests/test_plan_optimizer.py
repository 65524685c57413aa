"""`fourfold plan --optimizer`: the search's memory is each training method's own."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fourfold.cli import main
from fourfold.config import Config, ParallelConfig, TrainConfig, model_config
from fourfold.methods import BUILTIN_METHODS, method_names, method_options, method_spec
from fourfold.parallel.embedding import resolve_output_loss
from fourfold.plan import PlanError, Precision, choose_grid, load_machine, plan, predict_memory
from fourfold.plan.cli import plan_main
from fourfold.plan.memory import predict_method_memory
from fourfold.plan.methods.blockllm import blockllm_choice_seconds
from fourfold.plan.perf import predict_step

from fake_host import use_fake_probes

# 8b on two A100-40GB: AdamW's 16 bytes per parameter do not fit on any grid, LOMO's do
LEAN_JOB = ["--model", "8b", "--gpus", "2", "--machine", "perlmutter", "--global-batch", "8",
            "--seq", "1024", "--json", "--top", "0"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path / "cache"))
    use_fake_probes(monkeypatch)  # the `cpu` machine without timing this CPU


def _plan_json(capsys, *extra: str) -> dict:
    assert plan_main(LEAN_JOB + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_lomo_fits_where_adamw_does_not(capsys):
    adamw = _plan_json(capsys)
    assert adamw["optimizer"] == "adamw" and adamw["step_time_method_specific"]
    assert not any(r["fits"] for r in adamw["configurations"])
    lomo = _plan_json(capsys, "--optimizer", "lomo")
    assert lomo["optimizer"] == "lomo"
    assert lomo["configurations"][0]["fits"]
    # the time column is lomo's own step, and the plan says what it counts
    assert lomo["step_time_method_specific"] and "lomo" in lomo["step_time_note"]
    assert all(r["grad_accum"] == 1 for r in lomo["configurations"])  # lomo cannot accumulate
    by_grid = {json.dumps(r["grid"]): r for r in adamw["configurations"]}
    for r in lomo["configurations"]:
        a = by_grid[json.dumps(r["grid"])]
        assert r["memory_breakdown_gib"]["grads"] < a["memory_breakdown_gib"]["grads"]
        assert r["memory_breakdown_gib"]["optimizer"] == 0


def test_table_names_the_planned_optimizer(capsys):
    table_job = [a for a in LEAN_JOB if a not in ("--json",)]
    assert plan_main(table_job + ["--optimizer", "mezo"]) == 0
    out = capsys.readouterr().out
    assert "memory planned for train.optimizer = mezo" in out
    assert "mezo's two forwards" in out  # what the step-time column counts
    assert " fits" in out
    assert plan_main(table_job) == 0
    out = capsys.readouterr().out
    assert "train.optimizer = adamw" in out and "no grid of 2 x A100-40GB fits" in out
    assert "forward+backward" not in out  # adamw's time is its own: no caveat


@pytest.mark.parametrize("optimizer", BUILTIN_METHODS)
def test_candidate_memory_is_the_method_model(optimizer):
    model, machine = model_config("125m"), load_machine("perlmutter")
    train = TrainConfig(optimizer=optimizer)
    precision = Precision.of("bfloat16")
    result = plan(model, 4, machine, 8, 512, precision, train=train)
    assert result.optimizer == optimizer
    candidates = list(result.candidates)
    if method_spec(optimizer).accumulates:  # and with micro-steps that accumulate gradients
        candidates += plan(model, 4, machine, 8, 512, precision, train=train,
                           grad_accum=2).candidates
        assert any(c.grad_accum == 2 for c in candidates)
    for c in candidates:
        # parallel.output_loss at its default, as a run of the method resolves it
        loss = resolve_output_loss("auto", method_spec(optimizer).blocked_loss)
        base = predict_memory(model, c.shape, c.micro_batch * 512, c.activation_checkpointing,
                              precision, output_loss=loss, grad_accum=c.grad_accum)
        assert c.memory == predict_method_memory(
            base, model, c.shape, dataclasses.replace(train, grad_accum=c.grad_accum),
            precision, loss)
        # with accumulation every method's gradients are alive at the later micro-steps' loss
        assert c.memory.loss_grads == (c.memory.grads if c.grad_accum > 1 else 0)
        if not method_spec(optimizer).accumulates:
            assert c.grad_accum == 1
    adamw = plan(model, 4, machine, 8, 512, precision)
    assert adamw.optimizer == "adamw" and adamw.time_note is None
    assert (result.time_note is None) == (optimizer == "adamw")


def test_method_options_from_the_config_reach_the_memory(tmp_path, capsys):
    def state_gib(sparsity: float | None) -> float:
        path = tmp_path / "block.toml"
        extra = f"[train.method]\nsparsity = {sparsity}\n" if sparsity is not None else ""
        path.write_text('[model]\npreset = "125m"\n[train]\nbatch_size = 8\nseq_len = 256\n'
                        f'optimizer = "blockllm"\n{extra}')
        assert plan_main(["--model", str(path), "--gpus", "1", "--machine", "perlmutter",
                          "--json", "--top", "0"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["optimizer"] == "blockllm"
        return out["configurations"][0]["memory_breakdown_gib"]["optimizer"]

    assert state_gib(0.5) == pytest.approx(5 * state_gib(None), rel=1e-3)  # 0.5 vs 0.9 frozen


def test_config_file_optimizer_is_planned(tmp_path, capsys):
    path = tmp_path / "zo.toml"
    path.write_text('[model]\npreset = "15m"\n[train]\nbatch_size = 8\nseq_len = 128\n'
                    'optimizer = "mezo"\n')
    args = ["--model", str(path), "--gpus", "2", "--machine", "alps", "--json", "--top", "0"]
    assert plan_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "mezo" and "mezo's two forwards" in out["step_time_note"]
    assert all(r["memory_breakdown_gib"]["grads"] == 0 and
               r["memory_breakdown_gib"]["activations"] == 0 for r in out["configurations"])
    assert plan_main(args + ["--optimizer", "adamw"]) == 0  # the flag wins over the file
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "adamw"
    assert all(r["memory_breakdown_gib"]["grads"] > 0 for r in out["configurations"])


def test_bad_optimizer_is_one_line_exit_2(capsys):
    with pytest.raises(PlanError) as info:
        plan_main(["--model", "debug", "--gpus", "2", "--optimizer", "sgd"])
    message = str(info.value)
    assert "'sgd'" in message and "lomo" in message and "galore" in message
    assert "\n" not in message
    assert main(["plan", "--model", "debug", "--gpus", "2", "--optimizer", "sgd"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "sgd" in err[0]
    with pytest.raises(PlanError, match="--grad-accum 2: lomo"):
        plan_main(["--model", "debug", "--gpus", "2", "--optimizer", "lomo",
                   "--grad-accum", "2"])


def test_es_splits_its_batch_over_z_only(capsys):
    # the planner plans every method the trainer runs: each has its planner model
    assert all(method_spec(name).planner_model() for name in method_names())
    assert method_spec("es").batch_axes == ("z",)
    # a batch of 2 on 4 ranks: data=4 cannot split it for adamw, es gives each replica all of it
    model, machine = model_config("debug"), load_machine("perlmutter")
    es = plan(model, 4, machine, 2, 64, "float32", train=TrainConfig(optimizer="es"))
    adamw_grids = {str(c.shape) for c in plan(model, 4, machine, 2, 64, "float32").candidates}
    es_grids = {str(c.shape) for c in es.candidates}
    assert "data=4 z=1 y=1 x=1" in es_grids and "data=4 z=1 y=1 x=1" not in adamw_grids
    four = next(c for c in es.candidates if c.shape.data == 4)
    assert four.micro_batch * four.grad_accum == 2  # the whole batch on every replica
    # throughput counts the job's 2 x 64 tokens, not each replica's copy of them
    assert four.prediction.tokens_per_s == pytest.approx(2 * 64 / four.prediction.step_s)


def test_choose_grid_and_parallel_auto_fit_the_method():
    from fourfold.train.build import _planned_grid

    model, machine = model_config("8b"), load_machine("dgx-h100")  # one H100 80GB
    with pytest.raises(PlanError, match="under adamw"):
        choose_grid(model, 1, machine, 2, 1024, dtype="bfloat16")
    shape, why = choose_grid(model, 1, machine, 2, 1024, dtype="bfloat16",
                             train=TrainConfig(optimizer="lomo"))
    assert shape.size == 1 and "under lomo" in why
    cfg = Config(model=model, train=TrainConfig(optimizer="lomo", batch_size=2, seq_len=1024,
                                                dtype="bfloat16"),
                 parallel=ParallelConfig(auto=True, machine="dgx-h100"))
    assert _planned_grid(cfg, 1, 0).size == 1
    cfg.train.optimizer = "adamw"
    with pytest.raises(PlanError, match="under adamw"):
        _planned_grid(cfg, 1, 0)


def _step(optimizer: str, shape=None, machine: str = "perlmutter", batch: int = 4, **options):
    """The planner's step of 15m (`batch` x 256 tokens) on `shape` (default one GPU) under
    `optimizer` with its [train.method] `options`."""
    from fourfold.parallel import GridShape

    return predict_step(model_config("15m"), shape or GridShape(), batch, 256, 1, True,
                        load_machine(machine), Precision.of("float32"), output_loss="whole",
                        train=TrainConfig(optimizer=optimizer,
                                          method=method_options(optimizer, **options)))


@pytest.mark.slow
def test_step_time_is_each_methods_own():
    from fourfold.parallel import GridShape

    adamw = _step("adamw")
    assert _step("adamw").step_s == predict_step(
        model_config("15m"), GridShape(), 4, 256, 1, True, load_machine("perlmutter"),
        Precision.of("float32"), output_loss="whole").step_s  # train=None is AdamW's step
    # lomo: the same forward + backward, a lighter update; two_pass runs them twice
    lomo, two = _step("lomo"), _step("lomo", clip_mode="two_pass")
    assert lomo.step_s < adamw.step_s
    assert two.step_s > 1.9 * (lomo.step_s - (adamw.compute_s - lomo.compute_s))
    assert two.hfu == pytest.approx(lomo.hfu, rel=0.01)  # twice the work in twice the time
    # blockllm, a selection every step: AdamW's passes, every gradient's row norms, the
    # selected fraction of AdamW's update, and the streamed choice's ranking of rows on the
    # host, which on a GPU outweighs a 15m model's whole step (a sparser choice holds fewer)
    sparse, half = _step("blockllm"), _step("blockllm", sparsity=0.5)
    host = blockllm_choice_seconds(model_config("15m"), 0.9, math.inf)
    assert host > adamw.step_s
    assert adamw.step_s + host < sparse.step_s < half.step_s
    # the held rows are ranked when they outgrow the budget by a share of the model, not at
    # every hand-off: twice the layers, less than twice the choice's time (ranking at each
    # hand-off, held rows and hand-offs both grow with the layers: about four times)
    deep = [blockllm_choice_seconds(dataclasses.replace(model_config("125m"), n_layers=n), 0.9,
                                    math.inf) for n in (12, 24, 48)]
    assert deep[0] < deep[1] < 2 * deep[0] and deep[2] < 2 * deep[1], deep
    # galore: AdamW's passes plus two rank-r GEMMs per matrix: at 4 x 256 tokens the
    # projections are a third of the passes' GEMMs; a refresh every step costs more
    galore = _step("galore")
    assert galore.step_s > adamw.step_s
    assert _step("galore", gap=1).step_s > galore.step_s
    # on a grid its own collectives (plan/perf.py method_collectives, which tests/
    # test_lean_optim.py holds against the ledger) come on top of the model's
    grid = GridShape(y=2, x=2)
    assert all(_step("galore", grid).comm_bytes[a] > _step("adamw", grid).comm_bytes[a]
               for a in ("x", "y"))
    # adalomo's row and column statistics too (a few floats per row and column)
    assert all(_step("adalomo", grid).comm_bytes[a] > _step("lomo", grid).comm_bytes[a]
               for a in ("x", "y"))
    # mezo: two forwards (no recompute, no backward) and three noise passes
    mezo = _step("mezo", machine="cpu")
    bigger_batch = _step("mezo", machine="cpu", batch=8)
    forward_s = bigger_batch.compute_s - mezo.compute_s  # two forwards of 4 more sequences
    assert forward_s > 0 and mezo.compute_s > forward_s  # noise: a fixed cost per step
    assert mezo.flops_per_step == pytest.approx(2 * adamw.flops_per_step / 3)
    # es: a replica's members; 8 members on 2 replicas are 4 forwards each
    es = _step("es", machine="cpu", population=8)
    assert es.flops_per_step == pytest.approx(8 * adamw.flops_per_step / 3)
    # on 2 replicas (the search hands es every replica's copy of the batch) each runs 4
    two_replicas = _step("es", GridShape(data=2), batch=8, population=8)
    one = _step("es", batch=4, population=8)
    assert two_replicas.flops_per_step == pytest.approx(one.flops_per_step)
    assert two_replicas.compute_s < one.compute_s  # the same noise, half the forwards


@pytest.mark.parametrize("population, antithetic, passes", [(8, False, 24), (8, True, 16),
                                                           (2, True, 4)])
def test_es_noise_passes(population: int, antithetic: bool, passes: int):
    """ES's noise passes a step, as train/methods/zeroth.py makes them: two a member (+sigma z
    and back) or three an antithetic pair (+sigma z, -2 sigma z, back), then one per direction
    for the update."""
    from fourfold.parallel import GridShape
    from fourfold.plan.methods.zeroth import ES, noise_seconds
    from fourfold.plan.perf import Rates

    model, shape = model_config("15m"), GridShape(data=2)
    rates = Rates(1e12, 1e11, 1e-6, 256.0, 1e11, 1e-9, noise_s_per_element=1e-8)
    train = TrainConfig(optimizer="es", method=method_options("es", population=population,
                                                              antithetic=antithetic))
    cost = ES.cost(model, shape, train, rates, Precision.of("float32"))
    assert cost.forwards == population // 2  # a replica's members
    assert cost.update_s == pytest.approx(passes * noise_seconds(model, shape, rates), rel=1e-12)


def test_forward_only_methods_issue_only_forward_collectives():
    from fourfold.parallel import GridShape
    from fourfold.plan.schedule import collective_schedule

    shape = GridShape(data=2, y=2, x=2)
    adamw, mezo = _step("adamw", shape, batch=8), _step("mezo", shape, batch=8)
    # two forwards, each issuing the block's forward collectives once: no backward, so no
    # recompute, though _step asks for activation checkpointing (which counts them twice)
    schedule = collective_schedule(model_config("15m"), shape, 4 * 256, 1, False, 4, 4, 4,
                                   output_loss="whole")
    forward = {a: 0 for a in adamw.comm_bytes}
    for c in schedule:
        if c.phase.startswith("fwd"):
            forward[c.axis] += c.nbytes * c.calls
    assert mezo.comm_bytes == {a: 2 * b for a, b in forward.items()}
    assert mezo.comm_bytes["data"] == 0 < adamw.comm_bytes["data"]
    plain = predict_step(model_config("15m"), shape, 8, 256, 1, False,
                         load_machine("perlmutter"), Precision.of("float32"),
                         output_loss="whole", train=TrainConfig(optimizer="mezo"))
    assert (plain.comm_bytes, plain.step_s) == (mezo.comm_bytes, mezo.step_s)


def test_host_runtime_counts_the_libraries_each_run_imports():
    """A host run's runtime term counts torch._dynamo where the run imports it (AdamW, or a
    grid's checkpoint DTensors) and the checkpoint library where it writes checkpoints:
    `fourfold train` 2x2 15m, LOMO, rank 0 read 136 MiB without checkpoints and 189 with."""
    from fourfold.parallel.grid import GridShape
    from fourfold.plan.memory import HOST_RUNTIME_BYTES, library_bytes
    from fourfold.plan.memory import predicted_memory

    mib = 2**20

    def runtime(optimizer: str, shape: GridShape, every: int, resumed: bool = False) -> int:
        cfg = Config()
        cfg.model = model_config("15m")
        cfg.train.optimizer, cfg.checkpoint.every = optimizer, every
        cfg.parallel.x, cfg.parallel.y = shape.x, shape.y
        mem = predicted_memory(cfg, shape, on_host=True, resumed=resumed)
        return (mem.runtime - HOST_RUNTIME_BYTES) // mib

    one, grid = GridShape(), GridShape(x=2, y=2)
    assert [runtime("lomo", one, 0), runtime("lomo", one, 2)] == [0, 45]
    assert [runtime("lomo", grid, 0), runtime("lomo", grid, 2)] == [0, 72]
    # a resumed run loads a checkpoint, which imports the same library (15m LOMO, one
    # process, writing none: 474-476 MiB fresh, 513-519 resumed)
    assert [runtime("lomo", one, 0, resumed=True), runtime("lomo", grid, 0, resumed=True)] \
        == [45, 72]
    assert [runtime("adamw", one, 0), runtime("adamw", grid, 2)] == [70, 72]
    # a forward-only method: no backward (27 MiB, not 40), on one process and, with torch's
    # flight recorder off (fourfold.host), on a grid rank too
    assert [runtime("mezo", one, 0), runtime("es", one, 0), runtime("mezo", grid, 0),
            runtime("es", grid, 0), runtime("lomo", one, 0)] == [-13, -13, -13, -13, 0]
    assert library_bytes(dynamo=False, checkpoints=False) == 0
    assert predicted_memory(Config(), one, on_host=False).runtime == 0  # a GPU: none
