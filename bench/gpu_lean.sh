#!/usr/bin/env bash
# The memory-lean methods on one GPU: run after bench/gpu_smoke.sh. Three parts:
#   1. noise: MeZO's and ES's counter-based noise is the same on the GPU (16 MiB chunks) as on
#      the CPU (1 MiB chunks), and how fast the GPU makes it;
#   2. memory: `bench/memory_lean.py --device cuda` (125m, activation checkpointing; float32 at
#      batch 2 x 128, then 16 x 512 in float32 and in bfloat16): each method's
#      peak GPU memory as a ratio to AdamW's, the planner's GPU prediction beside it, tokens/s;
#   3. trainer: every method through `fourfold train` on the GPU (6 steps of the small preset,
#      a checkpoint at step 3 and 6, train.memory_report on), then resumed from step 3 in a copy
#      of the run: the losses of steps 4-6 against the first run's; the run's peak (on a GPU
#      max_memory_allocated) and its memory_report's measured categories against the planner's.
#      The seven runs of each round share the GPU at once.
#
#   bash bench/gpu_lean.sh                  # about 5 minutes on one H200
#   DEVICE=cpu bash bench/gpu_lean.sh       # parts 1 and 3 on the CPU (a dry run of the script)
#
# Env: PYTHON (default .venv/bin/python, else python3), PRESET (125m, part 2), OUT (a fresh
# temporary directory), DEVICE (cuda). Exits 1 when a check fails, 2 without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PRESET=${PRESET:-125m}
DEVICE=${DEVICE:-cuda}
METHODS="adamw lomo adalomo mezo es blockllm galore"
if [ "$DEVICE" = cuda ] && [ "$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')" != 1 ]; then
    echo "error: gpu_lean.sh needs a CUDA GPU, and torch sees none (DEVICE=cpu runs parts 1 and 3 on the CPU)" >&2
    exit 2
fi
OUT=${OUT:-$(mktemp -d -t fourfold-gpu-lean.XXXX)}
mkdir -p "$OUT"
FAILED=()

echo "== 1. noise on $DEVICE against the CPU"
DEVICE=$DEVICE "$PY" - <<'EOF' || FAILED+=("noise")
import os, time
import torch
from fourfold.noise import ShardNoise, _hash_at, noise_key

device = torch.device(os.environ["DEVICE"])
key = noise_key(0, 7, "layers.3.attention.wq.weight", 2)
# a shard of a 4096 x 6144 weight: rows 1000-3999, columns 2048-5119 (a 2x2-like block)
local, full, offsets = (3000, 3072), (4096, 6144), (1000, 2048)
cpu = ShardNoise(local, full, offsets, torch.device("cpu"))
dev = ShardNoise(local, full, offsets, device)

def whole(noise):
    return torch.cat([noise.sample(a, b, key).cpu() for a, b in noise.chunks()])

c, d = whole(cpu), whole(dev)
coords = lambda dv: [torch.arange(o, o + n, dtype=torch.int32, device=dv)
                     for n, o in zip((64, 3072), offsets)]
same_bits = torch.equal(_hash_at(coords("cpu"), key), _hash_at(coords(device), key).cpu())
diff = (c - d).abs().max().item()
print(f"noise: {len(cpu.chunks())} CPU chunks, {len(dev.chunks())} {device.type} chunks; "
      f"hash bits equal: {same_bits}; max |cpu - {device.type}| = {diff:.2e} "
      f"(std {d.std().item():.4f})")
n = 25_000_000  # about a 125m model's worth of noise without the embeddings
rows = n // 3072
big = ShardNoise((rows, 3072), (rows, 3072), (0, 0), device)
for rep in range(2):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for a, b in big.chunks():
        big.sample(a, b, key)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
print(f"noise rate on {device.type}: {rows * 3072 / elapsed / 1e9:.2f} G elements/s "
      f"({rows * 3072 / 1e6:.0f} M elements in {elapsed * 1e3:.1f} ms, second pass)")
assert same_bits and diff < 1e-5, "the GPU's noise differs from the CPU's"
EOF

