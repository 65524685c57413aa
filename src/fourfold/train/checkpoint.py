"""Sharded, asynchronous, verifiable checkpoints with torch.distributed.checkpoint (DCP).

Layout on disk (RUN_DIR/checkpoints/):

    step_00000100/            one complete checkpoint
        __0_0.distcp ...      DCP data, one file per rank (each rank writes its own shards)
        .metadata             DCP index (rank 0)
        manifest.json         step, grid, sha256 + size of every file above; written LAST
    .step_00000200.tmp/       a checkpoint being written (never read)

What it holds is what was registered with the manager (CheckpointManager.register): the model
(ModelState), a torch optimizer (OptimizerState), a training method's sharded state and the
loop's own parts, each under the keys StateKey spells out.

A checkpoint becomes visible only when complete: every rank writes (and fsyncs) its files into
the temporary directory, rank 0 hashes nothing but the manifest it gathers (each rank hashes the
files it wrote), writes manifest.json, fsyncs, and renames the directory. Older checkpoints are
deleted only after a newer one is complete.

Resharding: each local shard is a block of the full tensor given by `pmodel.layouts()[name]`.
It is wrapped, without communication, as a DTensor on a DeviceMesh whose dims are ordered
(data, y, x, z): every Layout in the engine lists the axes that split one tensor dim outer first
in that same order, so DTensor's nested sharding (mesh dims left to right) reproduces
`Layout.offsets` exactly. DCP then reads any block of any saved tensor, so a checkpoint written
on one grid loads on another, or on one process (plain full tensors). A training method's state
(a ShardedStateful part) is saved the same way, each tensor by the Layout the method gives it;
a tensor the method gives no Layout is saved per rank and loads only on the grid that wrote it.

Asynchronous saving: the state is copied to CPU memory on the calling thread (the snapshot),
then a background thread runs a blocking `dcp.save` of that snapshot on a dedicated gloo
process group, so its collectives never interleave with training traffic. (Not
`dcp.async_save`: the finishing steps -- hashes, manifest, rename, pruning -- need collectives of
their own after the write, in a fixed order on every rank; one thread owning the whole sequence
keeps that order.)

No pickle: besides the sharded tensors, a checkpoint holds each Stateful part's state as JSON
(stored as a uint8 tensor) plus the tensors it names; DCP reads tensors with
torch.load(weights_only=True), and its pickled .metadata index is read by an unpickler that
builds only the index's own data classes. A checkpoint with any pickled value is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle  # only to read DCP's index, restricted to its data classes
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist

from fourfold.config import CheckpointConfig
from fourfold.data.manifest import sha256_file
from fourfold.errors import EXIT_FAILED, FourfoldError
from fourfold.errors import first_line as _one_line  # the shared helper, under its old name
from fourfold.parallel.grid import Axis, Grid
from fourfold.parallel.layout import Layout
from fourfold.rundir import (CHECKPOINT_DIR, MANIFEST_FILE, checkpoint_root, list_checkpoints,
                             step_of)
from fourfold.train.host_memory import to_host, wait_for_host_copies

if TYPE_CHECKING:
    from fourfold.parallel import ParallelModel

MESH_AXES: tuple[Axis, ...] = ("data", "y", "x", "z")  # DeviceMesh dims; see the docstring
_EXTRA = "extra"  # the part save()'s `extra` is kept under
_RNG = "rng"  # the part each rank's random generators are kept under


class CheckpointError(FourfoldError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line for the user."""

    exit_code = EXIT_FAILED


def verify_checkpoint(path: Path, share: tuple[int, int] = (0, 1),
                      checksums: bool = True) -> str | None:
    """None when every file listed in the manifest exists with its size and sha256; otherwise
    why not (one short phrase). With share = (index, count), only every count-th file from the
    index-th is hashed (sizes are checked for all): the ranks of a job split the reading.
    checksums = False hashes nothing: a quick look (missing or truncated files) that reads no
    file's contents."""
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest.json"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest.json ({type(e).__name__})"
    if ".metadata" not in files:
        return "the manifest lists no DCP .metadata"
    index, count = share
    for i, (name, entry) in enumerate(sorted(files.items())):
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
        if checksums and i % count == index and sha256_file(file) != entry["sha256"]:
            return f"{name} fails its sha256 checksum"
    return None


# --------------------------------------------------------------------------------------------
# Layout -> DTensor


def mesh_tensor(grid: Grid) -> torch.Tensor:
    """Global ranks arranged as the mesh's (data, y, x, z), from the grid's own rank order."""
    return grid.shape.rank_grid(MESH_AXES)


