"""How long Grid.build takes on N gloo ranks of this machine, and how many group-creating
calls each rank makes, against the earlier way (every rank creates every group of every axis
with `new_group`, each followed by a barrier of the whole world) and DeviceMesh.

    .venv/bin/python bench/grid_build.py            # 8 ranks
    .venv/bin/python bench/grid_build.py --ranks 4 --repeats 5

Calls per rank, for a grid of world size G with axis sizes s_a (only axes of size > 1 count):
  every group on every rank: sum_a G / s_a  (+ data tensor groups), each one a barrier of all G
  Grid.build:                one per axis (+ tensor, + z gathers): at most 6, each
                             synchronising only the ranks of this rank's group (gloo), or one
                             ncclCommSplit over the world per axis (NCCL, bound device)
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from fourfold.parallel.grid import AXES, Grid, GridShape

SHAPES = {8: [GridShape(x=8), GridShape(data=8), GridShape(z=2, y=2, x=2),
              GridShape(data=2, z=2, x=2), GridShape(data=4, x=2)],
          4: [GridShape(x=4), GridShape(data=4), GridShape(z=2, x=2), GridShape(data=2, y=2)],
          2: [GridShape(x=2), GridShape(data=2)]}


def calls_every_group(shape: GridShape) -> int:
    calls = sum(len(shape.axis_groups(a)) for a in AXES if getattr(shape, a) > 1)
    return calls + (shape.data if shape.tensor_size > 1 else 0)


def calls_grid_build(shape: GridShape) -> int:
    return sum(1 for a in AXES if getattr(shape, a) > 1) + (shape.tensor_size > 1) + (shape.z > 1)


def every_group_on_every_rank(shape: GridShape) -> None:
    """Grid.build before: one new_group per group, on every rank, in the same order."""
    timeout = datetime.timedelta(seconds=300)
    for axis in AXES:
        for ranks in shape.axis_groups(axis):
            if len(ranks) > 1:
                dist.new_group(ranks, timeout=timeout)
    if shape.tensor_size > 1:
        for d in range(shape.data):
            dist.new_group(list(range(d * shape.tensor_size, (d + 1) * shape.tensor_size)),
                           timeout=timeout)


def device_mesh(shape: GridShape) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (shape.data, shape.z, shape.y, shape.x),
                     mesh_dim_names=("data", "z", "y", "x"))


def _timed(fn, shape: GridShape) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(shape)
    seconds = time.perf_counter() - start
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)  # type: ignore[type-var]  # the job waits for its slowest rank


def _worker(rank: int, world: int, port: int, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    ways = {"every group": every_group_on_every_rank, "DeviceMesh": device_mesh,
            "Grid.build": lambda s: Grid.build(s)}
    rows = []
    for shape in SHAPES[world]:
        times = {name: statistics.median(_timed(fn, shape) for _ in range(repeats))
                 for name, fn in ways.items()}
        rows.append((shape, times))
    if rank == 0:
        print(f"Grid.build on {world} gloo ranks (this machine, median of {repeats}, slowest rank)")
        print(f"{'grid':<22} {'calls/rank before':>17} {'after':>5} "
              + " ".join(f"{name + ' s':>14}" for name in ways))
        for shape, times in rows:
            print(f"{str(shape):<22} {calls_every_group(shape):>17} {calls_grid_build(shape):>5} "
                  + " ".join(f"{times[name]:>14.3f}" for name in ways))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, args.repeats), nprocs=args.ranks)


if __name__ == "__main__":
    main()
