"""Peak memory of `fourfold train` as a user starts it, against the planner's prediction.

bench/memory_lean.py trains each method through the library at the issue's fixed shape; this
script runs the command line itself, `fourfold train CONFIG [--nproc N]`, on one process and on
grids (examples/grid_2x2.toml's data and model unless told, with --set overrides), with and
without periodic checkpoints, and reads rank 0's peak resident memory from the run's
summary.json (`peak_mem_bytes`: VmHWM) less that of a process that only runs `import torch,
fourfold` under the malloc tunables `fourfold train` runs its CPU processes with. Beside it:
`fourfold.plan.memory.predicted_memory` of the run's own config.toml, the planner's total
for a CPU rank (what `fourfold plan` and the run's fits-check use).

    python bench/train_memory.py [--preset 15m] [--methods adamw lomo mezo]
        [--grids 1x1 2x2] [--every 0 2] [--steps 4] [--config examples/grid_2x2.toml]
        [--set SECTION.KEY=VALUE ...] [--keep DIR]

Each run trains --steps steps without validation or samples (train.eval_batches = 0,
train.sample_tokens = 0); --every E writes a checkpoint every E steps (0: none). A row is one
run: method, grid, checkpoint.every, rank 0's peak (MiB), the planner's (MiB) and its error,
(planner - measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from memory_lean import parse_grid  # XxY, one line on a bad value

METHODS = ("adamw", "lomo", "adalomo", "mezo", "es", "blockllm", "galore")
# the baseline reads its peak as the run's summary does (and bench/memory_lean.py's baseline)
BASELINE = ("import torch, fourfold\n"
            "from fourfold.train.metrics import peak_memory_bytes\n"
            "print(peak_memory_bytes(torch.device('cpu')))")


def baseline_bytes() -> int:
    """VmHWM of a process that only imports torch and fourfold, with the malloc tunables
    `fourfold train` runs its CPU processes under (its ranks and one process alike)."""
    from fourfold.host import rank_malloc_environment

    env = dict(os.environ, **rank_malloc_environment())
    out = subprocess.run([sys.executable, "-c", BASELINE], env=env, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def run(args: argparse.Namespace, method: str, grid: tuple[int, int], every: int,
        out: Path) -> tuple[int, int]:
    """One `fourfold train` run; (rank 0's peak bytes, the planner's bytes per rank)."""
    from fourfold.config import load_config
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import predicted_memory

    x, y = grid
    shutil.rmtree(out, ignore_errors=True)  # a run directory with a checkpoint would resume
    sets = [f"model.preset={args.preset}", f"train.steps={args.steps}",
            "train.eval_batches=0", "train.sample_tokens=0", f"checkpoint.every={every}",
            f"train.optimizer={method}", f"parallel.x={x}", f"parallel.y={y}",
            "parallel.z=1", *args.extra]
    cmd = [sys.executable, "-m", "fourfold", "train", args.config, "--out", str(out)]
    if x * y > 1:
        cmd += ["--nproc", str(x * y)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {method} on {x}x{y} (every {every}) failed:\n{proc.stderr[-2000:]}")
    peak = int(json.loads((out / "summary.json").read_text())["peak_mem_bytes"])
    cfg = load_config(out / "config.toml")
    shape = GridShape(data=1, z=1, y=y, x=x)
    return peak, int(predicted_memory(cfg, shape, on_host=True).total)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="15m")
    ap.add_argument("--methods", nargs="+", default=["adamw", "lomo", "mezo"], choices=METHODS)
    ap.add_argument("--grids", nargs="+", default=["1x1", "2x2"], metavar="XxY")
    ap.add_argument("--every", nargs="+", type=int, default=[0, 2],
                    help="checkpoint.every of the runs (0: no checkpoints)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--config", default="examples/grid_2x2.toml")
    ap.add_argument("--set", dest="extra", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="more overrides for every run")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="keep the runs' directories under DIR (default: a temporary folder)")
    return ap


def main() -> None:
    args = parser().parse_args()
    grids = [parse_grid(g, "--grids") for g in args.grids]
    if args.steps < 1:
        sys.exit(f"error: --steps {args.steps}: must be at least 1")
    if any(e < 0 for e in args.every):
        sys.exit(f"error: --every {args.every}: each must be 0 (no checkpoints) or more")
    if not Path(args.config).is_file():
        sys.exit(f"error: --config {args.config!r}: no such file")
    base = baseline_bytes()
    print(f"baseline (import torch, fourfold): {base / 2**20:.0f} MiB")
    print(f"{args.preset}, {args.steps} steps; rank 0's peak above the baseline (MiB)")
    print(f"{'method':9s} {'grid':5s} {'every':>5s} {'measured':>9s} {'planner':>8s} "
          f"{'error':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for method in args.methods:
            for x, y in grids:
                for every in args.every:
                    out = root / f"{method}_{x}x{y}_every{every}"
                    peak, planned = run(args, method, (x, y), every, out)
                    measured = peak - base
                    print(f"{method:9s} {x}x{y:<3d} {every:5d} {measured / 2**20:9.1f} "
                          f"{planned / 2**20:8.1f} {100 * (planned - measured) / measured:+6.1f}%",
                          flush=True)


if __name__ == "__main__":
    main()
