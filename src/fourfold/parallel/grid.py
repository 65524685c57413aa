"""The 4D process grid: rank <-> (data, z, y, x) and one process group per axis.

Rank order: x innermost (neighbours, same node), then y, then z, then data. `AXES` states it
once; GridShape derives every rank arithmetic from it (coords, rank_of, stride, rank_grid), and
the checkpoint's DeviceMesh and the planner's group strides ask GridShape.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import uuid
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from fourfold.errors import FourfoldError
from fourfold.host import cores_available, threads_per_rank
from fourfold.intmath import divisors
from fourfold.slurm import (expand_counts, first_host, is_slurm_step,  # noqa: F401 (here
                            local_task_count, slurm_port, slurm_rank_env)  # as they were)

Axis = Literal["x", "y", "z", "data"]
AXES: tuple[Axis, ...] = ("x", "y", "z", "data")  # the rank order, innermost first
RANK_ORDER: tuple[Axis, ...] = AXES[::-1]  # the same, outermost first: (data, z, y, x)


class GridError(FourfoldError, ValueError):
    """A grid that cannot work for this job or model; the message is one line for the user."""


class RendezvousError(GridError):
    """The ranks of a job could not meet (a rank missing, an unreachable or busy address).
    `every_rank`: the rank that usually speaks for the job (0) may not exist, so each rank
    reports its own line."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


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
    # Axis -> a second group of the same ranks for all-gathers. NCCL runs one communicator's
    # operations in order, so a prefetching gather of the next layer's weights on z would
    # otherwise wait behind the reduce-scatter of this layer's gradient.
    gather_groups: dict[Axis, object] = field(default_factory=dict)
    # every axis has a group, also where it has one rank (build's force_groups): the engine's
    # collectives are issued on them, moving nothing, so that one process runs the backend's code
    force_groups: bool = False

    @property
    def world_size(self) -> int:
        return self.shape.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def simulated(self) -> bool:
        """One rank of a job simulated in one process (torch's fake process group: every
        collective returns at once and moves nothing; fourfold.simulate). Its tensors may be
        fake, with no bytes to write, and no other rank runs beside it."""
        return self.backend == "fake"

    def size(self, axis: Axis) -> int:
        return getattr(self.shape, axis)

    def coord(self, axis: Axis) -> int:
        return self.shape.coords(self.rank)[axis]

    def group(self, axis: Axis) -> object | None:
        return self.groups.get(axis)

    def gather_group(self, axis: Axis) -> object | None:
        """The group all-gathers over `axis` use: its own where it has one."""
        return self.gather_groups.get(axis, self.groups.get(axis))

    @property
    def batch_shard(self) -> tuple[int, int]:
        """(index, count): the batch is split over data (outer) and z (inner)."""
        return self.coord("data") * self.shape.z + self.coord("z"), self.shape.data * self.shape.z

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Grid":
        return cls(shape=GridShape(), device=torch.device(device))

    @classmethod
    def build(cls, shape: GridShape, device: torch.device | None = None,
              timeout_s: float = 300.0, *, force_groups: bool = False) -> "Grid":
        """Create the per-axis process groups; torch.distributed must be initialized.
        A collective that waits longer than timeout_s fails (a rank died or hangs).
        `force_groups`: a group for every axis, also of one rank (a one-rank job that runs the
        engine's collectives: parallel.engine = "always")."""
        if force_groups and not dist.is_initialized():
            raise GridError("a grid with a group for every axis needs torch.distributed "
                            "initialized (init_distributed(..., one_rank_group=True))")
        if not dist.is_initialized():
            if shape.size != 1:
                raise GridError(f"grid {shape} needs {shape.size} ranks, but this is a single "
                                "process; launch with --nproc, torchrun or srun")
            return cls.single(device or "cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        if shape.size != world:
            raise GridError(f"grid {shape} has {shape.size} ranks but the job has {world}")
        timeout = datetime.timedelta(seconds=timeout_s)
        tensor_groups = [list(range(d * shape.tensor_size, (d + 1) * shape.tensor_size))
                         for d in range(shape.data)]
        # One entry per group this rank needs, in the same order on every rank (the order also
        # keeps group creation with local synchronisation free of deadlocks).
        wanted: list[tuple[str, list[list[int]]]] = [(a, shape.axis_groups(a)) for a in AXES]
        wanted += [("tensor", tensor_groups), ("z-gather", shape.axis_groups("z"))]
        made = _make_groups(wanted, rank, timeout, force_groups)
        groups: dict[Axis, object] = {axis: made[axis] for axis in AXES if made.get(axis)}
        gather_groups: dict[Axis, object] = {"z": made["z-gather"]} if made.get("z-gather") else {}
        return cls(shape=shape, rank=rank, device=device or torch.device("cpu"),
                   backend=dist.get_backend(), groups=groups, tensor_group=made.get("tensor"),
                   world_group=dist.group.WORLD if world > 1 or force_groups else None,
                   gather_groups=gather_groups, force_groups=force_groups)


# The groups of the tensor axes carry the layers' own collectives, which the next GEMM waits for
# (x, y: the output and input-gradient all-reduces; z: the weight gathers, prefetched one layer
# ahead, and the weight-gradient reduce-scatters; the tensor group: the gradient norm). On NCCL
# their streams are made with high priority, so that the GPU's block scheduler runs their
# kernels ahead of the GEMMs they overlap (as Megatron-LM and torchtitan do for the groups
# whose traffic is on the critical path); the data axis's all-reduce runs behind the backward
# and keeps normal priority.
HIGH_PRIORITY_GROUPS = ("x", "y", "z", "tensor", "z-gather")


def group_options(name: str, backend: str) -> dict[str, bool]:
    """The options a grid's process group `name` (an axis, "tensor" or "z-gather") is made
    with on `backend`, as keyword arguments of ProcessGroupNCCL.Options (none elsewhere)."""
    if backend == "nccl" and name in HIGH_PRIORITY_GROUPS:
        return {"is_high_priority_stream": True}
    return {}


def _pg_options(options: dict[str, bool]) -> object | None:
    if not options:
        return None
    return dist.ProcessGroupNCCL.Options(**options)


def _make_groups(wanted: list[tuple[str, list[list[int]]]], rank: int,
                 timeout: datetime.timedelta, force_groups: bool = False) -> dict[str, object]:
    """name -> this rank's process group among each partition of the ranks (None where its
    part has one rank, unless `force_groups`), made with `group_options`.

    `new_group` for every group on every rank costs one world-wide store barrier per group:
    O(world / group size) groups per axis, each waited on by all ranks, so starting thousands
    of ranks took minutes. Here each rank makes one call per partition: `split_group` where the
    backend can split a communicator (NCCL with a bound device: one ncclCommSplit per
    partition), otherwise a `new_group` of its own part that only that part's ranks synchronise.
    """
    default = dist.distributed_c10d._get_default_group()
    backend = dist.get_backend()
    can_split = (getattr(default, "bound_device_id", None) is not None
                 and backend == "nccl" and hasattr(dist, "split_group"))  # torch 2.5+
    made: dict[str, object] = {}
    for name, parts in wanted:
        if all(len(part) == 1 for part in parts) and not force_groups:
            continue
        mine = next(part for part in parts if rank in part)
        wanted_here = len(mine) > 1 or force_groups
        options = _pg_options(group_options(name, backend))
        if can_split:
            group = dist.split_group(split_ranks=parts, timeout=timeout, pg_options=options,
                                     group_desc=f"fourfold_{name}")
            made[name] = group if wanted_here else None
        elif wanted_here:
            # The group's name hashes its ranks and how many groups this process has: the
            # same on every member, since every rank makes one group per partition.
            made[name] = dist.new_group(mine, timeout=timeout, pg_options=options,
                                        use_local_synchronization=True,
                                        group_desc=f"fourfold_{name}")
    if not can_split and made:
        # Locally synchronised groups let a rank leave while a peer still connects its groups
        # (gloo's full mesh); one barrier keeps them all here until every group is up, so a
        # rank that fails right after (a user error every rank finds) cannot break a peer's
        # handshake and turn that peer's one-line error into a connection traceback.
        dist.barrier()
    return made


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, *,
                     device: str = "auto", one_rank_group: bool = False
                     ) -> tuple[int, int, torch.device]:
    """Join the job described by torchrun (RANK, WORLD_SIZE, MASTER_ADDR) or Slurm (SLURM_*)
    variables; a no-op on a single process unless `one_rank_group`, which makes it a job of one
    rank (parallel.engine = "always": the engine's collectives then reach the backend).
    Returns (rank, world_size, device). Backend "auto" is gloo for a run asked to use the CPU
    (`device`, as in train.device), otherwise NCCL when CUDA is there and gloo when not. An
    NCCL rank sets `nccl_environment` first. Ranks that cannot meet within timeout_s raise a
    RendezvousError (one line)."""
    if backend == "auto" and device == "cpu":
        backend = "gloo"
    env = os.environ
    if "RANK" not in env:
        env.update(slurm_rank_env(env))
    world = int(env.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized() and not one_rank_group:
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        return 0, 1, device
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", "0")) or None
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    bound: torch.device | None = None
    if backend == "nccl":
        set_nccl_environment(env)  # before the rank's CUDA context exists (set_device makes it)
        index = cuda_index(local_rank, local_world, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = bound = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(threads_for_rank(env, local_world or world))
    if not dist.is_initialized():
        # one process on its own meets no one: an in-process store stands in for the rendezvous
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} \
            if world == 1 and "MASTER_ADDR" not in env else {}
        try:
            # device_id binds the communicator to the device now, which lets Grid.build split
            # it instead of creating each group from scratch.
            dist.init_process_group(backend=backend, device_id=bound,
                                    timeout=datetime.timedelta(seconds=timeout_s), **alone)
        except (RuntimeError, ValueError) as error:  # DistStoreError, DistNetworkError
            raise rendezvous_error(error, env, timeout_s) from None
    return dist.get_rank(), dist.get_world_size(), device


# CUDA_DEVICE_MAX_CONNECTIONS = 1: one hardware queue from the host to the GPU, so that kernels
# start in the order they are issued, whatever their stream. The engine issues each collective
# before the GEMMs it should run under (the input-gradient all-reduce before the weight-gradient
# GEMMs, the next layer's z gather before this layer's GEMM, a bucket's all-reduce before the
# next layers' backward); with several queues a GEMM issued later may take every SM first and
# the collective waits for it. Megatron-LM requires the setting for its tensor parallelism,
# whose overlap is the same (up to Hopper; from Blackwell on it no longer asks for it);
# torchtitan, whose FSDP relies on several copy streams, leaves the variable alone, and so does
# fourfold where the user has set it.
NCCL_ENVIRONMENT = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables an NCCL rank sets for itself: those of NCCL_ENVIRONMENT not in `env`."""
    return {k: v for k, v in NCCL_ENVIRONMENT.items() if k not in env}


def set_nccl_environment(env: MutableMapping[str, str]) -> None:
    """Set `nccl_environment` in `env` (os.environ). The CUDA driver reads them when the
    process's CUDA context is made: where CUDA is initialised already they come too late,
    which is said once, loudly, rather than left to show as lost overlap."""
    missing = nccl_environment(env)
    if not missing:
        return
    env.update(missing)
    if torch.cuda.is_initialized():
        warnings.warn(f"{', '.join(f'{k}={v}' for k, v in missing.items())} was set after CUDA "
                      "was initialised in this process and may not take effect; set it before "
                      "the process starts", stacklevel=3)


def threads_for_rank(env: Mapping[str, str], local_world: int, cores: int | None = None) -> int:
    """CPU threads of one rank: the task's own cores where Slurm binds them
    (SLURM_CPUS_PER_TASK), else the cores this process may use (`cores`, default: its
    affinity) split among the ranks on its node, not among all ranks of the job."""
    cores = cores_available() if cores is None else cores
    cpus_per_task = int(env.get("SLURM_CPUS_PER_TASK", "0") or 0) if is_slurm_step(env) else 0
    if cpus_per_task:
        return max(1, min(cpus_per_task, cores))
    return threads_per_rank(local_world, cores)


def cuda_index(local_rank: int, local_world: int | None, visible: int) -> int:
    """The CUDA device of a rank among the `visible` ones. Where every rank on the node sees
    all its GPUs, rank i takes GPU i; where each task sees only its own (Slurm's
    --gpus-per-task, a per-task CUDA_VISIBLE_DEVICES), it takes the first it sees."""
    if visible < 1:
        visible_env = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise GridError("parallel.backend = \"nccl\" but this rank sees no CUDA device "
                        f"(CUDA_VISIBLE_DEVICES = {visible_env!r})")
    if visible >= (local_world or visible) and local_rank < visible:
        return local_rank
    if visible < (local_world or visible):
        return 0
    raise GridError(f"LOCAL_RANK = {local_rank} but this node shows only {visible} CUDA "
                    "devices; start at most one rank per GPU")


def rendezvous_error(error: BaseException, env: Mapping[str, str],
                     timeout_s: float) -> RendezvousError:
    """One line for a job whose ranks could not meet at MASTER_ADDR:MASTER_PORT."""
    rank, world = env.get("RANK", "?"), env.get("WORLD_SIZE", "?")
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    text = str(error)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return RendezvousError(f"rank {rank} of {world}: port {where} is already in use "
                               "(another job or step on this node?); set MASTER_PORT to a "
                               "free port")
    if "waiting for clients" in text:
        joined = text.split("waiting for clients.")[-1].strip().split(" ")[0]
        return RendezvousError(
            f"rank {rank} waited {timeout_s:g} s (parallel.timeout_s) at {where} for the "
            f"{world} ranks of this job and {joined} joined; start all {world} (srun --ntasks, "
            "torchrun --nproc-per-node), or one process")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    # Not reaching rank 0 at all: it may not exist, so nobody else would say so.
    unreachable = "trying to connect" in text or "Connection refused" in text
    return RendezvousError(f"rank {rank} of {world} could not join the job at {where} within "
                           f"{timeout_s:g} s (parallel.timeout_s): {first}", every_rank=unreachable)


def check_shared_directory(path: Path, grid: Grid) -> None:
    """Fail on every rank, in one line, unless every rank sees `path` as the same directory:
    rank 0 writes a token file there and every rank looks for it. Nodes that do not share the
    run directory would otherwise write checkpoints that no one rank holds whole."""
    if grid.world_size == 1 or grid.simulated:  # a simulated rank has no other rank to ask
        return
    token = uuid.uuid4().hex if grid.is_main else ""
    probe = Path(path) / ".fourfold-shared"
    if grid.is_main:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    tokens: list[object] = [token, str(path)]
    dist.broadcast_object_list(tokens, src=0)  # also the barrier: rank 0 wrote the file
    try:
        seen = probe.read_text() == tokens[0]
    except OSError:
        seen = False
    answers: list[object] = [None] * grid.world_size
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    dist.all_gather_object(answers, (seen, node))
    if grid.is_main:
        probe.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (ok, host) in enumerate(answers)  # type: ignore[misc]
             if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        ranks = ", ".join(str(rank) for rank, _ in blind[:8]) + (" ..." if len(blind) > 8 else "")
        raise GridError(f"run directory {tokens[1]} is not shared by all ranks: rank(s) {ranks} on "
                        f"{', '.join(hosts)} do not see what rank 0 wrote there; use a "
                        "directory every node mounts (--out)")


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