def placements_for(layout: Layout, ndim: int, name: str = "tensor") -> list[Any]:
    """DTensor placements on the (data, y, x, z) mesh for a Layout: Shard(d) on each mesh dim
    that splits tensor dim d, Replicate elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    placements: list[Any] = [Replicate() for _ in MESH_AXES]
    for dim, axes in enumerate(layout.dims[:ndim]):
        order = [MESH_AXES.index(a) for a in axes]
        if order != sorted(order):
            # DTensor nests shards in mesh-dim order; another order would be another layout.
            raise CheckpointError(f"{name}: layout splits dim {dim} over {axes}, which is not in "
                                  f"the mesh order {MESH_AXES}; cannot describe it as a DTensor")
        for index in order:
            placements[index] = Shard(dim)
    return placements


def build_mesh(grid: Grid) -> Any:
    """The (data, y, x, z) DeviceMesh of a grid, without process groups of its own (nothing here
    communicates through it). None on one process."""
    if grid.world_size == 1 and not grid.force_groups:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    # The grid's device type: DTensor.from_local copies a local tensor that is not on the
    # mesh's device, and dcp.load would then fill the copy (see _wrap's check).
    device_type = grid.device.type
    try:
        return DeviceMesh(device_type, mesh_tensor(grid), mesh_dim_names=MESH_AXES,
                          _init_backend=False)
    except TypeError:  # a torch without _init_backend: let it build its groups
        return DeviceMesh(device_type, mesh_tensor(grid), mesh_dim_names=MESH_AXES)


def _wrap(local: torch.Tensor, layout: Layout, full_shape: tuple[int, ...], mesh: Any,
          name: str) -> Any:
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    full = torch.empty(full_shape, device="meta")
    wrapped = DTensor.from_local(local, mesh, placements_for(layout, len(full_shape), name),
                                 run_check=False, shape=torch.Size(full_shape),
                                 stride=full.stride())
    check_wraps_in_place(wrapped, local, name)
    return wrapped


def check_wraps_in_place(wrapped: Any, local: torch.Tensor, name: str) -> None:
    """dcp.load fills a DTensor's local tensor: unless that is the target's own storage (the
    parameter or optimizer state it stands for), a load would fill a copy and leave the
    weights as they were while the step count and data position moved on."""
    inner = wrapped.to_local()
    if inner.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
        raise CheckpointError(
            f"{name}: its DTensor holds a copy of the tensor ({local.device} tensor, "
            f"{wrapped.device_mesh.device_type} mesh), so a load would not reach the "
            "weights; the checkpoint mesh must be on the tensors' device")


def _full_shape(local: torch.Tensor, layout: Layout, grid: Grid) -> tuple[int, ...]:
    shape = list(local.shape)
    for dim, axes in enumerate(layout.dims[:local.dim()]):
        for a in axes:
            shape[dim] *= grid.size(a)
    return tuple(shape)


# --------------------------------------------------------------------------------------------
# Optimizer and RNG state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (AdamW: step, exp_avg, exp_avg_sq) so that a
    checkpoint can be loaded into them: one step with zero gradients and a zero learning rate,
    which leaves the parameters exactly as they are."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise CheckpointError("cannot initialize the optimizer state while gradients are set; "
                              "call optimizer.zero_grad(set_to_none=True) first")
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved_lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# State keys: where each entry lies in a checkpoint's flat DCP state dict


Area = Literal["model", "optim", "state", "rank", "shards"]


@dataclass(frozen=True)
class StateKey:
    """The place of one entry in a checkpoint (its DCP key is `str(key)`):
        model/NAME                  a parameter (`name`), a shard of its full tensor
        optim/NAME/FIELD            a torch optimizer's state of parameter NAME (`name`, `field`)
        state/PART/ENTRY            a part saved once: its JSON (`json`) and tensors (`tensorI`)
        rank<R>/PART/ENTRY          a part saved by each rank R (its RNG states)
        shards/PART/global/KEY      a sharded part's tensor KEY, a shard of its global tensor
        shards/PART/rank<R>/KEY     ... one it gives no layout, as rank R kept it
    PART names and parameter names hold no "/" (a sharded part's keys and NAME/FIELD may)."""

    area: Area
    name: str = ""  # the part's (state, rank, shards) or the parameter's (model, optim)
    entry: str = ""  # state, rank: json or tensorI; optim: the field; shards: the part's key
    rank: int | None = None  # rank: whose; shards: who kept it (None: a global tensor)

    def __str__(self) -> str:
        if self.area == "model":
            return f"model/{self.name}"
        if self.area == "optim":
            return f"optim/{self.name}/{self.entry}"
        if self.area == "state":
            return f"state/{self.name}/{self.entry}"
        if self.area == "rank":
            return f"rank{self.rank}/{self.name}/{self.entry}"
        holder = "global" if self.rank is None else f"rank{self.rank}"
        return f"shards/{self.name}/{holder}/{self.entry}"

    @classmethod
    def parse(cls, text: str) -> StateKey | None:
        """The key of a DCP entry, or None for one no fourfold checkpoint holds."""
        head, _, rest = text.partition("/")
        if head == "model":
            return cls("model", rest)
        if head == "optim":
            name, _, field = rest.rpartition("/")
            return cls("optim", name, field)
        part, _, entry = rest.partition("/")
        if head == "state":
            return cls("state", part, entry)
        if _RANK.match(head):
            return cls("rank", part, entry, int(head[4:]))
        if head == "shards":
            holder, _, key = entry.partition("/")
            return cls("shards", part, key, None if holder == "global" else int(holder[4:]))
        return None

    def with_entry(self, entry: str) -> StateKey:
        return dataclasses.replace(self, entry=entry)


_RANK = re.compile(r"^rank\d+$")


# --------------------------------------------------------------------------------------------
# What a checkpoint holds: the parts registered with the manager


class Stateful(Protocol):
    """A part of a run that a checkpoint saves and restores: state_dict() returns JSON values
    (dicts with str keys, lists, str, int, float, bool, None) and tensors, nested freely;
    load_state_dict() takes what state_dict() returned (tuples come back as lists). The same
    on every rank, so saved once; a part with `per_rank = True` is saved by each rank (read
    back by the same rank, or rank 0's where the saving grid had fewer ranks)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedStateful(Protocol):
    """A part whose tensors are this rank's shards of global tensors (a training method's
    per-parameter state). state_dict() returns the shards by key and JSON values that are the
    same on every rank; layout_of(key) places a key's shard in its global tensor (None: only
    this grid can read it back; 0-dim tensors are the same on every rank); load_state_dict()
    takes this rank's shards of what was saved, on any grid."""

    def describe(self) -> str: ...

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def layout_of(self, key: str) -> Layout | None: ...

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...


