"""Activation memory per rank of the `debug` model on 1, 2, 4 and 8-rank CPU grids: measured
(bytes autograd saves for backward, once per storage, weights excluded; see
tests/memory_worker.py) beside the planner's prediction, with and without activation
checkpointing. One torchrun launch per world size; rank 0's numbers (ranks of a grid agree;
the table says when they do not).

    python bench/memory.py [--nproc 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "memory_worker.py"

GRIDS = {  # (data, z, y, x); the debug model has 2 kv heads, so y is at most 2
    1: [[1, 1, 1, 1]],
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [1, 2, 1, 2], [2, 2, 1, 1], [1, 1, 1, 4]],
    8: [[1, 2, 2, 2], [2, 1, 2, 2], [2, 2, 2, 1], [1, 1, 1, 8]],
}


def run(nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory.jsonl"
        env = dict(os.environ, FOURFOLD_MEM_SHAPES=json.dumps(GRIDS[nproc]),
                   FOURFOLD_MEM_OUT=str(out), OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(WORKER)]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), str(WORKER)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        if proc.returncode != 0:
            sys.exit(f"error: {nproc}-rank worker failed:\n{proc.stderr[-3000:]}")
        return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=sorted(GRIDS),
                    choices=sorted(GRIDS), help="world sizes to run")
    args = ap.parse_args()
    print("debug model, float32, 2 x 64 tokens per rank; activation MiB per rank")
    print(f"{'data z y x':<11} {'ckpt':>4} {'measured':>9} {'predicted':>9} {'error':>7} "
          f"{'ranks agree':>11}")
    worst = 0.0
    for nproc in args.nproc:
        results = run(nproc)
        for r in results:
            if "error" in r:
                sys.exit(f"error: grid {r['shape']}:\n{r['error']}")
        for r in (r for r in results if r["rank"] == 0):
            same = {o["measured"] for o in results
                    if o["shape"] == r["shape"] and o["ckpt"] == r["ckpt"]}
            error = (r["predicted"] - r["measured"]) / r["measured"]
            worst = max(worst, abs(error))
            print(f"{' '.join(map(str, r['shape'])):<11} {'on' if r['ckpt'] else 'off':>4} "
                  f"{r['measured'] / 2**20:9.3f} {r['predicted'] / 2**20:9.3f} {error:+7.3%} "
                  f"{'yes' if len(same) == 1 else 'no':>11}")
    print(f"largest error: {worst:.2%}")


if __name__ == "__main__":
    main()
