"""Packed documents against plain causal attention: what keeping attention inside each document
(and restarting positions) costs a training step, at the same tokens. Rows of --seq positions
hold --docs documents each (equal lengths, and uneven ones), against the same tokens read as one
causal sequence a row. A step: forward, backward and AdamW's update; the layouts alternate step
by step, and "vs causal" is the median of each step's ratio to the causal step beside it, so
that a shared machine's drifting load falls on both alike.

    python bench/packing.py [--preset small] [--seq 1024] [--docs 4] [--batch 4] [--steps 12]
                            [--device cpu|cuda] [--dtype float32|bfloat16]

On a CPU each document (short ones grouped) runs its own SDPA; on a GPU variable-length flash
attention (bfloat16) or flex attention (float32) runs the rows at once (models/attention.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, parser  # noqa: E402


def document_ids(batch: int, seq: int, lengths: list[int]):  # noqa: ANN201
    import torch

    row = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                  torch.tensor(lengths))
    return row.expand(batch, seq).contiguous()


def uneven(seq: int, docs: int, seed: int = 0) -> list[int]:
    """`docs` lengths summing to seq, the longest several times the shortest."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, seq), docs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq])]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    a = ap.parse_args()
    if a.steps < 3:
        fail(f"--steps {a.steps}: must be at least 3 (the first two are not timed)")
    if not 1 <= a.docs <= a.seq:
        fail(f"--docs {a.docs}: expected 1..{a.seq} documents a row")

    import torch

    from fourfold.config import model_config
    from fourfold.models import build_model
    from fourfold.models.attention import attention_kernel

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device is visible")
    device = torch.device(a.device)
    cfg = model_config(a.preset, max_seq_len=max(a.seq, model_config(a.preset).max_seq_len))
    model = build_model(cfg, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    even = [a.seq // a.docs + (i < a.seq % a.docs) for i in range(a.docs)]
    layouts = {"causal, one sequence a row": None,
               f"{a.docs} documents a row, equal": document_ids(a.batch, a.seq, even),
               f"{a.docs} documents a row, uneven": document_ids(a.batch, a.seq,
                                                                 uneven(a.seq, a.docs))}
    probe = torch.zeros(1, device=device, dtype=torch.bfloat16 if a.dtype == "bfloat16"
                        else torch.float32)
    kernel = attention_kernel(probe)
    header("Packed documents against plain causal attention, the same tokens",
           f"preset {a.preset}, {a.device}, {a.dtype}, batch {a.batch} x {a.seq}, "
           f"{torch.get_num_threads()} threads; packed kernel: {kernel}; step: forward, "
           f"backward, AdamW; {a.steps - 2} timed steps of each (the layouts alternating); "
           "ms: median (10th-90th percentile); documents of the uneven rows: "
           f"{', '.join(map(str, uneven(a.seq, a.docs)))}")

    def step(documents) -> float:  # noqa: ANN001
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bfloat16"):
            loss = model(inputs, targets, documents=documents).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {name: [] for name in layouts}
    for i in range(a.steps):
        for name, documents in layouts.items():
            seconds = step(documents)
            if i >= 2:
                times[name].append(seconds)
    table = Table("layout", "kernel", "step ms", "tokens/s", "vs causal")
    causal = times["causal, one sequence a row"]
    for name, samples in times.items():
        median = statistics.median(samples)
        deciles = statistics.quantiles(samples, n=10) if len(samples) > 1 else [median] * 9
        ratio = statistics.median(s / c for s, c in zip(samples, causal))
        table.row(name, "sdpa causal" if layouts[name] is None else kernel,
                  f"{median * 1e3:,.1f} ({deciles[0] * 1e3:,.1f}-{deciles[-1] * 1e3:,.1f})",
                  f"{a.batch * a.seq / median:,.0f}", f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
