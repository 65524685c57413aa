#!/usr/bin/env bash
# GPU smoke test: train the 125m and 1b presets in bfloat16 for a few steps on one GPU (as it
# is, and through the whole engine as a one-rank grid: parallel.engine = "always"), and on all
# visible GPUs with a grid when there are several; print tokens/s, MFU and peak memory per
# GPU. Before them, the one-rank engine check (engine_check below) and one rank of a 70b job on
# 1,024 GPUs run for real on this GPU with fake collectives (simulate_check below, a minute or
# two). Exits 2 with one line when no CUDA GPU is visible, 1 when a run or a check fails.
#
#   bash bench/gpu_smoke.sh                 # everything (about 2-4 minutes on one H100/H200)
#   STEPS=10 PRESETS="125m" bash bench/gpu_smoke.sh
#   bash bench/gpu_smoke.sh --dry-run       # print the runs it would start, start nothing
#   bash bench/gpu_smoke.sh --table RUN_DIR...   # only the table, for finished run dirs
#
# Env: PYTHON (default .venv/bin/python, else python3), STEPS (6), PRESETS ("125m 1b"),
# SEQ_LEN (1024), OUT (a fresh temporary directory), RUN_TIMEOUT (seconds per run, 600),
# SIMULATE ("70b:1024:128"; empty: no simulate check).
# tokens/s and MFU are the median over the steps after the first two (compilation of
# kernels, cuBLAS and NCCL set-up); "alloc GiB" is rank 0's torch.cuda.max_memory_allocated,
# "plan GiB" the planner's peak per rank for the run's config (plan/memory.py, as on a GPU),
# "GPU GiB" the most nvidia-smi saw used on each GPU during the run (context included).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
STEPS=${STEPS:-6}
PRESETS=${PRESETS:-"125m 1b"}
SEQ_LEN=${SEQ_LEN:-1024}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}

table() {  # table RUN_DIR... : one row per run (reads summary.json, metrics.jsonl, gpu_mem.csv)
    "$PY" - "$@" <<'EOF'
import json, statistics, sys
from pathlib import Path

sys.path.insert(0, "bench")
from common import Table, header

from fourfold.config import load_config
from fourfold.parallel import GridShape
from fourfold.plan.memory import predicted_memory

header("GPU smoke: the presets in bfloat16 on one GPU and on all of them",
       command="bash bench/gpu_smoke.sh",
       notes="tokens/s and MFU: the median of the steps after the first two; alloc: rank 0's "
             "torch.cuda.max_memory_allocated; planner: its peak per rank; GPU: what "
             "nvidia-smi saw")
table = Table("run", "grid", "tokens/s", "MFU", "alloc GiB", "planner GiB", "GPU GiB (per GPU)")
for run in map(Path, sys.argv[1:]):
    summary = run / "summary.json"
    if not summary.is_file():
        table.row(run.name, f"failed (no summary.json; see {run}.log)", *["-"] * 5)
        continue
    s = json.loads(summary.read_text())
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "tokens_per_s" in m]
    warm = steps[2:] or steps
    tps = statistics.median(m["tokens_per_s"] for m in warm)
    mfus = [m["mfu"] for m in warm if m.get("mfu") is not None]
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "-"
    per_gpu = {}
    mem = run.parent / f"{run.name}.gpu_mem.csv"
    if mem.is_file():
        for line in mem.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                per_gpu[int(parts[0])] = max(per_gpu.get(int(parts[0]), 0), int(parts[1]))
    gpus = " ".join(f"{i}:{mib / 1024:.1f}" for i, mib in sorted(per_gpu.items())) or "-"
    # the planner's peak for this run's config and grid, as on a GPU (no host runtime)
    shape = GridShape(**{k: int(v) for k, v in (kv.split("=") for kv in s["grid"].split())})
    plan = predicted_memory(load_config(run / "config.toml"), shape, on_host=False).total
    table.row(run.name, s["grid"], f"{tps:,.0f}", mfu, f"{s['peak_mem_bytes'] / 2**30:.2f}",
              f"{plan / 2**30:.2f}", gpus)
EOF
}

if [ "${1:-}" = "--table" ]; then
    shift
    table "$@"
    exit 0
fi
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() * torch.cuda.is_available())')
if [ "$NGPU" -lt 1 ] && [ "$DRY" = 0 ]; then
    echo "error: gpu_smoke.sh needs a CUDA GPU, and torch sees none (torch.cuda.is_available()" \
         "is False; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}, torch" \
         "$("$PY" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
[ "$DRY" = 1 ] && [ "$NGPU" -lt 1 ] && NGPU=${DRY_GPUS:-8}

# The grid on all GPUs: x, then y, then z get 2 where the GPU count allows, data the rest.
GRID_SET=""
if [ "$NGPU" -gt 1 ]; then
    x=1; y=1; z=1; left=$NGPU
    for axis in x y z; do
        if [ $((left % 2)) = 0 ]; then eval "$axis=2"; left=$((left / 2)); fi
    done
    GRID_SET="--set parallel.x=$x --set parallel.y=$y --set parallel.z=$z --set parallel.data=auto"
