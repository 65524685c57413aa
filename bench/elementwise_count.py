"""The planner's element-wise work per block against the engine's, as torch.profiler counts
it: the elements that non-GEMM, non-attention, non-view ops read and write per token in one
block's forward and backward, on one process, float32. The performance model (fourfold.plan.perf) charges these
counts at the probed element-wise rate; this script is where its coefficients come from.

One step is profiled at 2 and 4 blocks (the difference / 2 is one block) and at two ffn widths
(which separates the dim and ffn terms): per block per token, elements = a * dim + b * ffn.
Each op counts its tensor inputs plus one output the size of its largest input (none for
reductions); views, copies into GEMMs, the loss and the optimizer are left out (the model
charges those elsewhere).

    python bench/elementwise_count.py [--dim 256] [--ffn 768,1536] [--batch 16 --seq 128]
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, header, parser  # noqa: E402

# ops that are not element-wise passes over activations: GEMMs, attention, views and layout,
# allocation, the loss (probed on its own) and the embedding lookup
NOT_ELEMENTWISE = (
    "aten::mm", "flash", "aten::resolve_conj", "aten::_reshape_alias", "nll_loss",
    "log_softmax", "aten::embedding", "aten::result_type", "aten::view", "aten::t",
    "aten::transpose", "aten::reshape", "aten::as_strided", "aten::_to_copy", "aten::copy_",
    "aten::empty", "aten::matmul", "aten::linear", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::expand", "aten::permute", "aten::detach", "aten::alias",
    "aten::unflatten", "aten::split", "aten::chunk", "aten::contiguous", "aten::zeros",
    "aten::ones", "aten::resize_", "aten::clone", "aten::to", "aten::_unsafe_view",
    "aten::squeeze", "aten::flatten", "aten::narrow", "aten::stack", "aten::cat",
    "aten::index",
)
REDUCTIONS = ("aten::sum", "aten::mean")


def elements_moved(layers: int, dim: int, ffn: int, batch: int, seq: int, backward: bool,
                   grid) -> int:
    """Elements read + written by the element-wise ops of one profiled step."""
    import torch
    from torch.profiler import profile

    from fourfold.config import ModelConfig, ParallelConfig
    from fourfold.models import build_model
    from fourfold.parallel import parallelize

    cfg = ModelConfig(preset="custom", n_layers=layers, dim=dim, n_heads=8, n_kv_heads=8,
                      ffn_dim=ffn, vocab_size=4096, max_seq_len=seq)
    pm = parallelize(build_model(cfg, seed=1), grid, ParallelConfig())
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))

    def step() -> None:
        loss = pm(tokens[:, :-1], tokens[:, 1:]).sum() / (batch * seq)
        if backward:
            loss.backward()
            pm.finish_backward()
            for p in pm.parameters():
                p.grad = None

    step()
    with profile(record_shapes=True) as prof:
        step()
    total = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or any(s in e.name for s in NOT_ELEMENTWISE):
            continue
        if any(c.name.startswith("aten::") for c in e.cpu_children):  # composite: count leaves
            continue
        sizes = [math.prod(s) for s in (e.input_shapes or [])
                 if isinstance(s, (list, tuple)) and s and all(isinstance(v, int) for v in s)]
        total += sum(sizes) + (0 if e.name in REDUCTIONS else max(sizes, default=0))
    return total


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", default="768,1536", help="two ffn widths")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    f1, f2 = (int(v) for v in args.ffn.split(","))
    import torch
    import torch.distributed as dist

    from fourfold.parallel import Grid, GridShape
    from fourfold.plan.perf import ELEMENTWISE_PER_TOKEN

    # the performance model's coefficients; with kv = dim (n_kv_heads = n_heads) q + k + v is
    # 3 dim wide
    fwd, bwd = ELEMENTWISE_PER_TOKEN["forward"], ELEMENTWISE_PER_TOKEN["backward"]
    planned = {"forward": (fwd["dim"] + 3 * fwd["qkv"], fwd["ffn"])}
    planned["forward+backward"] = (planned["forward"][0] + bwd["dim"] + 3 * bwd["qkv"],
                                   fwd["ffn"] + bwd["ffn"])
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0,
                                world_size=1)
        grid = Grid.build(GridShape(1, 1, 1, 1), torch.device("cpu"))
        tokens = args.batch * args.seq
        header("The planner's element-wise work per block against torch.profiler's count",
               f"dim {args.dim}, batch {args.batch} x {args.seq}, float32, one process; "
               "elements read and written per token by one block")
        table = Table("pass", f"ffn {f1}", f"ffn {f2}", "measured", "planner")
        for name, backward in (("forward", False), ("forward+backward", True)):
            per_block = []
            for ffn in (f1, f2):
                two, four = (elements_moved(n, args.dim, ffn, args.batch, args.seq, backward,
                                            grid) for n in (2, 4))
                per_block.append((four - two) / 2 / tokens)
            b = (per_block[1] - per_block[0]) / (f2 - f1)
            a = (per_block[0] - b * f1) / args.dim
            pa, pb = planned[name]
            table.row(name, f"{per_block[0]:.0f}", f"{per_block[1]:.0f}",
                      f"{a:.1f} dim + {b:.1f} ffn", f"{pa:.1f} dim + {pb:.1f} ffn")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
