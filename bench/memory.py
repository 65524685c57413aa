"""Activation memory per rank of the `debug` model on 1, 2, 4 and 8-rank CPU grids: measured
(bytes autograd saves for backward, once per storage, weights excluded; see
tests/memory_worker.py) beside the planner's prediction, with and without activation
checkpointing. One torchrun launch per world size; rank 0's numbers (ranks of a grid agree;
the table says when they do not).

    python bench/memory.py [--nproc 1 2 4 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# the measuring worker lives beside the test that holds the model to it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import memory_worker  # noqa: E402

GRIDS = {  # (data, z, y, x); the debug model has 2 kv heads, so y is at most 2
    1: [[1, 1, 1, 1]],
    2: [[1, 1, 1, 2], [1, 1, 2, 1], [1, 2, 1, 1], [2, 1, 1, 1]],
    4: [[1, 1, 2, 2], [1, 2, 1, 2], [2, 2, 1, 1], [1, 1, 1, 4]],
    8: [[1, 2, 2, 2], [2, 1, 2, 2], [2, 2, 2, 1], [1, 1, 1, 8]],
}


def run(nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        results, stderr = memory_worker.launch(nproc, GRIDS[nproc], Path(tmp) / "memory.jsonl")
    if results is None:
        sys.exit(f"error: {nproc}-rank worker failed:\n{stderr[-3000:]}")
    return results


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
