"""The planner against the seed paper's published results (AxoNN, SC24): for each point, the
planner's best grid and its predicted MFU (model FLOPs) and HFU (with the recomputed forward),
beside the paper's result in model-FLOPs terms (its Megatron-formula figures x 3/4: they count
the recomputation) and the ratio paper / predicted (target: within 1.2x either way).

Two wire dtypes: fourfold's engine with its defaults under bfloat16 (`engine`: bf16 z gathers
and activations, float32 gradient reductions), and bfloat16 gradient reductions as well
(`bf16 wire`: parallel.reduce_dtype = "bfloat16", what AxoNN moves: the row to hold against
the paper). `bf16, no SM` is the bf16 wire without the SM-contention charge (Device.comm_sms
= 0), to show what that charge costs; `SM s` is the charge in the step.

The GPTs are custom models (this framework's blocks are Llama-style: SwiGLU with
ffn_dim = 8/3 x width, rounded down to a multiple of 2048 so that the grids can split it, has
the FLOPs of GPT's 4 x width MLP); vocabulary 51200, full multi-head attention, head dim 128.
The 320B shape (96 layers, width 16384) is an assumption: 12 L d^2 = 309B.

    python bench/plan_papers.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, header, parser  # noqa: E402

from fourfold.config import ModelConfig
from fourfold.plan.machine_file import load_machine
from fourfold.plan.memory import Precision
from fourfold.plan.search import plan


def gpt(n_layers: int, dim: int) -> ModelConfig:
    return ModelConfig(preset="custom", n_layers=n_layers, dim=dim, n_heads=dim // 128,
                       n_kv_heads=dim // 128, ffn_dim=(8 * dim // 3) // 2048 * 2048,
                       vocab_size=51200, max_seq_len=2048)


# (label, model, GPUs, machine, global batch, the paper's model-FLOPs MFU)
POINTS = [
    ("80B GPT, 1,024 Perlmutter A100", gpt(42, 12288), 1024, "perlmutter", 2048, 0.428),
    ("320B GPT, 32,768 Frontier GCDs", gpt(96, 16384), 32768, "frontier", 8192, 0.165),
]


def main() -> None:
    parser(__doc__).parse_args()
    header("The planner against the AxoNN paper's published results",
           "grid = data x z x y x x; mb x acc = micro-batch x gradient accumulation steps; AC = "
           "activation checkpointing; SM s = the step's SM-contention charge")
    engine, bf16 = Precision.of("bfloat16"), Precision.of("bfloat16", "bfloat16")
    table = Table("point", "wire", "best grid", "mb x acc", "AC", "step s", "SM s", "MFU",
                  "HFU", "paper", "paper / MFU", "within 1.2x")
    for label, model, gpus, machine_name, batch, paper in POINTS:
        machine = load_machine(machine_name)
        no_sm = dataclasses.replace(machine, device=dataclasses.replace(machine.device,
                                                                        comm_sms=0.0))
        for wire, precision, m in (("engine", engine, machine), ("bf16 wire", bf16, machine),
                                   ("bf16, no SM", bf16, no_sm)):
            best = plan(model, gpus, m, batch, 2048, precision).best
            p, s = best.prediction, best.shape
            ratio = paper / p.mfu
            table.row(label, wire, f"{s.data} x {s.z} x {s.y} x {s.x}",
                      f"{best.micro_batch} x {best.grad_accum}",
                      "on" if best.activation_checkpointing else "off", f"{p.step_s:.2f}",
                      f"{p.contention_s:.2f}", f"{p.mfu:.1%}", f"{p.hfu:.1%}", f"{paper:.1%}",
                      f"{ratio:.2f}", "yes" if 1 / 1.2 <= ratio <= 1.2 else "no")


if __name__ == "__main__":
    main()