if [ "$DEVICE" = cuda ]; then
    for size in "" "--batch 16 --seq 512" "--batch 16 --seq 512 --dtype bfloat16"; do
        echo "== 2. memory and speed: $PY bench/memory_lean.py --device cuda --preset $PRESET --steps 4 $size"
        # shellcheck disable=SC2086  # $size is several arguments
        "$PY" bench/memory_lean.py --device cuda --preset "$PRESET" --steps 4 $size || FAILED+=("memory $size")
    done
fi

echo "== 3. every method through fourfold train on $DEVICE, then resumed from step 3"
train() {  # train METHOD RUN_DIR [extra args]
    local m=$1 dir=$2
    shift 2
    OMP_NUM_THREADS=2 "$PY" -m fourfold train "$@" --out "$dir" --set model.preset=small \
        --set data.path=builtin:stdlib --set data.tokenizer=byte --set train.device="$DEVICE" \
        --set train.optimizer="$m" --set train.steps=6 --set train.batch_size=4 \
        --set train.seq_len=128 --set train.lr=1e-3 --set train.warmup_steps=0 \
        --set train.log_every=1 --set train.eval_every=0 --set train.eval_batches=0 \
        --set train.sample_tokens=0 --set train.memory_report=true \
        --set checkpoint.every=3 --set checkpoint.keep=3 > "$dir.log" 2>&1
}
pids=()
for m in $METHODS; do train "$m" "$OUT/$m" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done  # the table below names a failed run and its log
pids=()
for m in $METHODS; do
    if [ -d "$OUT/$m/checkpoints/step_00000003" ]; then
        cp -r "$OUT/$m" "$OUT/$m-resumed"
        rm -rf "$OUT/$m-resumed/checkpoints/step_00000006" "$OUT/$m-resumed/summary.json"
        train "$m" "$OUT/$m-resumed" --resume & pids+=($!)
    fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$PY" - "$OUT" $METHODS <<'EOF' || FAILED+=("trainer")
import json, math, sys
from pathlib import Path

out, methods = Path(sys.argv[1]), sys.argv[2:]

def losses(run):
    """{step: loss} (a resumed run's last word on a step) and the steps in logged order."""
    by_step, order = {}, []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" in m:
            by_step[m["step"]] = m["loss"]
            order.append(m["step"])
    return by_step, order

print("| method | loss step 1 -> 6 | resumed 4-6, max abs diff | peak | memory_report: measured "
      "| planner | error |")
print("|---|---|---|---|---|---|---|")
bad = []
for m in methods:
    first, resumed = out / m, out / f"{m}-resumed"
    if not (first / "summary.json").is_file():
        print(f"| {m} | failed: see {first}.log |")
        bad.append(m)
        continue
    a, _ = losses(first)
    summary = json.loads((first / "summary.json").read_text())
    report = summary.get("memory_report") or {}
    peak = summary.get("peak_mem_bytes", 0)
    # the sum of the categories (parameters, gradients, optimizer state, activations, buffers)
    measured = sum((report.get("measured_per_rank") or [{}])[0].values())
    predicted = sum((report.get("predicted_per_rank") or {}).values())
    if (resumed / "summary.json").is_file():
        b, order = losses(resumed)
        diff = max(abs(a[s] - b[s]) for s in (4, 5, 6))
        resumed_text = f"{diff:.2e}"
        # a run started over would log the same losses: the copy's steps 1-6, then 4-6 again
        if order != [1, 2, 3, 4, 5, 6, 4, 5, 6]:
            resumed_text = f"did not resume from step 3 (steps logged: {order})"
            bad.append(f"{m} resume")
        elif diff > 1e-4:
            bad.append(f"{m} resume")
    else:
        resumed_text = f"failed: see {resumed}.log"
        bad.append(f"{m} resume")
    if not all(math.isfinite(a[s]) for s in range(1, 7)):
        bad.append(f"{m} loss")
    err_text = f"{predicted / measured - 1:+.1%}" if predicted and measured else "-"
    print(f"| {m} | {a[1]:.4f} -> {a[6]:.4f} | {resumed_text} | {peak / 2**20:.0f} MiB "
          f"| {measured / 2**20:.0f} MiB | {predicted / 2**20:.0f} MiB | {err_text} |")
if bad:
    sys.exit(f"error: {', '.join(bad)} (logs beside the run dirs in {out})")
EOF
echo "run dirs and logs: $OUT"
if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "error: ${#FAILED[@]} part(s) failed: ${FAILED[*]}" >&2
    exit 1
fi
