"""The 4D process grid: rank <-> (data, z, y, x) and one process group per axis.

Rank order: x innermost (neighbours, same node), then y, then z, then data. `AXES` states it
once; GridShape derives every rank arithmetic from it (coords, rank_of, stride, rank_grid), and
the checkpoint's DeviceMesh and the planner's group strides ask GridShape.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from fourfold.errors import FourfoldError
from fourfold.host import threads_per_rank
from fourfold.intmath import divisors

Axis = Literal["x", "y", "z", "data"]
AXES: tuple[Axis, ...] = ("x", "y", "z", "data")  # the rank order, innermost first
RANK_ORDER: tuple[Axis, ...] = AXES[::-1]  # the same, outermost first: (data, z, y, x)


class GridError(FourfoldError, ValueError):
    """A grid that cannot work for this job or model; the message is one line for the user."""


def _check_axis(axis: str, size: int) -> None:
    if size < 1:
        raise GridError(f"parallel.{axis} = {size}: must be at least 1")


@dataclass(frozen=True)
class GridShape:
    data: int = 1
    z: int = 1
    y: int = 1
    x: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            _check_axis(axis, getattr(self, axis))

    @property
    def size(self) -> int:
        return self.data * self.z * self.y * self.x

    @property
    def tensor_size(self) -> int:
        return self.z * self.y * self.x

    def stride(self, axis: Axis) -> int:
        """Distance in ranks between neighbours of an `axis` group: the product of the sizes
        of the axes inside it (x: 1, y: x, z: x*y, data: x*y*z)."""
        stride = 1
        for inner in AXES[:AXES.index(axis)]:
            stride *= getattr(self, inner)
        return stride

    def coords(self, rank: int) -> dict[Axis, int]:
        return {a: (rank // self.stride(a)) % getattr(self, a) for a in AXES}

    def rank_of(self, coords: dict[Axis, int]) -> int:
        return sum(coords[a] * self.stride(a) for a in AXES)

    def rank_grid(self, order: tuple[Axis, ...] = RANK_ORDER) -> torch.Tensor:
        """All global ranks as a tensor with one dim per axis, dims in `order` (the layout of
        a DeviceMesh whose dims are those axes)."""
        ranks = torch.arange(self.size).reshape([getattr(self, a) for a in RANK_ORDER])
        return ranks.permute([RANK_ORDER.index(a) for a in order]).contiguous()

    def axis_groups(self, axis: Axis) -> list[list[int]]:
        """All groups of ranks that differ only in `axis`, each in axis order."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.size):
            c = self.coords(rank)
            key = tuple(c[a] for a in AXES if a != axis)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def __str__(self) -> str:
        return f"data={self.data} z={self.z} y={self.y} x={self.x}"

    @classmethod
    def resolve(cls, x: int, y: int, z: int, data: int | str, world_size: int) -> "GridShape":
        """Fill data="auto" from the world size and check the product."""
        for axis, size in (("x", x), ("y", y), ("z", z)):
            _check_axis(axis, size)  # before dividing by their product
        tensor = x * y * z
        if data == "auto":
            if world_size % tensor:
                raise GridError(f"parallel.x*y*z = {x}*{y}*{z} = {tensor} does not divide the "
                                f"world size {world_size}; choose x*y*z among "
                                f"{', '.join(map(str, divisors(world_size)))}")
            data = world_size // tensor
        shape = cls(data=int(data), z=z, y=y, x=x)
        if shape.size != world_size:
            raise GridError(f"grid data*z*y*x = {data}*{z}*{y}*{x} = {shape.size} but the job has "
                            f"{world_size} ranks; set parallel.data = \"auto\" or make the product "
                            f"{world_size}")
        return shape


@dataclass
class Grid:
    """A process grid. On one process every axis has size 1 and no process group."""

    shape: GridShape
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "none"
    groups: dict[Axis, object] = field(default_factory=dict)  # axis -> ProcessGroup (size > 1)
    tensor_group: object | None = None  # all of x, y, z (one (data) slice)
    world_group: object | None = None

    @property
    def world_size(self) -> int:
        return self.shape.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def size(self, axis: Axis) -> int:
        return getattr(self.shape, axis)

    def coord(self, axis: Axis) -> int:
        return self.shape.coords(self.rank)[axis]

    def group(self, axis: Axis) -> object | None:
        return self.groups.get(axis)

    @property
    def batch_shard(self) -> tuple[int, int]:
        """(index, count): the batch is split over data (outer) and z (inner)."""
        return self.coord("data") * self.shape.z + self.coord("z"), self.shape.data * self.shape.z

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Grid":
        return cls(shape=GridShape(), device=torch.device(device))

    @classmethod
    def build(cls, shape: GridShape, device: torch.device | None = None,
              timeout_s: float = 300.0) -> "Grid":
        """Create the per-axis process groups; torch.distributed must be initialized.
        A collective that waits longer than timeout_s fails (a rank died or hangs)."""
        if not dist.is_initialized():
            if shape.size != 1:
                raise GridError(f"grid {shape} needs {shape.size} ranks, but this is a single "
                                "process; launch with --nproc, torchrun or srun")
            return cls.single(device or "cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        if shape.size != world:
            raise GridError(f"grid {shape} has {shape.size} ranks but the job has {world}")
        groups: dict[Axis, object] = {}
        timeout = datetime.timedelta(seconds=timeout_s)
        # Every rank must create every group, in the same order.
        for axis in AXES:
            for ranks in shape.axis_groups(axis):
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks and g is not None:
                    groups[axis] = g
        tensor_group = None
        for d in range(shape.data):
            ranks = list(range(d * shape.tensor_size, (d + 1) * shape.tensor_size))
            g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                tensor_group = g
        return cls(shape=shape, rank=rank, device=device or torch.device("cpu"),
                   backend=dist.get_backend(), groups=groups, tensor_group=tensor_group,
                   world_group=dist.group.WORLD if world > 1 else None)


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, *,
                     device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the job described by torchrun (RANK, WORLD_SIZE, MASTER_ADDR) or Slurm (SLURM_*)
    variables; a no-op on a single process. Returns (rank, world_size, device). Backend "auto"
    is gloo for a run asked to use the CPU (`device`, as in train.device), otherwise NCCL when
    CUDA is there and gloo when not."""
    if backend == "auto" and device == "cpu":
        backend = "gloo"
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", _slurm_first_host())
        env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        return 0, 1, device
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        _split_cores(int(env.get("LOCAL_WORLD_SIZE", str(world))))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def _split_cores(local_world: int) -> None:
    """Ranks sharing a machine split its cores rather than each taking all of them."""
    torch.set_num_threads(threads_per_rank(local_world))


def _slurm_first_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "localhost")
    # "node[01-04],other" -> "node01"; a plain list -> its first name
    head = nodes.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def leave_job(code: int = 0) -> None:
    """End a rank process: tear the process group down, flush, and `os._exit(code)`.

    With gloo (torch 2.13), letting the interpreter shut down normally after
    destroy_process_group aborts about one rank in twenty ("terminate called without an active
    exception"), which fails a finished job; leaving with os._exit avoids it. A process that
    never joined a job just returns.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
