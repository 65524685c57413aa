"""Memory per rank, measured beside the planner's prediction (plan/memory.py).

Default: a short training run of a preset (a few steps, a checkpoint, the final streamed
export of model.safetensors) on 1, 2, 4 and 8 ranks; for each rank its peak resident memory
(VmHWM) less that of a process that has only imported fourfold, the planner's prediction for
that rank, and the one-process figures. One torchrun launch per world size.

    python bench/memory.py [--preset 15m] [--nproc 1 2 4 8] [--steps 3]

The ranks get the malloc tuning that `fourfold train --nproc` gives CPU ranks
(--no-rank-tunables: the in-process part only, as under a launcher of the user's). With
--phases: VmRSS, VmHWM and glibc's heap in use at each phase of each run (after the grid, the
sharded build, the optimizer, every forward / backward / step, the checkpoint, the export).
The `350m` preset needs about 17 GiB on 8 ranks of one host. With --activations: the
activation bytes of the `debug` model (what autograd saves for backward, see
tests/memory_worker.py) beside the planner's activation model, on every grid.

Measured on the shared 2-core, 24 GiB machine (350m preset, 1,426 MiB of float32 weights,
`--preset 350m --steps 2 --nproc N [--async-checkpoint] [--activation-checkpointing]`), MiB per
rank above the import, range over the ranks, planner's prediction, x the weights:

    ranks  grid (d z y x)  checkpoint  act. ckpt  measured       predicted  error       x weights
      1    1 1 1 1         sync        off        6,635          6,572      -1.0%       4.65
      2    1 2 1 1         sync        off        3,729-3,757    3,532      -5.3..-6.0% 2.61-2.63
      4    1 2 2 1         sync        off        1,917-1,929    1,835      -4.2..-4.8% 1.34-1.35
      8    1 2 2 2         sync        off        1,019-1,042    1,010      -0.8..-3.1% 0.71-0.73
      8    1 2 2 2         sync        on           911-936      867/894*   -4.5..-7.0% 0.64-0.66
      8    1 2 2 2         async       off        1,533-1,561    1,545      +0.8..-1.0% 1.07-1.09
    (* rank 0 writes the export.) History of the 8-rank sync row: 1,770-2,173 before the
    coalescing malloc tuning (train/host_memory.py); 1,117-1,155 (0.78-0.81x) before RMSNorm and
    SwiGLU kept only their inputs for backward; 1,041-1,079 (0.73-0.76x) before SwiGLU's down
    projection recomputed its input (models/llama.py down_projection). With --no-rank-tunables
    (no tcache switch, as under torchrun) it read 1,594-1,961 (1.12-1.37x) before those two.
An async checkpoint's snapshot (weights and AdamW moments, 0.375x the weights on 8 ranks) is
alive through the next step, so a CPU rank with one cannot go below 0.875x: that is why
checkpoint.async = "auto" (the default) writes a CPU rank's checkpoints synchronously. The
activations at 8 x 64 tokens are 0.11x of the weights without activation checkpointing
(0.5x is the model state, 0.09x the other terms: runtime, gather buffers, logits), 0.01x
with it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# the measuring workers live beside the tests that hold the model to them
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import memory_worker  # noqa: E402
import rank_memory_worker  # noqa: E402

from fourfold.config import load_config  # noqa: E402
from fourfold.parallel import GridShape  # noqa: E402
from fourfold.methods import method_spec  # noqa: E402
from fourfold.parallel.embedding import resolve_output_loss  # noqa: E402
from fourfold.plan.memory import Precision, predict_memory  # noqa: E402

TRAIN_GRIDS = {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 4: (1, 2, 2, 1), 8: (1, 2, 2, 2)}  # data z y x
MIB = 2**20

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


def activations_table(nprocs: list[int]) -> None:
    print("debug model, float32, 2 x 64 tokens per rank; activation MiB per rank")
    print(f"{'data z y x':<11} {'ckpt':>4} {'measured':>9} {'predicted':>9} {'error':>7} "
          f"{'ranks agree':>11}")
    worst = 0.0
    for nproc in nprocs:
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


def train_config(preset: str, nproc: int, steps: int, batch: int, seq: int, dtype: str,
                 run_dir: Path, async_checkpoint: bool,
                 activation_checkpointing: bool = False) -> Path:
    data, z, y, x = TRAIN_GRIDS[nproc]
    cfg = load_config(None, [f"model.preset={preset}", f"train.steps={steps}",
                             f"train.batch_size={batch}", f"train.seq_len={seq}",
                             f"train.dtype={dtype}", "train.eval_batches=0",
                             "train.sample_tokens=0", "train.log_every=1",
                             f"checkpoint.every={max(1, steps - 1)}", "checkpoint.keep=1",
                             f"checkpoint.async={'true' if async_checkpoint else 'false'}",
                             "train.activation_checkpointing="
                             + str(activation_checkpointing).lower(),
                             f"parallel.x={x}", f"parallel.y={y}", f"parallel.z={z}",
                             f"parallel.data={data}"])
    path = run_dir / "bench_config.toml"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(path)
    return path


def predicted(cfg_path: Path, rank: int) -> int:
    cfg = load_config(cfg_path)
    p, t = cfg.parallel, cfg.train
    shape = GridShape(data=int(p.data), z=p.z, y=p.y, x=p.x)
    micro_tokens = t.batch_size // (shape.data * shape.z) // t.grad_accum * t.seq_len
    return predict_memory(cfg.model, shape, micro_tokens, t.activation_checkpointing,
                          Precision.of(t.dtype), bucket_bytes=int(p.bucket_mb * MIB),
                          on_host=True, writer=rank == 0,
                          async_checkpoint=cfg.checkpoint.is_async(True)
                          and cfg.checkpoint.every > 0,
                          output_loss=resolve_output_loss(
                              p.output_loss, method_spec(t.optimizer).blocked_loss),
                          grad_accum=t.grad_accum).total


def phase_table(nproc: int, results: list[dict]) -> None:
    """Per phase (in order): the largest VmRSS and VmHWM over the ranks, and glibc's heap in
    use and held (held includes the untouched top pad of the tuned heap) and the resident
    pages of mapped files (libraries) of the rank with the largest peak; MiB above the import
    baseline."""
    rows = [r["phases"] for r in results]
    worst = max(range(len(results)), key=lambda i: results[i]["peak"])
    base = results[worst]["baseline"]
    heap0 = rows[worst][0][3], rows[worst][0][4]
    print(f"  phases of the {nproc}-rank run (MiB above import; rss/hwm: max over ranks; heap: "
          f"rank {results[worst]['rank']})")
    print(f"  {'#':>3} {'after':<24} {'rss':>7} {'hwm':>7} {'heap used':>9} {'heap held':>9} "
          f"{'files':>6}")
    for i, phase in enumerate(rows[worst]):
        name = phase[0]
        rss = max(r[i][1] for r in rows if len(r) > i) - base
        hwm = max(r[i][2] for r in rows if len(r) > i) - base
        used, held = phase[3] - heap0[0], phase[4] - heap0[1]
        files = phase[5] - rows[worst][0][5] if len(phase) > 5 else 0
        print(f"  {i:>3} {name:<24} {rss / MIB:7,.0f} {hwm / MIB:7,.0f} {used / MIB:9,.0f} "
              f"{held / MIB:9,.0f} {files / MIB:6,.0f}", flush=True)


def train_table(preset: str, nprocs: list[int], steps: int, batch: int, seq: int,
                dtype: str, async_checkpoint: bool, phases: bool = False,
                tunables: bool = True, activation_checkpointing: bool = False) -> None:
    from fourfold.models import build_model, model_config

    weights = 4 * build_model(model_config(preset), device="meta").num_params()
    print(f"{preset} preset ({weights / MIB:,.0f} MiB of float32 weights), {dtype}, {steps} "
          f"steps of {batch} x {seq} tokens, a checkpoint "
          f"({'async' if async_checkpoint else 'sync'}), the streamed export, "
          f"{'the launcher' if tunables else 'in-process'} malloc tuning, activation checkpointing "
          f"{'on' if activation_checkpointing else 'off'}; MiB per rank "
          "above a process that only imported fourfold")
    print(f"{'ranks':>5} {'data z y x':<11} {'rank':>4} {'measured':>9} {'predicted':>9} "
          f"{'error':>7} {'x weights':>9} {'1-proc meas':>11} {'1-proc pred':>11}")
    one_measured: float | None = None
    with tempfile.TemporaryDirectory() as tmp:
        one_cfg = train_config(preset, 1, steps, batch, seq, dtype, Path(tmp) / "one",
                               async_checkpoint, activation_checkpointing)
        one_predicted = predicted(one_cfg, 0)
        for nproc in nprocs:
            run_dir = Path(tmp) / f"run{nproc}"
            cfg_path = train_config(preset, nproc, steps, batch, seq, dtype, run_dir,
                                    async_checkpoint, activation_checkpointing)
            results, stderr = rank_memory_worker.launch(
                nproc, "train", Path(tmp) / f"mem{nproc}.jsonl",
                {"FOURFOLD_RANK_MEM_CONFIG": str(cfg_path),
                 "FOURFOLD_RANK_MEM_RUN": str(run_dir),
                 "FOURFOLD_RANK_MEM_PHASES": "1" if phases else "0",
                 "FOURFOLD_RANK_MEM_TUNABLES": "1" if tunables else "0"}, timeout_s=3600)
            if results is None:
                sys.exit(f"error: {nproc}-rank run failed:\n{stderr[-3000:]}")
            if nproc == 1:
                one_measured = results[0]["peak"] - results[0]["baseline"]
            for r in results:
                measured = r["peak"] - r["baseline"]
                pred = predicted(cfg_path, r["rank"])
                one = f"{one_measured / MIB:11,.0f}" if one_measured is not None else \
                    f"{'-':>11}"
                print(f"{nproc:>5} {' '.join(map(str, TRAIN_GRIDS[nproc])):<11} {r['rank']:>4} "
                      f"{measured / MIB:9,.0f} {pred / MIB:9,.0f} "
                      f"{(pred - measured) / measured:+7.1%} {measured / weights:9.2f} "
                      f"{one} {one_predicted / MIB:11,.0f}", flush=True)
            if phases:
                phase_table(nproc, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="15m", help="model preset of the training runs")
    ap.add_argument("--nproc", type=int, nargs="+", default=sorted(GRIDS),
                    choices=sorted(GRIDS), help="world sizes to run")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step, whole job")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--async-checkpoint", action="store_true",
                    help="checkpoint.async = true (the default, \"auto\", writes a CPU rank's "
                    "checkpoints synchronously): a host snapshot of the shards, which on a CPU "
                    "rank holds its weights and AdamW states once more")
    ap.add_argument("--no-rank-tunables", action="store_true",
                    help="start the ranks without the GLIBC_TUNABLES that `fourfold train "
                    "--nproc` sets (as under torchrun: the in-process malloc tuning only)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--phases", action="store_true",
                    help="also a table of resident memory and glibc's heap at each phase of "
                    "each run (build, each forward/backward/step, checkpoint, export)")
    ap.add_argument("--activations", action="store_true",
                    help="the activation-memory table of the debug model instead")
    args = ap.parse_args()
    if args.activations:
        activations_table(args.nproc)
    else:
        train_table(args.preset, sorted(args.nproc), args.steps, args.batch_size, args.seq_len,
                    args.dtype, args.async_checkpoint, args.phases,
                    not args.no_rank_tunables,
                    args.activation_checkpointing)


if __name__ == "__main__":
    main()