class RandomState:
    """Every random generator training may touch on this rank, as a Stateful part of its own
    rank (the manager registers it)."""

    per_rank = True

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "internal": list(internal), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


# A Stateful part's state on disk: its JSON (tensors replaced by {_TENSOR_REF: i}) as a uint8
# tensor under entry "json", and tensor i under entry "tensor<i>". Nothing is pickled.
_TENSOR_REF = "__tensor__"
_JSON = "json"


def _json_tensor(value: Any) -> torch.Tensor:
    text = json.dumps(value)  # NaN and inf stay (a skipped step's loss is NaN)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def _json_value(tensor: torch.Tensor, where: str) -> Any:
    try:
        return json.loads(bytes(tensor.numpy()).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where}: unreadable saved state ({type(e).__name__})") from None


def encode_state(tree: Any, where: StateKey) -> dict[str, torch.Tensor]:
    """A Stateful part's state as flat DCP entries (tensors only) at `where` (its entries)."""
    tensors: dict[str, torch.Tensor] = {}

    def plain(value: Any, path: str) -> Any:
        if torch.is_tensor(value):
            index = len(tensors)
            tensors[str(where.with_entry(f"tensor{index}"))] = value.detach().to("cpu", copy=True)
            return {_TENSOR_REF: index}
        if isinstance(value, dict):
            if _TENSOR_REF in value or not all(isinstance(k, str) for k in value):
                raise CheckpointError(f"{where.with_entry('')}{path}: state dict keys must be "
                                      f"strings other than {_TENSOR_REF!r}")
            return {k: plain(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise CheckpointError(f"{where.with_entry('')}{path}: a {type(value).__name__} cannot "
                              "be saved; a state dict holds tensors and JSON values only")

    tensors[str(where.with_entry(_JSON))] = _json_tensor(plain(tree, "state"))
    return tensors


def decode_state(entries: dict[str, torch.Tensor], where: StateKey) -> Any:
    """What encode_state(tree, where) encoded, from the loaded entries."""
    key = str(where.with_entry(_JSON))
    if key not in entries:
        raise CheckpointError(f"{key}: unreadable saved state (KeyError)")
    tree = _json_value(entries[key], key)

    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR_REF}:
                return entries[str(where.with_entry(f"tensor{value[_TENSOR_REF]}"))]
            return {k: restore(v) for k, v in value.items()}
        if isinstance(value, list):
            return [restore(v) for v in value]
        return value

    return restore(tree)


# --------------------------------------------------------------------------------------------
# Reading DCP's index without running its code


# DCP writes its .metadata index with pickle. These are the globals such an index refers to
# (data classes, dtypes, sizes, paths); an index that names anything else is refused unread.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
                     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module in _METADATA_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a data class of the index, not a function
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"the index names {module}.{name}, which a checkpoint "
                                     "index never holds")


def read_metadata(path: str | Path, name: str = ".metadata") -> Any:
    """The DCP index (Metadata) of a checkpoint directory, read by an unpickler that builds
    only the index's own data classes, so that a crafted file cannot run code."""
    file = Path(path) / name
    try:
        with file.open("rb") as f:
            return _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError,
            TypeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {name}: {_one_line(e)}") from None


