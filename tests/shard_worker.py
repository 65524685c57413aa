"""Run by torchrun from test_shard_build.py on 8 ranks: for each grid, build the `debug` model
on the meta device (each rank materialises its own shards), then check that the gathered
weights equal a one-process build bit for bit, and write model.safetensors by streaming to
rank 0 (rank 0 compares its bytes with the one-process file). One JSON line per grid."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from fourfold.config import ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, init_distributed, leave_job, parallelize
from fourfold.train.runs import save_weights_streamed


def main() -> None:
    rank, world, device = init_distributed("gloo", timeout_s=120)
    shapes = json.loads(os.environ["FOURFOLD_SHARD_SHAPES"])
    out_dir = Path(os.environ["FOURFOLD_SHARD_OUT"])
    results = []
    for shape_list, variant in shapes:
        shape = GridShape(*shape_list)
        grid = Grid.build(shape, device)
        case = {"shape": shape_list, "variant": variant}
        try:
            cfg = model_config("debug", bias=variant.get("bias", False),
                               tie_embeddings=variant.get("tie", False))
            reference = build_model(cfg, seed=11)
            pmodel = parallelize(build_model(cfg, seed=11, device="meta"), grid,
                                 ParallelConfig(x=shape.x, y=shape.y, z=shape.z,
                                                data=shape.data))
            state = pmodel.full_state_dict()
            ref_state = reference.state_dict()
            case["same_names"] = sorted(state) == sorted(ref_state)
            case["unequal"] = [n for n in ref_state if not torch.equal(state[n], ref_state[n])]
            case["meta_left"] = [n for n, p in pmodel.named_parameters() if p.is_meta]
            tag = "_".join(map(str, shape_list)) + "_" + "_".join(sorted(variant))
            ours, single = out_dir / f"grid_{tag}.safetensors", out_dir / f"one_{tag}.safetensors"
            save_weights_streamed(pmodel, ours, cfg.tie_embeddings)
            if rank == 0:
                save_weights_streamed(parallelize(reference, Grid.single()), single,
                                      cfg.tie_embeddings)
                case["same_file"] = ours.read_bytes() == single.read_bytes()
                case["leftovers"] = sorted(p.name for p in out_dir.glob("*.tmp"))
            case["ok"] = True
        except Exception:
            case.update(ok=False, error=traceback.format_exc())
        results.append(case)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_dir / "results.jsonl", "w") as f:
            for r, cases in enumerate(gathered):
                for c in cases:
                    f.write(json.dumps(dict(c, rank=r)) + "\n")
    dist.barrier()
    leave_job(0)


if __name__ == "__main__":
    main()
