"""Sharded, asynchronous, verifiable checkpoints with torch.distributed.checkpoint (DCP).

Layout on disk (RUN_DIR/checkpoints/):

    step_00000100/            one complete checkpoint
        __0_0.distcp ...      DCP data, one file per rank (each rank writes its own shards)
        .metadata             DCP index (rank 0)
        manifest.json         step, grid, sha256 + size of every file above; written LAST
    .step_00000200.tmp/       a checkpoint being written (never read)

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
import json
import os
import pickle  # only to read DCP's index, restricted to its data classes
import random
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import numpy as np
import torch
import torch.distributed as dist

from fourfold.config import CheckpointConfig
from fourfold.data.manifest import sha256_file
from fourfold.errors import EXIT_FAILED, FourfoldError
from fourfold.errors import first_line as _one_line  # the shared helper, under its old name
from fourfold.parallel.grid import Axis, Grid
from fourfold.parallel.layout import Layout
from fourfold.train.host_memory import to_host, wait_for_host_copies

CHECKPOINT_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
MESH_AXES: tuple[Axis, ...] = ("data", "y", "x", "z")  # DeviceMesh dims; see the docstring
_STEP_DIR = re.compile(r"^step_(\d+)$")
# DCP keys: model/NAME and optim/NAME/KEY (sharded tensors); state/PART/... (a part whose
# state is the same on every rank, saved once); rank<R>/PART/... (one per rank: RNG states);
# shards/PART/global/KEY (a sharded part's tensors, as DTensors) and shards/PART/rank<R>/KEY
# (its tensors without a layout).
_MODEL, _OPTIM, _STATE, _EXTRA = "model/", "optim/", "state/", "extra"
_SHARDS = "shards/"


class CheckpointError(FourfoldError, RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line for the user."""

    exit_code = EXIT_FAILED


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_of(path: Path) -> int:
    """The step number of a checkpoint directory (step_00000100 -> 100)."""
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Visible (renamed, so once complete) checkpoint directories, newest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=step_of, reverse=True)


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

    try:
        return DeviceMesh("cpu", mesh_tensor(grid), mesh_dim_names=MESH_AXES,
                          _init_backend=False)
    except TypeError:  # a torch without _init_backend: let it build its groups
        return DeviceMesh("cpu", mesh_tensor(grid), mesh_dim_names=MESH_AXES)


def _wrap(local: torch.Tensor, layout: Layout, full_shape: tuple[int, ...], mesh: Any,
          name: str) -> Any:
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    full = torch.empty(full_shape, device="meta")
    return DTensor.from_local(local, mesh, placements_for(layout, len(full_shape), name),
                              run_check=False, shape=torch.Size(full_shape), stride=full.stride())


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


def _param_names(pmodel: Any) -> dict[int, str]:
    return {id(p): n for n, p in pmodel.named_parameters()}


class Stateful(Protocol):
    """A part of a run that a checkpoint saves and restores: state_dict() returns JSON values
    (dicts with str keys, lists, str, int, float, bool, None) and tensors, nested freely;
    load_state_dict() takes what state_dict() returned (tuples come back as lists)."""

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
    """Every random generator training may touch on this rank, as a Stateful part."""

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


# A part's state on disk: its JSON (tensors replaced by {_TENSOR_REF: i}) as a uint8 tensor
# under PREFIX + "json", and tensor i under PREFIX + "tensor<i>". Nothing is pickled.
_TENSOR_REF = "__tensor__"
_JSON_KEY = "json"