def _tensor_reader(path: Path) -> Any:
    """A DCP FileSystemReader whose index is read by read_metadata (tensors themselves DCP
    reads with torch.load(weights_only=True))."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class TensorReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            metadata = read_metadata(path, ".metadata" if rank is None else f"__{rank}.metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return TensorReader(path)


# --------------------------------------------------------------------------------------------
# The manager


class ModelState:
    """The model's parameters as a checkpoint part: each under its name (model/NAME), the
    local shard of its full tensor (a DTensor by its Layout), loaded in place; any grid reads
    it back. `trainable_only` (an adapter run): only the parameters that train; the frozen base
    is rebuilt by the run builder (a BaseReference part checks it is the same)."""

    def __init__(self, pmodel: ParallelModel, trainable_only: bool = False) -> None:
        self.pmodel, self.trainable_only = pmodel, trainable_only

    def tensors(self, grid: Grid, mesh: Any, prepare: Callable[[torch.Tensor], torch.Tensor]
                ) -> dict[str, Any]:
        layouts = self.pmodel.layouts()
        return {str(StateKey("model", name)): _wrap(prepare(p), layouts[name],
                                                    _full_shape(p, layouts[name], grid), mesh,
                                                    name)
                for name, p in self.pmodel.named_parameters()
                if not (self.trainable_only and not p.requires_grad)}

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]:
        return self.tensors(store.grid, store.mesh, prepare)

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
        with torch.no_grad():  # DCP copies into the very storage of each parameter
            return self.tensors(store.grid, store.mesh, lambda t: t.detach())

    def restore(self, store: _Store, path: Path, loaded: dict[str, Any]) -> None:
        return None


class OptimizerState:
    """A torch optimizer's state as a checkpoint part (AdamW's moments and step count), by its
    parameter's name (optim/NAME/FIELD): tensors shaped as the parameter's shard are DTensors
    by its Layout (any grid reads them back), scalars the same on every rank, other values
    JSON. Loaded in place, into state created first (init_optimizer_state)."""

    def __init__(self, optimizer: torch.optim.Optimizer, pmodel: ParallelModel) -> None:
        self.optimizer, self.pmodel = optimizer, pmodel

    def _entries(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[dict[str, Any], dict[str, tuple[torch.nn.Parameter, str]]]:
        """The tensor entries, and the JSON ones' keys with their parameter and field."""
        layouts = self.pmodel.layouts()
        names = {id(p): n for n, p in self.pmodel.named_parameters()}
        out: dict[str, Any] = {}
        json_values: dict[str, tuple[torch.nn.Parameter, str]] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in self.optimizer.state:
                    continue
                name = names[id(p)]
                for field, value in self.optimizer.state[p].items():
                    key = str(StateKey("optim", name, field))
                    if not torch.is_tensor(value):
                        out[key] = _json_tensor(value)
                        json_values[key] = (p, field)
                    elif value.shape == p.shape and value.dim() > 0:  # shaped like the shard
                        out[key] = _wrap(prepare(value), layouts[name],
                                         _full_shape(p, layouts[name], store.grid),
                                         store.mesh, name)
                    else:  # a scalar such as AdamW's step: the same on every rank
                        out[key] = prepare(value)
        return out, json_values

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]:
        return self._entries(store, prepare)[0]

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
        init_optimizer_state(self.optimizer)
        with torch.no_grad():
            out, json_values = self._entries(store, lambda t: t.detach())
        for key in json_values:  # sized as saved
            out[key] = torch.empty(tuple(saved[key].size), dtype=torch.uint8) \
                if key in saved else out[key]
        return out

    def restore(self, store: _Store, path: Path, loaded: dict[str, Any]) -> None:
        _, json_values = self._entries(store, lambda t: t)
        for key, (p, field) in json_values.items():
            self.optimizer.state[p][field] = _json_value(loaded[key], key)


class _SharedState:
    """A Stateful part saved once (rank 0's: the same on every rank), as JSON and tensors."""

    def __init__(self, name: str, part: Stateful) -> None:
        self.name, self.part, self.where = name, part, StateKey("state", name)

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]:
        return encode_state(self.part.state_dict(), self.where) if store.rank == 0 else {}

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
        return _empty_entries(path, self.where, saved)

    def restore(self, store: _Store, path: Path, loaded: dict[str, Any]) -> None:
        _restore_part(path, self.name, lambda: self.part.load_state_dict(
            decode_state(loaded, self.where)))


class _RankState(_SharedState):
    """A Stateful part each rank saves (its RNG states): read back by the same rank, or rank
    0's where the saving grid had fewer ranks."""

    def __init__(self, name: str, part: Stateful, rank: int) -> None:
        super().__init__(name, part)
        self.where = self.own = StateKey("rank", name, rank=rank)

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]:
        return encode_state(self.part.state_dict(), self.own)

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
        ranks = {k.rank for s in saved if (k := StateKey.parse(s)) is not None
                 and k.area == "rank"}
        self.where = self.own if self.own.rank in ranks else StateKey("rank", self.name, rank=0)
        return _empty_entries(path, self.where, saved)


