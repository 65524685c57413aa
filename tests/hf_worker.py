"""Run by torchrun from test_hf.py: for each grid of this world size and each Hugging Face
folder of FOURFOLD_TEST_CASES, read the folder as model.init_from does (each rank its own
shards), run a forward over the tokens of its expected.pt, gather the vocabulary slices over
y, and report the largest difference from transformers' logits stored beside them."""

from __future__ import annotations

from pathlib import Path

import torch

from fourfold.config import ParallelConfig
from fourfold.models.hf import hf_model_config, load_hf_into
from fourfold.models.llama import build_model
from fourfold.parallel import Grid, GridShape, parallelize

from grid_cases import run_grid_cases  # noqa: E402  (tests/ is this script's directory)


def run_case(shape: GridShape, grid: Grid, case: dict) -> dict:
    root = Path(case["dir"])
    expected = torch.load(root / "expected.pt")
    cfg = hf_model_config(root)
    model = build_model(cfg, seed=0, device="meta")
    pmodel = parallelize(model, grid, ParallelConfig(x=shape.x, y=shape.y, z=shape.z,
                                                     data=shape.data, gemm_tuning=False))
    load_hf_into(pmodel, root)
    pmodel.eval()
    with torch.no_grad():
        local = pmodel(expected["tokens"])  # (B, T, V / Gy)
        # all_gather concatenates along dim 0: the vocabulary first, then back
        whole = pmodel.comm.all_gather(local.permute(2, 0, 1).contiguous(), "y").wait()
        logits = whole.permute(1, 2, 0)
    return {"ok": True, "max_diff": float((logits - expected["logits"]).abs().max())}


if __name__ == "__main__":
    run_grid_cases("FOURFOLD_TEST_CASES", "case", run_case)
