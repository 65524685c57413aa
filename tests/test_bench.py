"""The benches in bench/ at tiny sizes: each run holds one property of its table (not only
that it ran). The benches' own figures go to docs/results.md; these only keep them working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import outside_job_env

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from common import parse_table  # noqa: E402


def run_bench(script: str, *args: str, timeout: int = 600) -> list[dict[str, str]]:
    """Run bench/`script` and return the rows of its (first) table."""
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=timeout, env=outside_job_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("## "), proc.stdout[:500]  # the common header
    rows = parse_table(proc.stdout)
    assert rows, proc.stdout
    return rows


@pytest.mark.ranks
def test_comm_bench_ledger_is_the_planners_and_what_torch_was_handed() -> None:
    """Every 2-rank grid: the ledger's bytes equal the planner's closed form and what
    torch.distributed was handed, in bfloat16 with activation checkpointing (the case with the
    most kinds of traffic: bf16 gathers, float32 reductions, recompute's gathers)."""
    rows = run_bench("comm.py", "--nproc", "2", "--layers", "2", "--dim", "64", "--heads", "4",
                     "--kv-heads", "4", "--ffn", "128", "--vocab", "256", "--seq", "16",
                     "--batch", "4", "--steps", "2", "--dtype", "bfloat16",
                     "--activation-checkpointing")
    assert len(rows) == 4  # data, z, y, x = 2
    for row in rows:
        assert row["agree"] == "yes", row
        ledger = sum(float(row[f"{axis} MiB"]) for axis in ("x", "y", "z", "data"))
        assert float(row["handed MiB"]) == pytest.approx(ledger, abs=2e-3), row
        assert (int(row["z gathers"]) > 0) == row["grid (data z y x)"].startswith("1 2"), row


@pytest.mark.slow
def test_plan_papers_bench_is_within_its_target() -> None:
    """The planner's MFU for the paper's points, on the engine's wire and on AxoNN's (bf16
    reductions), within 1.2x of the published figure."""
    rows = run_bench("plan_papers.py", timeout=300)
    held = [r for r in rows if r["wire"] in ("engine", "bf16 wire")]
    assert len(held) == 4
    for row in held:
        assert 1 / 1.2 <= float(row["paper / MFU"]) <= 1.2, row


@pytest.mark.slow
def test_memory_bench_through_the_cli_lomo_holds_less_than_adamw() -> None:
    """`fourfold train` as a user runs it: LOMO's peak is well below AdamW's (no gradients
    kept, no moments), and the planner is near both."""
    rows = run_bench("memory_lean.py", "--cli", "--preset", "debug", "--methods", "lomo",
                     "--steps", "2")
    by_method = {r["method"]: r for r in rows}
    assert float(by_method["lomo"]["vs adamw"]) < 0.75, rows
    # The planner within 15%, give or take 16 MiB: at the debug size the math libraries'
    # scratch buffers (oneDNN, MKL), which differ from CPU to CPU, are a sizeable share.
    for row in rows:
        measured, planned = float(row["peak MiB"]), float(row["planner MiB"])
        assert abs(planned - measured) < 0.15 * measured + 16, row


@pytest.mark.slow
def test_lora_bench_trains_a_small_share() -> None:
    """LoRA trains a few percent of the parameters, norm tuning a fraction of a percent."""
    rows = run_bench("lora.py", "--preset", "debug", "--steps", "3", "--batch", "1", "--seq",
                     "32")
    share = {r["mode"]: float(r["share"].rstrip("%")) for r in rows}
    assert share["full"] == 100 and share["norm"] < 1 < share["lora"] < 10, share


@pytest.mark.slow
def test_packing_bench_times_packed_rows_against_causal() -> None:
    """Three layouts, the packed ones on the CPU's per-document kernel."""
    rows = run_bench("packing.py", "--preset", "debug", "--seq", "64", "--docs", "4",
                     "--batch", "2", "--steps", "3")
    assert [r["kernel"] for r in rows] == ["sdpa causal", "split", "split"], rows
    assert rows[0]["vs causal"] == "1.00x"
    assert all(float(r["vs causal"].rstrip("x")) > 0 for r in rows)


@pytest.mark.ranks
def test_balance_bench_balanced_rows_predict_less_imbalance() -> None:
    """On 2 ranks, rows dealt by cost are predicted no more unequal than rows dealt in order."""
    rows = run_bench("balance.py", "--nproc", "2", "--seq", "256", "--batch", "8", "--micro",
                     "2", "--steps", "2", "--texts", "400")
    by_way = {r["rows dealt"]: float(r["predicted imbalance"].split("%")[0]) for r in rows}
    assert set(by_way) == {"in order", "balanced"}
    assert by_way["balanced"] <= by_way["in order"], rows


@pytest.mark.slow
def test_simulate_sweep_bench_checks_each_grid_against_the_planner() -> None:
    """The three grids of 16 ranks nearest the fit boundary of a small job, each simulated:
    a row per grid, the engine's bytes per axis the planner's on each."""
    rows = run_bench("simulate_sweep.py", "--model", "15m", "--world", "16", "--seq", "256",
                     "--batch", "16", "--limit", "3", "--machine", "dgx-h100")
    assert len(rows) == 3 and len({r["grid"] for r in rows}) == 3, rows
    for row in rows:
        assert row["bytes = planner"] == "yes", row
        assert float(row["simulated GiB"]) > 0 and row["planner fits"] == "yes", row