class _ShardedState:
    """A ShardedStateful part: its tensors by the layouts it gives them (shards/NAME/global/KEY,
    DTensors: any grid reads them back), those without a layout per rank (shards/NAME/rankR/
    KEY: only the saving grid can), its JSON once (state/NAME/json)."""

    def __init__(self, name: str, part: ShardedStateful) -> None:
        self.name, self.part = name, part

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]:
        tensors, meta = self.part.state_dict()
        out = encode_state(meta, StateKey("state", self.name)) if store.rank == 0 else {}
        for key, t in tensors.items():
            layout = self.part.layout_of(key)
            if t.dim() == 0:
                out[str(StateKey("shards", self.name, key))] = prepare(t.detach())
            elif layout is None:
                out[str(StateKey("shards", self.name, key, store.rank))] = prepare(t.detach())
            else:
                out[str(StateKey("shards", self.name, key))] = _wrap(
                    prepare(t.detach()), layout, _full_shape(t, layout, store.grid),
                    store.mesh, key)
        return out

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's shards of the saved tensors, allocated for DCP to fill (wrapped as
        DTensors); a tensor saved per rank is refused on a grid other than the one that wrote
        it."""
        out = _empty_entries(path, StateKey("state", self.name), saved)
        keys = [(k, s) for s in saved if (k := StateKey.parse(s)) is not None
                and k.area == "shards" and k.name == self.name]
        per_rank = sorted(k.entry for k, _ in keys if k.rank is not None)
        saved_grid = _saved_grid(path)
        if per_rank and saved_grid != str(store.grid.shape):
            raise CheckpointError(
                f"checkpoint {path}: the state of {self.part.describe()} ({per_rank[0]}) was "
                f"kept per rank on the grid {saved_grid} and does not reshard to "
                f"{store.grid.shape}; resume on {saved_grid}")
        for key, text in keys:
            if key.rank not in (None, store.rank):
                continue
            size = tuple(saved[text].size)
            layout = self.part.layout_of(key.entry) if key.rank is None and size else None
            if key.rank is None and size and layout is None:
                raise CheckpointError(f"checkpoint {path} does not fit this run: "
                                      f"{self.part.describe()} keeps no state {key.entry!r}")
            try:
                local_shape = size if layout is None else \
                    layout.local_shape(size, store.grid.shape, key.entry)
            except FourfoldError as e:  # a global tensor this grid cannot split evenly
                raise CheckpointError(f"checkpoint {path}: {self.part.describe()}: "
                                      f"{_one_line(e)}") from None
            local = torch.empty(local_shape, dtype=saved[text].properties.dtype)
            out[text] = local if layout is None else _wrap(local, layout, size, store.mesh,
                                                           key.entry)
        return out

    def restore(self, store: _Store, path: Path, loaded: dict[str, Any]) -> None:
        shards = {}
        for text, value in loaded.items():
            key = StateKey.parse(text)
            if key is not None and key.area == "shards" and key.name == self.name:
                shards[key.entry] = value.to_local() if hasattr(value, "to_local") else value
        meta = decode_state(loaded, StateKey("state", self.name))
        _restore_part(path, self.name, lambda: self.part.load_state_dict(shards, meta))


class _Store(Protocol):
    """What a part's save and load see of the manager."""

    grid: Grid
    mesh: Any
    rank: int


class _Stored(Protocol):
    """A registered part as the manager drives it: its entries to save, the entries DCP loads
    into, and what it does with them once loaded."""

    def save(self, store: _Store, prepare: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, Any]: ...

    def targets(self, store: _Store, path: Path, saved: Mapping[str, Any]) -> dict[str, Any]: ...

    def restore(self, store: _Store, path: Path, loaded: dict[str, Any]) -> None: ...


def _empty_entries(path: Path, where: StateKey, saved: Mapping[str, Any]) -> dict[str, Any]:
    """Empty tensors, sized from the index, for every entry at `where` (a part's JSON and
    tensors); a part without its JSON is refused."""
    json_key = str(where.with_entry(_JSON))
    if json_key not in saved:
        raise CheckpointError(f"checkpoint {path} has no saved state "
                              f"{str(where.with_entry(''))[:-1]!r}; was it written by this "
                              "version of fourfold?")
    prefix = str(where.with_entry(""))
    return {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in saved.items() if k.startswith(prefix)}


def _restore_part(path: Path, name: str, restore: Callable[[], None]) -> None:
    """Run a part's own restore; its complaint about what it is given as one line."""
    try:
        restore()
    except CheckpointError:
        raise
    except Exception as e:  # the part's own check of what it is given
        raise CheckpointError(f"checkpoint {path}: cannot restore {name!r}: "
                              f"{type(e).__name__}: {_one_line(e)}") from None