fi

OUT=${OUT:-$(mktemp -d -t fourfold-gpu-smoke.XXXX)}
mkdir -p "$OUT"
[ "$DRY" = 0 ] && "$PY" -c 'import torch
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL",
      ".".join(map(str, torch.cuda.nccl.version())))'

# Host synchronisations inside a training step (forward, backward, gradient sync, optimizer)
# show only on a GPU: torch.cuda.set_sync_debug_mode("error") turns the first into an error.
sync_check() {
    "$PY" - <<'PYEOF'
import torch
from fourfold.config import model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, parallelize

device = torch.device("cuda", 0)
pmodel = parallelize(build_model(model_config("debug"), seed=0).to(device), Grid.single(device))
opt = torch.optim.AdamW(pmodel.module.parameters(), lr=1e-3, fused=True)
tokens = torch.randint(0, 512, (4, 65), device=device)
for step in range(3):  # the first step may set things up; the later ones must not sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if step else "default")
    try:
        pmodel(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        pmodel.finish_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    except RuntimeError as error:
        torch.cuda.set_sync_debug_mode("default")
        print(f"sync check: step {step} synchronised with the host: {str(error).splitlines()[0]}")
        raise SystemExit(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
print("sync check: no host synchronisation in forward, backward, gradient sync and AdamW")

# The trainer's whole step (batch copy, loss guard, device-side skip): steps that do not log
# must not wait for the GPU; a logging step reads its numbers (and may).
import tempfile
from fourfold.config import load_config
from fourfold.train import Trainer

cfg = load_config(None, ["model.preset=debug", "data.path=builtin:stdlib", "data.tokenizer=byte",
                         "train.device=cuda", "train.steps=4", "train.batch_size=4",
                         "train.seq_len=64", "train.log_every=100", "train.eval_batches=0",
                         "train.sample_tokens=0", "train.spike_threshold=3",
                         "train.nan_policy=skip", "train.grad_accum=2"])
trainer = Trainer(cfg, tempfile.mkdtemp(), progress=False)
for step in range(3):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error" if step else "default")
    try:
        trainer.train_step()
    except RuntimeError as error:
        torch.cuda.set_sync_debug_mode("default")
        print(f"sync check: trainer step {step + 1} synchronised with the host: "
              f"{str(error).splitlines()[0]}")
        raise SystemExit(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
print("sync check: no host synchronisation in the trainer's steps between logging steps")
PYEOF
}

# The whole engine on this one GPU (parallel.engine = "always": a one-rank NCCL group, the
# parallel layers and their collectives, the bucket views, the DTensor checkpoint), in a
# process of its own (CUDA_DEVICE_MAX_CONNECTIONS is read when CUDA starts). Fails on: the
# NCCL settings not taking (connections, stream priorities), losses away from the plain
# one-GPU path's, a run resumed from its checkpoint that does not go on as the whole run did.
engine_check() {
    "$PY" - "$OUT/engine-check" "${ENGINE_CHECK_DEVICE:-cuda}" <<'PYEOF'
import os, sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from fourfold.config import load_config
from fourfold.train import Trainer
from fourfold.train.metrics import read_metrics

out, device = Path(sys.argv[1]), sys.argv[2]
user_connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")


def train(name, engine, steps):
    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = load_config(None, [
        "model.preset=debug", "data.path=builtin:stdlib", "data.tokenizer=byte",
        f"train.device={device}", f"train.dtype={dtype}", f"train.steps={steps}",
        "train.batch_size=8", "train.seq_len=256", "train.warmup_steps=2", "train.log_every=1",
        "train.eval_batches=0", "train.sample_tokens=0", "checkpoint.every=2",
        "checkpoint.async=false", f"parallel.engine={engine}"])
    trainer = Trainer(cfg, out / name, progress=False)
    trainer.fit()
    losses = [m["loss"] for m in read_metrics(out / name / "metrics.jsonl")
              if "loss" in m and "step" in m]
    return trainer, losses


problems = []
trainer, engine = train("engine", "always", 4)  # first: CUDA starts in this run
backend = dist.get_backend()
print(f"engine check: one-rank {backend} group, {trainer.grid.shape}, losses "
      + " ".join(f"{x:.4f}" for x in engine))
if device == "cuda":
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if backend != "nccl" or connections != (user_connections or "1"):
        problems.append(f"backend {backend}, CUDA_DEVICE_MAX_CONNECTIONS={connections}")
    for axis in ("x", "y", "z", "data"):
        group = trainer.grid.group(axis)
        high = group._get_backend(torch.device("cuda")).options.is_high_priority_stream
        if high != (axis != "data"):
            problems.append(f"the {axis} group's stream is{'' if high else ' not'} high-priority")
_, parts = train("parts", "always", 2)  # the same run in two parts: the second resumes
_, parts = train("parts", "always", 4)
whole = load_file(str(out / "engine" / "model.safetensors"))
resumed = load_file(str(out / "parts" / "model.safetensors"))
unequal = [n for n in whole if not torch.equal(whole[n], resumed[n])]
if parts != engine or unequal:
    problems.append(f"resumed from step 2 the run went elsewhere: losses {parts} against "
                    f"{engine}; weights unequal: {unequal[:3]}")
_, plain = train("plain", "auto", 4)
drift = max(abs(a - b) / abs(b) for a, b in zip(engine, plain))
print(f"engine check: the plain one-GPU path's losses " + " ".join(f"{x:.4f}" for x in plain)
      + f" (largest relative difference {drift:.1e})")
if drift > (2e-2 if device == "cuda" else 1e-5):  # bfloat16 on the GPU: test_parallel's bound
    problems.append(f"losses drift {drift:.1e} from the plain path")
for problem in problems:
    print(f"engine check: FAILED: {problem}")
print("engine check: " + ("failed" if problems else "ok"))
sys.exit(1 if problems else 0)
PYEOF
}

# One rank of a large job on this one GPU (`fourfold simulate --device cuda`): the last rank of
# 70b on 1,024 GPUs (the planner's grid on dgx-h100, bfloat16, sequence 8192, activation
# checkpointing), built with its real shards and run through Trainer.fit for two steps (the log,
# validations, the sample, a checkpoint's staging and the export) with real kernels while the
# collectives stay on torch's fake process group. Prints the simulate table: the real peak (torch.cuda.max_memory_allocated) and compute
# time per step beside the planner's. Not rank 0: its export assembles every full tensor of the
# model in host memory, minutes for 70b. SIMULATE="MODEL:WORLD:BATCH" picks another case;
# SIMULATE="" skips it.
SIMULATE=${SIMULATE-70b:1024:128}
simulate_check() {
    [ -n "$SIMULATE" ] || return 0
    local model world batch
    IFS=: read -r model world batch <<<"$SIMULATE"
    local args=(-m fourfold simulate --world "$world" --ranks "$((world - 1))" --device cuda
        --machine dgx-h100 --set model.preset="$model" --set train.dtype=bfloat16
        --set train.seq_len=8192 --set train.batch_size="$batch"
        --set train.activation_checkpointing=true --set parallel.auto=true)
    echo "== simulate-$model-$world: $PY ${args[*]}"
    [ "$DRY" = 1 ] && return 0
    if timeout "$RUN_TIMEOUT" "$PY" "${args[@]}" 2>"$OUT/simulate.log"; then
        return 0
    fi
    echo "   FAILED (exit $?); last lines of $OUT/simulate.log:"
    tail -n 5 "$OUT/simulate.log" | sed 's/^/   /'
    return 1
}

RUNS=()
FAILED=()
run() {  # run NAME NPROC BATCH PRESET [--set ...]
    local name=$1 nproc=$2 batch=$3 preset=$4
    shift 4
    local args=(-m fourfold train --out "$OUT/$name" --nproc "$nproc"
        --set model.preset="$preset" --set data.path=builtin:stdlib --set data.tokenizer=byte
        --set train.device=cuda --set train.dtype=bfloat16 --set train.steps="$STEPS"
        --set train.batch_size="$batch" --set train.seq_len="$SEQ_LEN" --set train.warmup_steps=2
        --set train.log_every=1 --set train.eval_every="$STEPS" --set train.eval_batches=1
        --set train.sample_tokens=8 --set checkpoint.every=0 "$@")
    echo "== $name: $PY ${args[*]}"
    RUNS+=("$OUT/$name")
    [ "$DRY" = 1 ] && return 0
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 \
        > "$OUT/$name.gpu_mem.csv" 2>/dev/null &
    local smi=$!
    if timeout "$RUN_TIMEOUT" "$PY" "${args[@]}" > "$OUT/$name.log" 2>&1; then
        grep -E '^(fourfold:|done:)' "$OUT/$name.log" || true
    else
        echo "   FAILED (exit $?); last lines of $OUT/$name.log:"
        tail -n 5 "$OUT/$name.log" | sed 's/^/   /'
        FAILED+=("$name")
    fi
    kill "$smi" 2>/dev/null || true
    wait "$smi" 2>/dev/null || true
}

if [ "$DRY" = 0 ] && ! sync_check; then FAILED+=("sync-check"); fi
if [ "$DRY" = 0 ] && ! engine_check; then FAILED+=("engine-check"); fi
if ! simulate_check; then FAILED+=("simulate"); fi

for preset in $PRESETS; do
    case $preset in 1b) per_gpu=4 ;; *) per_gpu=8 ;; esac
    run "$preset-1gpu" 1 "$per_gpu" "$preset"
    run "$preset-1gpu-engine" 1 "$per_gpu" "$preset" --set parallel.engine=always
    if [ "$NGPU" -gt 1 ]; then
        # shellcheck disable=SC2086  # GRID_SET is several words on purpose
        run "$preset-${NGPU}gpu" "$NGPU" $((per_gpu * NGPU)) "$preset" $GRID_SET
    fi
done

[ "$DRY" = 1 ] && exit 0
echo
table "${RUNS[@]}"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "error: ${#FAILED[@]} run(s) failed: ${FAILED[*]} (logs in $OUT)" >&2
    exit 1
fi
echo "run dirs and logs: $OUT"