def encode_state(tree: Any, prefix: str) -> dict[str, torch.Tensor]:
    """A Stateful part's state as flat DCP entries (tensors only) under `prefix`."""
    tensors: dict[str, torch.Tensor] = {}

    def plain(value: Any, where: str) -> Any:
        if torch.is_tensor(value):
            key = f"tensor{len(tensors)}"
            tensors[prefix + key] = value.detach().to("cpu", copy=True)
            return {_TENSOR_REF: len(tensors) - 1}
        if isinstance(value, dict):
            if _TENSOR_REF in value or not all(isinstance(k, str) for k in value):
                raise CheckpointError(f"{prefix}{where}: state dict keys must be strings other "
                                      f"than {_TENSOR_REF!r}")
            return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        raise CheckpointError(f"{prefix}{where}: a {type(value).__name__} cannot be saved; "
                              "a state dict holds tensors and JSON values only")

    text = json.dumps(plain(tree, "state"))  # NaN and inf stay (a skipped step's loss is NaN)
    tensors[prefix + _JSON_KEY] = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    return tensors


def decode_state(entries: dict[str, torch.Tensor], prefix: str) -> Any:
    """What encode_state(tree, prefix) encoded, from the loaded entries."""
    try:
        tree = json.loads(bytes(entries[prefix + _JSON_KEY].numpy()).decode())
    except (KeyError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{prefix}{_JSON_KEY}: unreadable saved state "
                              f"({type(e).__name__})") from None

    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR_REF}:
                return entries[f"{prefix}tensor{value[_TENSOR_REF]}"]
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