class CheckpointManager:
    """Writes, finds, verifies and loads the checkpoints of one run. On a grid every rank
    constructs one (collective) and calls register/save/load/latest_valid at the same points.

    What a checkpoint holds is what was registered (`register`), each part by its kind: the
    model (ModelState) and a torch optimizer (OptimizerState) by parameter name, as DTensors;
    a ShardedStateful (a training method's state) by the layouts it gives; a Stateful once
    (the same on every rank: trainer counters, data loader, loss guard); and each rank's RNG
    states, which the manager registers itself. Everything is tensors plus JSON: loading never
    unpickles anything from the checkpoint's data.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, grid: Grid) -> None:
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(run_dir)
        self.cfg = cfg
        self.grid = grid
        self.async_save = cfg.is_async(on_host=grid.device.type == "cpu")
        self.rank = grid.rank
        # a one-rank grid that forces the engine (Grid.force_groups) takes the grid's path too
        # a simulated job (torch's fake process group, no data behind it) never saves
        self.distributed = ((grid.world_size > 1 or grid.force_groups) and dist.is_initialized()
                            and not grid.simulated)
        # A group of its own: the writer thread's collectives never meet training traffic.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.mesh = build_mesh(grid) if self.distributed else None
        self._parts: dict[str, _Stored] = {}
        self.register(_RNG, RandomState())
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_saved: Path | None = None
        self._verified: set[str] = set()
        self.damaged: list[tuple[str, str]] = []  # (name, why) that latest_valid skipped
        self.staged_bytes = 0  # a simulated rank's last checkpoint, staged and not written
        # what the run is (fourfold.rundir.run_identity): each manifest records it, and a
        # resuming run is compared with it
        self.identity: dict[str, str] = {}
        self._swept = False

    @classmethod
    def for_model(cls, run_dir: str | Path, cfg: CheckpointConfig, grid: Grid,
                  pmodel: ParallelModel, optimizer: torch.optim.Optimizer | None = None,
                  trainable_only: bool = False) -> CheckpointManager:
        """A manager of a model's checkpoints (and its torch optimizer's, where given)."""
        manager = cls(run_dir, cfg, grid)
        manager.register("model", ModelState(pmodel, trainable_only))
        if optimizer is not None:
            manager.register("optimizer", OptimizerState(optimizer, pmodel))
        return manager

    def register(self, name: str, part: ModelState | OptimizerState | Stateful
                 | ShardedStateful) -> None:
        """Save `part` in every checkpoint and restore it at load, under `name` (unique; a
        letter or digit first, no "/")."""
        if name in self._parts or name == _EXTRA or "/" in name or not name[:1].isalnum():
            raise ValueError(f"checkpoint part name {name!r} is taken or not a plain name")
        stored: _Stored
        if isinstance(part, (ModelState, OptimizerState)):
            stored = part
        elif hasattr(part, "layout_of"):
            stored = _ShardedState(name, part)  # type: ignore[arg-type]
        elif getattr(part, "per_rank", False):
            stored = _RankState(name, part, self.rank)  # type: ignore[arg-type]
        else:
            stored = _SharedState(name, part)  # type: ignore[arg-type]
        self._parts[name] = stored

    # ---- saving ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether checkpoint.every asks for a checkpoint after `step`."""
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, step: int, extra: Any = None) -> None:
        """Checkpoint the registered parts after `step`, and `extra` (JSON values and
        tensors, what load() returns). With checkpoint.async (is_async) the state is copied to
        CPU here and written in the background (call wait() to know it is complete);
        otherwise this returns when the checkpoint is complete. Raises CheckpointError for a
        failed earlier asynchronous save or (synchronously) a failed write."""
        self.wait()
        snapshot = self._snapshot(extra)
        if self.grid.simulated:
            # a simulated rank (fourfold.simulate) stages what it would write, so that its
            # memory is measured, and writes nothing: its fake tensors have no bytes, and no
            # other rank writes its shards beside it
            self.staged_bytes = sum({id(t.untyped_storage()): t.untyped_storage().nbytes()
                                     for t in snapshot.values()
                                     if isinstance(t, torch.Tensor)}.values())
            return
        if not self.async_save:
            self._last_saved = self._write(step, snapshot)
            return

        def run() -> None:
            try:
                self._last_saved = self._write(step, snapshot)
            except BaseException as e:  # handed to the training thread by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Wait for an asynchronous save; return the newest checkpoint this manager wrote.
        Raises its CheckpointError, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from None
            raise CheckpointError(f"checkpoint write failed: {type(error).__name__}: "
                                  f"{_one_line(error)}") from None
        return self._last_saved

    def close(self) -> None:
        """Wait for a pending save (raising its error)."""
        self.wait()

    def _snapshot(self, extra: Any) -> dict[str, Any]:
        """Everything to save, on CPU, as DCP's flat state dict of tensors: a copy for an
        asynchronous save (training goes on changing the tensors), the tensors themselves for
        a synchronous save of CPU tensors. The parts' states are taken here, on the calling
        thread."""
        copy = self.async_save

        def to_cpu(t: torch.Tensor) -> torch.Tensor:
            return to_host(t, copy)  # from a GPU: pinned, not blocking

        state: dict[str, Any] = {}
        if self.rank == 0:  # the same on every rank: one copy
            state.update(encode_state(extra, StateKey("state", _EXTRA)))
        for part in self._parts.values():
            state.update(part.save(self, to_cpu))
        wait_for_host_copies(self.grid.device)  # the parts' copies from the device
        return state

    def _write(self, step: int, snapshot: dict[str, Any]) -> Path:
        """Write a snapshot on every rank and publish it; returns the final directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        name = f"step_{step:08d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        problem = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if not self._swept:  # left by a crash mid-write or mid-delete (only writers sweep)
                    for stale in self.root.glob(".step_*"):
                        shutil.rmtree(stale, ignore_errors=True)
                    self._swept = True
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as e:
                problem = _os_reason(e)
        problem = self._agree(problem)
        if problem is not None:
            raise CheckpointError(f"cannot write checkpoint {final}: {problem}; earlier "
                                  "checkpoints are intact")
        try:
            try:
                with _quiet_single_process():
                    dcp.save(snapshot, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                             process_group=self.group, no_dist=not self.distributed)
                problem = None
            except (Exception, CheckpointException) as e:  # raised on every rank if any failed
                problem = _dcp_reason(e)
            problem = self._agree(problem)
            if problem is None:
                problem = self._publish(step, tmp, final)
            if problem is not None:
                raise CheckpointError(f"cannot write checkpoint {final}: {problem}; earlier "
                                      "checkpoints are intact")
        finally:
            if self.rank == 0 and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _publish(self, step: int, tmp: Path, final: Path) -> str | None:
        """Hash (each rank its own files), write the manifest, rename, prune. Returns the
        problem, agreed by every rank, or None."""
        mine = sorted(tmp.glob(f"__{self.rank}_*"))
        if self.rank == 0:
            mine.append(tmp / ".metadata")
        try:
            hashes: dict[str, Any] | str = {
                f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size} for f in mine}
        except OSError as e:
            hashes = _os_reason(e)
        gathered = self._gather(hashes)
        problem = None
        if self.rank == 0:
            errors = [h for h in gathered if isinstance(h, str)]
            if errors:
                problem = errors[0]
            else:
                files: dict[str, Any] = {}
                for h in gathered:
                    files.update(h)  # type: ignore[arg-type]
                try:
                    self._finish(step, tmp, final, files)
                except OSError as e:
                    problem = _os_reason(e)
        return self._agree(problem)

    def _finish(self, step: int, tmp: Path, final: Path, files: dict[str, Any]) -> None:
        manifest = {"format": "fourfold-dcp-1", "step": step, "grid": str(self.grid.shape),
                    "world_size": self.grid.world_size, "time": time.time(), "files": files,
                    "run": self.identity}
        _write_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # a damaged checkpoint of the same step, skipped when resuming
            final.rename(self.root / f".{final.name}.old")
            shutil.rmtree(self.root / f".{final.name}.old", ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(self.root)
        self._verified.add(final.name)
        self._prune(keep_newest=final)

    def _prune(self, keep_newest: Path) -> None:
        if self.cfg.keep <= 0:  # 0 keeps every checkpoint
            return
        complete = list_checkpoints(self.run_dir)
        for old in complete[self.cfg.keep:]:
            if old == keep_newest:
                continue
            trash = self.root / f".{old.name}.del"
            try:
                old.rename(trash)  # half-deleted never looks like a checkpoint
                shutil.rmtree(trash, ignore_errors=True)
            except OSError as e:
                warnings.warn(f"could not delete old checkpoint {old}: {_os_reason(e)}",
                              stacklevel=2)

    # ---- collectives on the checkpoint group ------------------------------------------------

    def _agree(self, problem: str | None) -> str | None:
        """The first rank's problem, known to all ranks (every rank calls this)."""
        if not self.distributed:
            return problem
        everything = self._gather(problem, to_all=True)
        return next((p for p in everything if p is not None), None)

    def _gather(self, obj: Any, to_all: bool = False) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.grid.world_size
        if to_all:
            dist.all_gather_object(out, obj, group=self.group)
            return out
        dist.gather_object(obj, out if self.rank == 0 else None, dst=0, group=self.group)
        return out

    # ---- finding and loading -------------------------------------------------------------------

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that passes verification. A damaged one (checksum, truncated,
        missing files) is skipped with a warning that names it, and listed in `damaged` with
        why (when none is valid there is no warning: the caller says what that means).
        Collective on a grid: the ranks split the hashing and agree on the answer."""
        self.wait()
        # rank 0 lists them, and knows which it wrote or checked already (_finish runs there)
        listed = ([(p.name, p.name in self._verified) for p in list_checkpoints(self.run_dir)]
                  if self.rank == 0 else [])
        if self.distributed:
            box = [listed]
            dist.broadcast_object_list(box, src=0, group=self.group)
            listed = box[0]
        self.damaged = []
        for name, verified in listed:
            path = self.root / name
            reason = None
            if not verified:
                share = (self.rank, self.grid.world_size) if self.distributed else (0, 1)
                reasons = self._gather(verify_checkpoint(path, share), to_all=True)
                reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                self._verified.add(name)
                for skipped, why in self.damaged if self.rank == 0 else []:
                    warnings.warn(f"checkpoint {self.root / skipped} is damaged ({why}); "
                                  "skipping it for the previous one", stacklevel=2)
                return path
            self.damaged.append((name, reason))
        return None

    def load(self, path: str | Path, restore_rng: bool = True) -> Any:
        """Load a checkpoint (written on any grid) into the registered parts (this rank's
        blocks of each saved tensor), restore this rank's RNG states (unless told not to), and
        return the saved `extra`.

        Only tensors are read: a checkpoint that holds pickled objects (one from an older
        fourfold, or one made to run code when opened) is refused with a CheckpointError."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.wait()
        path = Path(path)
        metadata = read_metadata(path)
        saved = metadata.state_dict_metadata
        pickled = sorted(k for k, v in saved.items() if not isinstance(v, TensorStorageMetadata))
        if pickled:
            raise CheckpointError(f"checkpoint {path} holds pickled objects ({pickled[0]}"
                                  f"{' ...' if len(pickled) > 1 else ''}); fourfold reads only "
                                  "tensors and JSON and does not unpickle them")
        parts = {name: part for name, part in self._parts.items()
                 if restore_rng or name != _RNG}
        state: dict[str, Any] = {}
        for part in parts.values():  # the model's and optimizer's first: checked below
            if isinstance(part, (ModelState, OptimizerState)):
                state.update(part.targets(self, path, saved))
        missing = sorted(k for k in state if k not in saved)
        if missing:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: it lacks "
                                  f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        extra = StateKey("state", _EXTRA)
        state.update(_empty_entries(path, extra, saved))
        for part in parts.values():
            if not isinstance(part, (ModelState, OptimizerState)):
                state.update(part.targets(self, path, saved))
        try:
            with torch.no_grad(), _quiet_single_process():
                dcp.load(state, storage_reader=_tensor_reader(path),
                         process_group=self.group, no_dist=not self.distributed)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"cannot load checkpoint {path}: {_dcp_reason(e)}") from None
        for part in parts.values():
            part.restore(self, path, state)
        return decode_state(state, extra)


