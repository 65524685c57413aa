"""Memory per rank on 1, 2, 4 and 8 ranks, measured beside the planner's prediction.

A short training run of a preset (a few steps, a checkpoint, the final streamed export of
model.safetensors) on each world size, one torchrun launch each; for each rank its peak
resident memory (VmHWM) less that of a process that has only imported fourfold, the planner's
prediction for that rank (fourfold.plan.memory), the peak as a multiple of the model's float32
weights (what sharding should bring below 1 on 8 ranks), and the one-process figures.

    python bench/memory.py [--preset 15m] [--nproc 1 2 4 8] [--steps 3]
        [--async-checkpoint] [--activation-checkpointing] [--phases] [--activations]

The ranks get the malloc tuning that `fourfold train --nproc` gives CPU ranks
(--no-rank-tunables: the in-process part only, as under a launcher of the user's). --phases
adds, per run, VmRSS, VmHWM and glibc's heap in use at each phase (after the grid, the sharded
build, the optimizer, every forward / backward / step, the checkpoint, the export).
--activations: instead, the activation bytes of the `debug` model (what autograd saves for
backward, tests/memory_worker.py) beside the planner's activation model, on every grid.
The `350m` preset needs about 17 GiB on 8 ranks of one host.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# the measuring workers live beside the tests that hold the model to them
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import memory_worker  # noqa: E402
import rank_memory_worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, Table, fail, header, mib, parser  # noqa: E402

from fourfold.config import load_config  # noqa: E402
from fourfold.parallel import GridShape  # noqa: E402
from fourfold.methods import method_spec  # noqa: E402
from fourfold.parallel.embedding import resolve_output_loss  # noqa: E402
from fourfold.plan.memory import Precision, predict_memory  # noqa: E402

TRAIN_GRIDS = {1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 4: (1, 2, 2, 1), 8: (1, 2, 2, 2)}  # data z y x

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
        fail(f"{nproc}-rank worker failed:\n{stderr[-3000:]}")
    return results


def activations_table(nprocs: list[int]) -> None:
    header("Activation memory per rank against the planner, on every grid",
           "the debug model, float32, 2 x 64 tokens per rank; MiB per rank")
    table = Table("grid (data z y x)", "activation checkpointing", "measured MiB",
                  "planner MiB", "error", "ranks agree")
    worst = 0.0
    for nproc in nprocs:
        results = run(nproc)
        for r in results:
            if "error" in r:
                fail(f"grid {r['shape']}:\n{r['error']}")
        for r in (r for r in results if r["rank"] == 0):
            same = {o["measured"] for o in results
                    if o["shape"] == r["shape"] and o["ckpt"] == r["ckpt"]}
            error = (r["predicted"] - r["measured"]) / r["measured"]
            worst = max(worst, abs(error))
            table.row(" ".join(map(str, r["shape"])), "on" if r["ckpt"] else "off",
                      mib(r["measured"], 3), mib(r["predicted"], 3), f"{error:+.3%}",
                      "yes" if len(same) == 1 else "no")
    print(f"\nlargest error: {worst:.2%}")


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
    print(f"\nphases of the {nproc}-rank run (MiB above the import; RSS and HWM: the most over "
          f"the ranks; heap and files: rank {results[worst]['rank']})\n")
    table = Table("#", "after", "RSS", "HWM", "heap used", "heap held", "mapped files")
    for i, phase in enumerate(rows[worst]):
        name = phase[0]
        rss = max(r[i][1] for r in rows if len(r) > i) - base
        hwm = max(r[i][2] for r in rows if len(r) > i) - base
        used, held = phase[3] - heap0[0], phase[4] - heap0[1]
        files = phase[5] - rows[worst][0][5] if len(phase) > 5 else 0
        table.row(i, name, mib(rss), mib(hwm), mib(used), mib(held), mib(files))
    print()


def train_table(preset: str, nprocs: list[int], steps: int, batch: int, seq: int,
                dtype: str, async_checkpoint: bool, phases: bool = False,
                tunables: bool = True, activation_checkpointing: bool = False) -> None:
    from fourfold.models import build_model, model_config

    weights = 4 * build_model(model_config(preset), device="meta").num_params()
    header("Memory per rank on more ranks, against the planner",
           f"{preset} preset ({weights / MIB:,.0f} MiB of float32 weights), {dtype}, {steps} "
           f"steps of {batch} x {seq} tokens, a checkpoint "
           f"({'async' if async_checkpoint else 'sync'}), the streamed export, "
           f"{'the launcher' if tunables else 'in-process'} malloc tuning, activation "
           f"checkpointing {'on' if activation_checkpointing else 'off'}; MiB per rank above a "
           "process that only imported fourfold")
    table = Table("ranks", "grid (data z y x)", "rank", "measured MiB", "planner MiB", "error",
                  "x weights", "one process MiB", "one process planner MiB")
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
                fail(f"{nproc}-rank run failed:\n{stderr[-3000:]}")
            if nproc == 1:
                one_measured = results[0]["peak"] - results[0]["baseline"]
            for r in results:
                measured = r["peak"] - r["baseline"]
                pred = predicted(cfg_path, r["rank"])
                table.row(nproc, " ".join(map(str, TRAIN_GRIDS[nproc])), r["rank"],
                          mib(measured), mib(pred), f"{(pred - measured) / measured:+.1%}",
                          f"{measured / weights:.2f}",
                          mib(one_measured) if one_measured is not None else "-",
                          mib(one_predicted))
            if phases:
                phase_table(nproc, results)


def main() -> None:
    ap = parser(__doc__)
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