class CheckpointManager:
    """Writes, finds, verifies and loads the checkpoints of one run. On a grid every rank
    constructs one (collective) and calls save/load/latest_valid at the same points.

    Saved state: model parameters and optimizer state (by parameter name, as DTensors); each
    part in `states` (name -> Stateful, the same state on every rank: trainer counters, data
    loader, loss guard), collected at save() and restored by load(); the caller's `extra`
    (JSON values and tensors); and each rank's RNG states. Everything is tensors plus JSON:
    loading never unpickles anything from the checkpoint's data.

    trainable_only (an adapter run): only the parameters that train are saved and loaded; the
    frozen base is rebuilt by the run builder (a BaseReference part checks it is the same).

    sharded_states (name -> ShardedStateful: a training method's state): its tensors are saved
    as DTensors by their layouts, like the model's, so they load on any grid; its JSON once.
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, grid: Grid,
                 states: Mapping[str, Stateful] | None = None,
                 trainable_only: bool = False,
                 sharded_states: Mapping[str, ShardedStateful] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.trainable_only = trainable_only
        self.root = checkpoint_root(run_dir)
        self.cfg = cfg
        self.grid = grid
        self.async_save = cfg.is_async(on_host=grid.device.type == "cpu")
        self.rank = grid.rank
        self.states: dict[str, Stateful] = dict(states or {})
        if _EXTRA in self.states:
            raise ValueError(f"{_EXTRA!r} is reserved for save()'s extra; name the part otherwise")
        # each rank's own part: its RNG states (a method's state is a sharded part)
        self.rank_states: dict[str, Stateful] = {"rng": RandomState()}
        self.sharded_states: dict[str, ShardedStateful] = dict(sharded_states or {})
        clash = sorted(set(self.sharded_states) & (set(self.states) | {_EXTRA}))
        if clash:  # both keep their JSON under state/NAME/
            raise ValueError(f"{clash[0]!r} names a part in states and in sharded_states")
        # a one-rank grid that forces the engine (Grid.force_groups) takes the grid's path too
        # a simulated job (torch's fake process group, no data behind it) never saves
        self.distributed = ((grid.world_size > 1 or grid.force_groups) and dist.is_initialized()
                            and grid.backend != "fake")
        # A group of its own: the writer thread's collectives never meet training traffic.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.mesh = build_mesh(grid) if self.distributed else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_saved: Path | None = None
        self._verified: set[str] = set()
        self._swept = False

    # ---- saving ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether checkpoint.every asks for a checkpoint after `step`."""
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, step: int, pmodel: Any, optimizer: torch.optim.Optimizer | None,
             extra: Any = None) -> None:
        """Checkpoint the state after `step`. With checkpoint.async (is_async) the state is copied
        to CPU here and written in the background (call wait() to know it is complete);
        otherwise this returns when the checkpoint is complete. Raises CheckpointError for a
        failed earlier asynchronous save or (synchronously) a failed write."""
        self.wait()
        snapshot = self._snapshot(pmodel, optimizer, extra)
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

    def _snapshot(self, pmodel: Any, optimizer: torch.optim.Optimizer | None,
                  extra: Any) -> dict[str, Any]:
        """Everything to save, on CPU, as DCP's flat state dict of tensors: a copy for an
        asynchronous save (training goes on changing the tensors), the tensors themselves for
        a synchronous save of CPU tensors. The parts' states are taken here, on the calling
        thread."""
        copy = self.async_save

        def to_cpu(t: torch.Tensor) -> torch.Tensor:
            return to_host(t, copy)  # from a GPU: pinned, not blocking

        state, _ = self._tensor_state(pmodel, optimizer, to_cpu)
        if self.rank == 0:  # the same on every rank (per-rank timings aside): one copy
            state.update(encode_state(extra, f"{_STATE}{_EXTRA}/"))
            for name, part in self.states.items():
                state.update(encode_state(part.state_dict(), f"{_STATE}{name}/"))
        for name, part in self.rank_states.items():
            state.update(encode_state(part.state_dict(), f"rank{self.rank}/{name}/"))
        for name, part in self.sharded_states.items():
            tensors, meta = part.state_dict()
            if self.rank == 0:
                state.update(encode_state(meta, f"{_STATE}{name}/"))
            state.update(self._shards(name, part, tensors, to_cpu))
        wait_for_host_copies(self.grid.device)  # the model's, the optimizer's, the parts'
        return state

    def _shards(self, name: str, part: ShardedStateful, tensors: dict[str, torch.Tensor],
                prepare: Any) -> dict[str, Any]:
        """A sharded part's tensors by DCP key: DTensors of their global tensors, 0-dim ones
        plain (the same on every rank), those without a layout under this rank's own key."""
        out: dict[str, Any] = {}
        for key, t in tensors.items():
            layout = part.layout_of(key)
            if t.dim() == 0:
                out[f"{_SHARDS}{name}/global/{key}"] = prepare(t.detach())
            elif layout is None:
                out[f"{_SHARDS}{name}/rank{self.rank}/{key}"] = prepare(t.detach())
            else:
                out[f"{_SHARDS}{name}/global/{key}"] = _wrap(
                    prepare(t.detach()), layout, _full_shape(t, layout, self.grid), self.mesh, key)
        return out

    def _tensor_state(self, pmodel: Any, optimizer: torch.optim.Optimizer | None,
                      prepare: Any) -> tuple[dict[str, Any], set[str]]:
        """Model and optimizer tensors by DCP key, and the keys of non-tensor optimizer values
        (none in torch's AdamW), which are stored as JSON (load() sizes them from the
        checkpoint's metadata)."""
        layouts = pmodel.layouts()
        state: dict[str, Any] = {}
        json_keys: set[str] = set()
        full_shapes: dict[str, tuple[int, ...]] = {}
        for name, p in pmodel.named_parameters():
            if self.trainable_only and not p.requires_grad:
                continue  # the frozen base: rebuilt from model.init_from (or the seed)
            full_shapes[name] = _full_shape(p, layouts[name], self.grid)
            state[_MODEL + name] = _wrap(prepare(p), layouts[name], full_shapes[name], self.mesh,
                                         name)
        if optimizer is None:
            return state, json_keys
        names = _param_names(pmodel)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in optimizer.state:
                    continue
                name = names[id(p)]
                for key, value in optimizer.state[p].items():
                    where = f"{_OPTIM}{name}/{key}"
                    if not torch.is_tensor(value):
                        state[where] = encode_state(value, where + "/")[where + "/" + _JSON_KEY]
                        json_keys.add(where)
                    elif value.shape == p.shape and value.dim() > 0:  # shaped like the shard
                        state[where] = _wrap(prepare(value), layouts[name], full_shapes[name],
                                             self.mesh, name)
                    else:  # a scalar such as AdamW's step: the same on every rank
                        state[where] = prepare(value)
        return state, json_keys

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
                    "world_size": self.grid.world_size, "time": time.time(), "files": files}
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
        missing files) is skipped with a warning that names it. Collective on a grid: the
        ranks split the hashing and agree on the answer."""
        self.wait()
        # rank 0 lists them, and knows which it wrote or checked already (_finish runs there)
        listed = ([(p.name, p.name in self._verified) for p in list_checkpoints(self.run_dir)]
                  if self.rank == 0 else [])
        if self.distributed:
            box = [listed]
            dist.broadcast_object_list(box, src=0, group=self.group)
            listed = box[0]
        for name, verified in listed:
            path = self.root / name
            reason = None
            if not verified:
                share = (self.rank, self.grid.world_size) if self.distributed else (0, 1)
                reasons = self._gather(verify_checkpoint(path, share), to_all=True)
                reason = next((r for r in reasons if r is not None), None)
            if reason is None:
                self._verified.add(name)
                return path
            if self.rank == 0:
                warnings.warn(f"checkpoint {path} is damaged ({reason}); skipping it for the "
                              "previous one", stacklevel=2)
        return None

    def load(self, path: str | Path, pmodel: Any, optimizer: torch.optim.Optimizer | None,
             restore_rng: bool = True) -> Any:
        """Load a checkpoint (written on any grid) into this rank's shards of the model and
        optimizer (None: weights only) and into every part in `states` and `sharded_states`
        (this rank's blocks of each saved tensor), restore this rank's RNG states, and return
        the saved `extra`.

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
        if optimizer is not None:
            init_optimizer_state(optimizer)

        def same(t: torch.Tensor) -> torch.Tensor:
            return t.detach()  # DCP copies into the very storage of the parameter / state

        with torch.no_grad():
            state, json_values = self._tensor_state(pmodel, optimizer, same)
        missing = sorted(k for k in state if k not in saved)
        if missing:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: it lacks "
                                  f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        # Which parts to read: the extra and the shared parts, and this rank's own states (a
        # checkpoint from fewer ranks: rank 0's). Their sizes come from the metadata.
        rank_prefix = f"rank{self.rank}/"
        if not any(k.startswith(rank_prefix) for k in saved):
            rank_prefix = "rank0/"
        prefixes = [f"{_STATE}{_EXTRA}/"] + [f"{_STATE}{name}/" for name in self.states]
        if restore_rng:
            prefixes += [f"{rank_prefix}{name}/" for name in self.rank_states]
        for prefix in prefixes:
            if prefix + _JSON_KEY not in saved:
                raise CheckpointError(f"checkpoint {path} has no saved state {prefix[:-1]!r}; "
                                      "was it written by this version of fourfold?")
        wanted = [k for k in saved if any(k.startswith(p) for p in prefixes)] + sorted(json_values)
        for key in wanted:
            meta = saved[key]
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        shards = {name: self._empty_shards(path, name, part, saved, state)
                  for name, part in self.sharded_states.items()}
        try:
            with torch.no_grad(), _quiet_single_process():
                dcp.load(state, storage_reader=_tensor_reader(path),
                         process_group=self.group, no_dist=not self.distributed)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"cannot load checkpoint {path}: {_dcp_reason(e)}") from None
        params = dict(pmodel.named_parameters())
        for key in json_values:
            name, field = key[len(_OPTIM):].rsplit("/", 1)
            value = decode_state({key + "/" + _JSON_KEY: state[key]}, key + "/")
            optimizer.state[params[name]][field] = value  # type: ignore[union-attr]
        for prefix in prefixes[1:]:
            name = prefix[:-1].split("/", 1)[1]
            part = self.states.get(name) if prefix.startswith(_STATE) else self.rank_states[name]
            assert part is not None
            try:
                part.load_state_dict(decode_state(state, prefix))
            except CheckpointError:
                raise
            except Exception as e:  # a part's own check of what it is given
                raise CheckpointError(f"checkpoint {path}: cannot restore {name!r}: "
                                      f"{type(e).__name__}: {_one_line(e)}") from None
        for name, sharded in self.sharded_states.items():
            try:
                sharded.load_state_dict(shards[name], decode_state(state, f"{_STATE}{name}/"))
            except CheckpointError:
                raise
            except Exception as e:  # the part's own check of what it is given
                raise CheckpointError(f"checkpoint {path}: cannot restore {name!r}: "
                                      f"{type(e).__name__}: {_one_line(e)}") from None
        return decode_state(state, f"{_STATE}{_EXTRA}/")

    def _empty_shards(self, path: Path, name: str, part: ShardedStateful, saved: Any,
                      state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """This rank's shards of a sharded part's saved tensors, allocated for DCP to fill (put
        into `state` under their keys, wrapped as DTensors); the same tensors by the part's
        keys. A tensor saved per rank is refused on a grid other than the one that wrote it."""
        json_key = f"{_STATE}{name}/{_JSON_KEY}"
        if json_key not in saved:
            raise CheckpointError(f"checkpoint {path} has no saved state {_STATE + name!r}; "
                                  "was it written by this version of fourfold?")
        state[json_key] = torch.empty(tuple(saved[json_key].size), dtype=torch.uint8)
        shared, own = f"{_SHARDS}{name}/global/", f"{_SHARDS}{name}/rank{self.rank}/"
        per_rank = sorted(k for k in saved if k.startswith(f"{_SHARDS}{name}/rank"))
        saved_grid = _saved_grid(path)
        if per_rank and saved_grid != str(self.grid.shape):
            key = per_rank[0].split("/", 3)[3]
            raise CheckpointError(
                f"checkpoint {path}: the state of {part.describe()} ({key}) was kept per rank on "
                f"the grid {saved_grid} and does not reshard to {self.grid.shape}; resume on "
                f"{saved_grid}")
        out: dict[str, torch.Tensor] = {}
        for k, meta in saved.items():
            if not k.startswith((shared, own)):
                continue
            key = k[len(shared if k.startswith(shared) else own):]
            size = tuple(meta.size)
            layout = part.layout_of(key) if k.startswith(shared) and size else None
            if k.startswith(shared) and size and layout is None:
                raise CheckpointError(f"checkpoint {path} does not fit this run: "
                                      f"{part.describe()} keeps no state {key!r}")
            try:
                local_shape = size if layout is None else \
                    layout.local_shape(size, self.grid.shape, key)
            except FourfoldError as e:  # a global tensor this grid cannot split evenly
                raise CheckpointError(f"checkpoint {path}: {part.describe()}: "
                                      f"{_one_line(e)}") from None
            out[key] = torch.empty(local_shape, dtype=meta.properties.dtype)
            state[k] = out[key] if layout is None else _wrap(out[key], layout, size, self.mesh,
                                                              key)
        return out


def load_weights_from_checkpoint(path: str | Path, model: torch.nn.Module) -> None:
    """Load the weights of a checkpoint (from any grid) into a whole, unparallelized model on
    this process, e.g. to export a run whose model.safetensors was never written."""
    from fourfold.config import ParallelConfig
    from fourfold.parallel import parallelize

    grid = Grid.single()
    manager = CheckpointManager(Path(path).parent.parent, CheckpointConfig(), grid)
    # without GEMM tuning a one-process grid leaves the model's modules as they are
    pmodel = parallelize(model, grid, ParallelConfig(gemm_tuning=False))
    manager.load(path, pmodel, None, restore_rng=False)


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
