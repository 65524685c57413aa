"""Weak scaling: predicted throughput of a family of GPT-style models, the model growing with
the GPU count (fixed parameters and sequences per GPU), each on its best grid."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fourfold.config import ModelConfig
from fourfold.intmath import GIB
from fourfold.plan.errors import PlanError
from fourfold.plan.catalog import Machine
from fourfold.plan.scaling import count_params, format_count, model_for_params
from fourfold.plan.search import Candidate, plan


@dataclass
class SweepRow:
    gpus: int
    model: ModelConfig
    n_params: int
    global_batch: int
    best: Candidate

    @property
    def tflops_per_gpu(self) -> float:
        p = self.best.prediction
        return p.flops_per_step / p.step_s / self.gpus / 1e12


def gpu_counts(max_gpus: int, start: int) -> list[int]:
    """Doubling GPU counts from `start` (a node) up to `max_gpus`."""
    if max_gpus < 1:
        raise PlanError(f"--gpus {max_gpus}: the largest GPU count must be at least 1")
    counts, n = [], max(1, min(start, max_gpus))
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    return counts


def run_sweep(machine: Machine, counts: list[int], params_per_gpu: float, seq_len: int,
              sequences_per_gpu: int, dtype: str, vocab_size: int = 32000) -> list[SweepRow]:
    """Plan each GPU count with a model of `params_per_gpu` x GPUs parameters."""
    rows = []
    for gpus in counts:
        model = model_for_params(params_per_gpu * gpus, vocab_size, seq_len)
        batch = sequences_per_gpu * gpus
        result = plan(model, gpus, machine, batch, seq_len, dtype)
        rows.append(SweepRow(gpus, model, count_params(model), batch, result.best))
    return rows


def format_sweep(rows: list[SweepRow], machine: Machine) -> str:
    lines = [f"weak scaling on {machine.name} ({machine.device.name}); {machine.note}",
             f"{'GPUs':>6} {'params':>7} {'layers':>6} {'dim':>6} {'best grid d,z,y,x':>18} "
             f"{'step s':>8} {'tokens/s':>11} {'TFLOP/s/GPU':>11} {'MFU':>5} {'eff':>5} "
             f"{'GiB/GPU':>8} fits"]
    first = rows[0].tflops_per_gpu if rows else 1.0
    for r in rows:
        c, p = r.best, r.best.prediction
        grid = f"{c.shape.data},{c.shape.z},{c.shape.y},{c.shape.x}"
        lines.append(f"{r.gpus:>6} {format_count(r.n_params):>7} {r.model.n_layers:>6} "
                     f"{r.model.dim:>6} {grid:>18} {p.step_s:>8.2f} {p.tokens_per_s:>11,.0f} "
                     f"{r.tflops_per_gpu:>11.1f} {p.mfu:>5.0%} {r.tflops_per_gpu / first:>5.0%} "
                     f"{c.memory.total / GIB:>8.1f} {'yes' if c.fits else 'OOM'}")
    return "\n".join(lines)


def plot_sweep(rows: list[SweepRow], machine: Machine, path: str | Path) -> Path:
    """Predicted total PFLOP/s against GPUs (log-log), with the ideal line; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r.gpus for r in rows]
    total = [r.tflops_per_gpu * r.gpus / 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        ax.plot(gpus, total, "o-", label="predicted")
        ax.plot(gpus, [total[0] * g / gpus[0] for g in gpus], "--", color="grey",
                label="ideal (linear)")
        for r, t in zip(rows, total):
            ax.annotate(format_count(r.n_params), (r.gpus, t), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("predicted model PFLOP/s")
        ax.set_title(f"weak scaling on {machine.name} ({machine.device.name})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out
