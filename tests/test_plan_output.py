"""What `fourfold plan` shows a person: machine and model names as typed, one unit per column,
the memory column per rank or per GPU, the default batch, why nothing fits and what would, and
the `fourfold train` line that runs the top row."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from fourfold.cli import build_parser as train_parser
from fourfold.cli import main
from fourfold.config import TrainConfig, load_config, model_config
from fourfold.plan import PlanError, load_machine, plan
from fourfold.plan.catalog import match_machine_name
from fourfold.plan.cli import DEFAULT_BATCH_TOKENS, build_parser, format_plan, plan_main
from fourfold.plan.probe import _guess_base

from fake_host import use_fake_probes


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FOURFOLD_CACHE", str(tmp_path / "cache"))
    use_fake_probes(monkeypatch)  # the `cpu` machine without timing this CPU


def _json(capsys, *args: str) -> dict:
    assert plan_main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _table(capsys, *args: str) -> list[str]:
    assert plan_main(list(args)) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("typed, name", [
    ("h100", "h100-sxm"), ("H100", "h100-sxm"), ("a100", "a100-40gb"), ("A100-80GB", "a100-80gb"),
    ("a100_80", "a100-80gb"), ("h200", "h200"), ("H200", "h200"), ("mi250x", "mi250x-gcd"),
    ("MI250X", "mi250x-gcd"), ("mi300", "mi300x"), ("GH200", "gh200"), ("b200", "b200"),
    ("H100 PCIe", "h100-pcie"), ("DGX_H100", "dgx-h100"), ("Perlmutter", "perlmutter"),
    ("frontier", "frontier"), ("CPU", "cpu")])
def test_machine_names_ignore_case_and_take_short_names(typed, name):
    assert match_machine_name(typed) == name
    assert load_machine(typed).name == name


@pytest.mark.parametrize("typed, candidates", [
    ("h1", "h100-sxm, h100-pcie"), ("mi", "mi250x-gcd, mi300x"),
    ("a", "alps, a100-40gb, a100-80gb")])
def test_an_ambiguous_name_is_refused_with_its_candidates(typed, candidates, capsys):
    with pytest.raises(PlanError, match=f"machine {typed!r} is ambiguous: it could be "
                                        f"{candidates}; name one of them"):
        load_machine(typed)
    assert main(["plan", "--model", "8b", "--gpus", "8", "--machine", typed]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and candidates in err
    assert main(["plan", "--model", "1", "--gpus", "8", "--machine", "h100"]) == 2
    assert "model '1' is ambiguous: it could be 15m, 125m, 1b" in capsys.readouterr().err


def test_model_names_ignore_case(capsys):
    upper = _json(capsys, "--model", "70B", "--machine", "h100", "--gpus", "64",
                  "--global-batch", "64", "--seq", "2048", "--top", "1")
    assert upper["model"]["preset"] == "70b" and upper["machine"]["name"] == "h100-sxm"
    assert _table(capsys, "--model", "8B", "--machine", "H200", "--gpus", "8",
                  "--top", "1")[0].startswith("model 8b (8.03B params")


def test_a_machine_file_takes_names_as_typed(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "DGX-H100"\n[device]\nbase = "H200"\n')
    machine = load_machine(str(path))
    assert machine.device.name == "H200" and machine.gpus_per_node == 8


def test_probe_names_a_gpu_by_the_catalog():
    assert _guess_base("NVIDIA GH200 480GB") == "gh200"  # not h200, which it contains
    assert _guess_base("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    with pytest.raises(PlanError, match="pass --base"):
        _guess_base("Some Future Accelerator")


def test_every_time_column_has_one_unit():
    result = plan(model_config("1b"), 8, load_machine("perlmutter"), 32, 2048)
    # steps on both sides of 10 s: every cell of the table in the same unit
    slow = [dataclasses.replace(c, prediction=dataclasses.replace(c.prediction, step_s=s))
            for c, s in zip(result.candidates, (9.9876, 10.02, 31.5))]
    table = format_plan(dataclasses.replace(result, candidates=slow), 3).splitlines()
    columns = next(line for line in table if line.lstrip().startswith("#")).split()
    assert columns[columns.index("step") + 1] == "s"
    assert columns.count("s") == 5 and "ms" not in columns  # step, x, y, z, data
    rows = [line.split() for line in table if line.split()[0] in ("1", "2", "3")]
    assert [r[6] for r in rows] == ["9.99", "10.02", "31.50"]
    assert "comm columns: s per step" in table[1]
    for row in rows:
        cells = row[10:14]
        assert all(c == "-" or float(c.split("(")[0]) < 10 for c in cells)  # seconds, no "ms"
    fast = format_plan(result, 3).splitlines()
    columns = next(line for line in fast if line.lstrip().startswith("#")).split()
    assert columns.count("ms") == 5 and columns.count("s") == 0
    assert all("s" not in line.split()[6] for line in fast if line.split()[0] in ("1", "2"))


def test_the_memory_column_is_per_rank_on_a_host_and_per_gpu_on_gpus(capsys):
    host = _table(capsys, "--model", "debug", "--gpus", "2", "--machine", "cpu", "--top", "1")
    assert "GiB/rank" in host[5] and "GiB/GPU" not in "\n".join(host)
    assert "GiB usable per rank" in host[0]
    gpus = _table(capsys, "--model", "debug", "--gpus", "2", "--machine", "h100", "--top", "1")
    assert "GiB/GPU" in gpus[5] and "GiB usable per GPU" in gpus[0]


def test_the_default_batch_is_about_a_million_tokens_whatever_the_gpu_count(capsys):
    assert "2^20 tokens (about 1M) on GPUs" in " ".join(build_parser().format_help().split())
    assert DEFAULT_BATCH_TOKENS == 2**20
    for gpus in ("8", "64"):
        out = _json(capsys, "--model", "8b", "--machine", "h100", "--gpus", gpus, "--top", "1")
        assert out["global_batch"] * out["seq_len"] == 2**20  # 128 x 8192
    out = _json(capsys, "--model", "1b", "--machine", "h100", "--gpus", "8", "--seq", "3000",
                "--top", "1")
    assert out["global_batch"] == 2**20 // 3000
    # 8b splits over no axis of 3 but data and z: the batch nearest 128 that 3 divides
    out = _json(capsys, "--model", "8b", "--machine", "h100", "--gpus", "3", "--top", "1")
    assert out["global_batch"] == 129 and out["configurations"][0]["grid"]["data"] * \
        out["configurations"][0]["grid"]["z"] == 3


def test_nothing_fits_says_why_and_the_fix_that_fits(capsys):
    """LOMO on 8b over 8 GPUs: no accumulation, so the 1M-token batch is one micro-batch of
    16 sequences a rank, OOM on every grid; the advice names that and fixes that do fit."""
    lines = _table(capsys, "--model", "8b", "--machine", "h100", "--gpus", "8",
                   "--optimizer", "lomo", "--top", "3")
    advice = lines[-1]
    assert advice.startswith("no grid of 8 x H100-SXM fits: lomo updates each weight inside "
                             "backward, so it cannot accumulate")
    assert "16 sequences a rank" in advice
    assert advice.endswith("fix: --global-batch 64 or 16 GPUs")
    assert not any(line.startswith("to run") for line in lines)
    lomo, h100 = TrainConfig(optimizer="lomo"), load_machine("h100")
    assert plan(model_config("8b"), 8, h100, 64, 8192, train=lomo).best.fits
    assert not plan(model_config("8b"), 8, h100, 128, 8192, train=lomo).best.fits
    assert plan(model_config("8b"), 16, h100, 128, 8192, train=lomo).best.fits
    out = _json(capsys, "--model", "8b", "--machine", "h100", "--gpus", "8", "--optimizer",
                "lomo", "--top", "1")
    assert out["nothing_fits"] == advice and out["train_command"] is None


def test_nothing_fits_offers_a_leaner_optimizer_and_more_gpus_when_the_state_is_too_big():
    a100 = load_machine("a100")
    result = plan(model_config("8b"), 2, a100, 8, 1024)
    advice = result.why_nothing_fits()
    assert "the weights, gradients and adamw's state alone take" in advice
    assert advice.endswith("fix: 4 GPUs or --optimizer blockllm")
    assert plan(model_config("8b"), 4, a100, 8, 1024).best.fits
    assert plan(model_config("8b"), 2, a100, 8, 1024,
                train=TrainConfig(optimizer="blockllm")).best.fits
    # a fixed --grad-accum that forces large micro-batches: leave it out, or a smaller batch
    fixed = plan(model_config("8b"), 8, a100, 64, 8192, grad_accum=1).why_nothing_fits()
    assert "--grad-accum 1 makes micro-batches of 8 sequences a rank" in fixed
    assert "fix: leave out --grad-accum (the search accumulates), --global-batch 8" in fixed
    assert plan(model_config("8b"), 8, a100, 64, 8192).best.fits
    assert plan(model_config("8b"), 8, a100, 8, 8192, grad_accum=1).best.fits
    assert plan(model_config("1b"), 8, a100, 32, 2048).why_nothing_fits() == ""


def _train_line(lines: list[str]) -> list[str]:
    at = next(i for i, line in enumerate(lines) if line.startswith("to run #1"))
    return shlex.split(lines[at + 1])


@pytest.mark.parametrize("extra", [
    (), ("--reduce-dtype", "bfloat16", "--overlap-forward", "on"), ("--no-overlap",),
    ("--activation-checkpointing", "on", "--optimizer", "lomo"), ("--grad-accum", "4")])
def test_the_printed_train_line_runs_the_top_row_as_planned(extra, capsys):
    args = ["--model", "1b", "--gpus", "8", "--machine", "h100", "--global-batch", "32",
            "--seq", "2048", *extra]
    lines = _table(capsys, *args, "--top", "1")
    words = _train_line(lines)
    assert words[:2] == ["fourfold", "train"]
    parsed = train_parser().parse_args(words[1:])
    cfg = load_config(parsed.config, parsed.overrides)
    out = _json(capsys, *args, "--top", "1")
    assert out["train_command"] == shlex.join(words)
    top = out["configurations"][0]
    t, p = cfg.train, cfg.parallel
    assert cfg.model.preset == "1b" and t.optimizer == out["optimizer"]
    assert {a: getattr(p, a) for a in ("data", "z", "y", "x")} == top["grid"]
    assert (t.batch_size, t.seq_len, t.dtype) == (32, 2048, "bfloat16")
    assert t.grad_accum == top["grad_accum"]
    assert t.batch_size // (p.data * p.z) // t.grad_accum == top["micro_batch"]
    assert t.activation_checkpointing == top["activation_checkpointing"]
    assert p.reduce_dtype == top["reduce_dtype"] and p.overlap_forward == top["overlap_forward"]
    overlaps = (p.overlap_input_grad, p.overlap_weight_grad, p.prefetch_weights,
                p.overlap_data_grad)
    assert overlaps == ((False,) * 4 if "--no-overlap" in extra else (True,) * 4)
    if "--grad-accum" in extra:
        assert t.grad_accum == 4


def test_the_train_line_keeps_a_config_file_and_sets_only_what_differs(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "15m"\n[train]\nbatch_size = 16\nseq_len = 256\n'
                    'optimizer = "lomo"\n')
    words = _train_line(_table(capsys, "--model", str(path), "--gpus", "4", "--machine",
                               "alps", "--top", "1"))
    assert words[:3] == ["fourfold", "train", str(path)]
    assert not any(w.startswith(("model.", "train.batch_size", "train.optimizer"))
                   for w in words)  # the file says them already
    cfg = load_config(words[2], train_parser().parse_args(words[1:]).overrides)
    assert cfg.train.optimizer == "lomo" and cfg.train.batch_size == 16
    assert cfg.parallel.data * cfg.parallel.z * cfg.parallel.y * cfg.parallel.x == 4


def test_on_the_cpu_machine_the_train_line_starts_its_ranks(capsys):
    lines = _table(capsys, "--model", "debug", "--gpus", "2", "--machine", "cpu",
                   "--global-batch", "4", "--seq", "64", "--top", "1")
    assert lines[-2] == "to run #1:"
    words = _train_line(lines)
    assert words[2:4] == ["--nproc", "2"]
    cfg = load_config(None, train_parser().parse_args(words[1:]).overrides)
    assert cfg.train.dtype == "float32" and cfg.train.batch_size == 4