def load_weights_from_checkpoint(path: str | Path, model: torch.nn.Module) -> None:
    """Load the weights of a checkpoint (from any grid) into a whole, unparallelized model on
    this process, e.g. to export a run whose model.safetensors was never written."""
    from fourfold.config import ParallelConfig
    from fourfold.parallel import parallelize

    grid = Grid.single()
    # without GEMM tuning a one-process grid leaves the model's modules as they are
    pmodel = parallelize(model, grid, ParallelConfig(gemm_tuning=False))
    CheckpointManager.for_model(Path(path).parent.parent, CheckpointConfig(), grid,
                                pmodel).load(path, restore_rng=False)


class BaseReference:
    """A checkpoint part of an adapter run: which frozen base its adapter belongs to (the
    init_from directory with the size and mtime of each of its files, or the seed of a base
    built from scratch). Restoring it refuses a base that has changed since, in one line."""

    def __init__(self, init_from: str, seed: int) -> None:
        self.init_from = init_from
        self.seed = seed

    def _files(self) -> dict[str, list[int]]:
        if not self.init_from:
            return {}
        root = Path(self.init_from)
        files = [root] if root.is_file() else sorted(
            f for f in root.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors"))
        return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}

    def state_dict(self) -> dict[str, Any]:
        return {"init_from": self.init_from, "seed": self.seed, "files": self._files()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_from, saved_files = state["init_from"], state["files"]
        if not saved_from:
            now = f"model.init_from = {self.init_from!r}" if self.init_from \
                else f"train.seed = {self.seed}"
            if self.init_from or state["seed"] != self.seed:
                raise CheckpointError(f"the adapter checkpoint's base was built from train.seed "
                                      f"= {state['seed']}, not {now}; resume with the base it "
                                      "was trained on")
            return
        if Path(saved_from).resolve() != Path(self.init_from or ".").resolve():
            raise CheckpointError(f"the adapter checkpoint's base is model.init_from = "
                                  f"{saved_from!r}, not {self.init_from!r}; resume with the base "
                                  "it was trained on")
        now = self._files()
        changed = sorted(n for n in set(saved_files) | set(now)
                         if list(saved_files.get(n, [])) != list(now.get(n, [])))
        if changed:
            raise CheckpointError(f"model.init_from = {saved_from!r} changed since the adapter "
                                  f"checkpoint was written ({changed[0]}: size or mtime "
                                  "differs); resume with the base it was trained on")


# --------------------------------------------------------------------------------------------
# small helpers


def _saved_grid(path: Path) -> str:
    """The grid a checkpoint was written on, as its manifest says ("" when unreadable)."""
    try:
        return str(json.loads((path / MANIFEST_FILE).read_text()).get("grid", ""))
    except (OSError, ValueError, AttributeError):
        return ""


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized;
    that is what fourfold means on one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_reason(error: OSError) -> str:
    return f"{error.strerror or type(error).__name__} ({error.filename or 'no file'})"


def _dcp_reason(error: BaseException) -> str:
    """The first underlying failure of a DCP CheckpointException (one per failed rank)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = sorted(failures.items())[0]
        inner = cause[0] if isinstance(cause, tuple) else cause
        inner = _os_error_within(inner) or inner
        if isinstance(inner, OSError):
            return f"rank {rank}: {_os_reason(inner)}"
        return f"rank {rank}: {type(inner).__name__}: {_one_line(inner)}"
    os_error = _os_error_within(error)
    if os_error is not None:
        return _os_reason(os_error)
    return f"{type(error).__name__}: {_one_line(error)}"


def _os_error_within(error: BaseException) -> OSError | None:
    """The OSError behind an error, if any: torch.save's writer turns a failed write (a full
    disk) into a RuntimeError about stream positions and keeps the OSError as its context."""
    seen: BaseException | None = error
    for _ in range(8):  # a short chain; never loop on a cycle
        if seen is None:
            return None
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


__all__ = ["BaseReference", "CHECKPOINT_DIR", "CheckpointError", "CheckpointManager",
           "build_mesh", "checkpoint_root", "init_optimizer_state",
           "list_checkpoints", "load_weights_from_checkpoint", "mesh_tensor",
           "placements_for",
           "RandomState", "ShardedStateful", "Stateful", "decode_state", "encode_state",
           "read_metadata", "step_of", "verify_checkpoint"]
