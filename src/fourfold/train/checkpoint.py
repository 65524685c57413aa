"""Sharded, asynchronous, verifiable checkpoints with torch.distributed.checkpoint (DCP), and
starting a run from a Hugging Face checkpoint.

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
on one grid loads on another, or on one process (plain full tensors).

Asynchronous saving: the state is copied to CPU memory on the calling thread (the snapshot),
then a background thread runs a blocking `dcp.save` of that snapshot on a dedicated gloo
process group, so its collectives never interleave with training traffic. (Not
`dcp.async_save`: the finishing steps -- hashes, manifest, rename, pruning -- need collectives of
their own after the write, in a fixed order on every rank; one thread owning the whole sequence
keeps that order.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from fourfold.config import CheckpointConfig, ConfigError
from fourfold.data.manifest import sha256_file
from fourfold.parallel.grid import Grid
from fourfold.parallel.layout import Layout
from fourfold.train.host_memory import to_host, wait_for_host_copies

CHECKPOINT_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
MESH_AXES = ("data", "y", "x", "z")  # DeviceMesh dim order; see the module docstring
_STEP_DIR = re.compile(r"^step_(\d+)$")
_MODEL, _OPTIM, _EXTRA, _RNG = "model/", "optim/", "extra", "rng/rank"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message is one line for the user."""


class InitFromError(ConfigError):
    """model.init_from names something that is not a usable Hugging Face checkpoint."""


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


def verify_checkpoint(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when every file listed in the manifest exists with its size and sha256; otherwise
    why not (one short phrase). With share = (index, count), only every count-th file from the
    index-th is hashed (sizes are checked for all): the ranks of a job split the reading."""
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
        if i % count == index and sha256_file(file) != entry["sha256"]:
            return f"{name} fails its sha256 checksum"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read {MANIFEST_FILE} ({e})") from None


# --------------------------------------------------------------------------------------------
# Layout -> DTensor


def mesh_tensor(grid: Grid) -> torch.Tensor:
    """Global ranks arranged as (data, y, x, z): ranks are numbered (data, z, y, x), x fastest."""
    s = grid.shape
    return torch.arange(s.size).reshape(s.data, s.z, s.y, s.x).permute(0, 2, 3, 1).contiguous()


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
    if grid.world_size == 1:
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


def rng_state() -> dict[str, Any]:
    """Every random generator training may touch on this rank."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# --------------------------------------------------------------------------------------------
# The manager


class CheckpointManager:
    """Writes, finds, verifies and loads the checkpoints of one run. On a grid every rank
    constructs one (collective) and calls save/load/latest_valid at the same points.

    Saved state: model parameters and optimizer state (by parameter name, as DTensors), the
    caller's `extra` (any picklable object: step, scheduler, data loader, counters), and each
    rank's RNG states (restored by load()).
    """

    def __init__(self, run_dir: str | Path, cfg: CheckpointConfig, grid: Grid) -> None:
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(run_dir)
        self.cfg = cfg
        self.grid = grid
        self.rank = grid.rank
        self.distributed = grid.world_size > 1 and dist.is_initialized()
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
        """Checkpoint the state after `step`. With checkpoint.async_save the state is copied
        to CPU here and written in the background (call wait() to know it is complete);
        otherwise this returns when the checkpoint is complete. Raises CheckpointError for a
        failed earlier asynchronous save or (synchronously) a failed write."""
        self.wait()
        snapshot = self._snapshot(pmodel, optimizer, extra)
        if not self.cfg.async_save:
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
        """Everything to save, on CPU, as DCP's flat state dict: a copy for an asynchronous
        save (training goes on changing the tensors), the tensors themselves for a synchronous
        save of CPU tensors."""
        copy = self.cfg.async_save

        def to_cpu(t: torch.Tensor) -> torch.Tensor:
            return to_host(t, copy)  # from a GPU: pinned, not blocking

        state = self._tensor_state(pmodel, optimizer, to_cpu)
        wait_for_host_copies(self.grid.device)
        state[_EXTRA] = _to_bytes(extra)
        state[f"{_RNG}{self.rank}"] = _to_bytes(rng_state())
        return state

    def _tensor_state(self, pmodel: Any, optimizer: torch.optim.Optimizer | None,
                      prepare: Any) -> dict[str, Any]:
        layouts = pmodel.layouts()
        state: dict[str, Any] = {}
        full_shapes: dict[str, tuple[int, ...]] = {}
        for name, p in pmodel.named_parameters():
            full_shapes[name] = _full_shape(p, layouts[name], self.grid)
            state[_MODEL + name] = _wrap(prepare(p), layouts[name], full_shapes[name], self.mesh,
                                         name)
        if optimizer is None:
            return state
        names = _param_names(pmodel)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p not in optimizer.state:
                    continue
                name = names[id(p)]
                for key, value in optimizer.state[p].items():
                    if not torch.is_tensor(value):
                        state[f"{_OPTIM}{name}/{key}"] = _to_bytes(value)
                    elif value.shape == p.shape and value.dim() > 0:  # shaped like the shard
                        state[f"{_OPTIM}{name}/{key}"] = _wrap(prepare(value), layouts[name],
                                                               full_shapes[name], self.mesh, name)
                    else:  # a scalar such as AdamW's step: the same on every rank
                        state[f"{_OPTIM}{name}/{key}"] = prepare(value)
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
        optimizer (None: weights only), restore this rank's RNG states, and return the saved
        `extra`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.wait()
        path = Path(path)
        try:
            metadata = dcp.FileSystemReader(path).read_metadata()
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint {path}: {_one_line(e)}") from None
        saved_keys = set(metadata.state_dict_metadata)
        if optimizer is not None:
            init_optimizer_state(optimizer)

        def same(t: torch.Tensor) -> torch.Tensor:
            return t.detach()  # DCP copies into the very storage of the parameter / state

        with torch.no_grad():
            state = self._tensor_state(pmodel, optimizer, same)
        missing = sorted(k for k in state if k not in saved_keys)
        if missing:
            raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: it lacks "
                                  f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        rng_key = f"{_RNG}{self.rank}" if f"{_RNG}{self.rank}" in saved_keys else f"{_RNG}0"
        state[_EXTRA] = b""
        if restore_rng and rng_key in saved_keys:
            state[rng_key] = b""
        try:
            with torch.no_grad(), _quiet_single_process():
                dcp.load(state, storage_reader=dcp.FileSystemReader(path),
                         process_group=self.group, no_dist=not self.distributed)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"cannot load checkpoint {path}: {_dcp_reason(e)}") from None
        for key, value in state.items():
            if key.startswith(_OPTIM) and isinstance(value, bytes):  # non-tensor state values
                name, field = key[len(_OPTIM):].rsplit("/", 1)
                self._set_optimizer_value(pmodel, optimizer, name, field, _from_bytes(value))
        if rng_key in state:
            set_rng_state(_from_bytes(state[rng_key]))
        return _from_bytes(state[_EXTRA])

    @staticmethod
    def _set_optimizer_value(pmodel: Any, optimizer: Any, name: str, field: str,
                             value: Any) -> None:
        params = dict(pmodel.named_parameters())
        optimizer.state[params[name]][field] = value


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


# --------------------------------------------------------------------------------------------
# Hugging Face checkpoints as a starting point


def hf_model_config(path: str | Path) -> Any:
    """The ModelConfig of a local Hugging Face checkpoint directory (config.json)."""
    from fourfold.models.hf import config_from_hf

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise InitFromError(f"model.init_from = {str(path)!r}: no config.json there; expected a "
                            "local Hugging Face checkpoint directory")
    try:
        return config_from_hf(json.loads(config_file.read_text()))
    except (ValueError, KeyError) as e:
        raise InitFromError(f"model.init_from = {str(path)!r}: config.json is not a supported "
                            f"Llama-family config ({_one_line(e)})") from None


def _hf_weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise InitFromError(f"model.init_from = {str(root)!r}: no model.safetensors or "
                            "model.safetensors.index.json there (only safetensors are read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


@torch.no_grad()
def load_hf_into(pmodel: Any, path: str | Path) -> None:
    """Fill every local shard of `pmodel` from a local Hugging Face safetensors checkpoint.
    Each rank reads only the slices it owns (never the full model). Works for fourfold's Llama
    (names mapped) and for HF modules parallelized directly (names as they are)."""
    from safetensors import safe_open

    from fourfold.models.hf import fourfold_to_hf_name

    root = Path(path)
    where = _hf_weight_files(root)
    layouts = pmodel.layouts()
    shape = pmodel.grid.shape
    coords = shape.coords(pmodel.grid.rank)
    handles: dict[Path, Any] = {}
    try:
        for name, param in pmodel.named_parameters():
            hf_name = name if name in where else _hf_name(name, where, fourfold_to_hf_name)
            file = where[hf_name]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt").__enter__()
            piece = handles[file].get_slice(hf_name)
            full_shape = tuple(piece.get_shape())
            layout = layouts[name]
            local = layout.local_shape(full_shape, shape, name)
            if local != tuple(param.shape):
                raise InitFromError(f"model.init_from = {str(root)!r}: {hf_name} has shape "
                                    f"{full_shape}, which does not fit {name} "
                                    f"(local {tuple(param.shape)} on grid {shape})")
            offsets = layout.offsets(full_shape, shape, coords)
            block = piece[tuple(slice(o, o + n) for o, n in zip(offsets, local))]
            param.copy_(block.to(param.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def _hf_name(name: str, where: dict[str, Path], to_hf: Any) -> str:
    try:
        hf_name = to_hf(name)
    except KeyError:
        hf_name = name
    if hf_name in where:
        return hf_name
    if hf_name == "lm_head.weight" and "model.embed_tokens.weight" in where:
        return "model.embed_tokens.weight"  # tied word embeddings store one matrix
    raise InitFromError(f"the Hugging Face checkpoint has no tensor {hf_name!r} (for {name}); "
                        "is it a Llama-family model of the configured shape?")


# --------------------------------------------------------------------------------------------
# small helpers


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


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _os_reason(error: OSError) -> str:
    return f"{error.strerror or type(error).__name__} ({error.filename or 'no file'})"


def _dcp_reason(error: BaseException) -> str:
    """The first underlying failure of a DCP CheckpointException (one per failed rank)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = sorted(failures.items())[0]
        inner = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(inner, OSError):
            return f"rank {rank}: {_os_reason(inner)}"
        return f"rank {rank}: {type(inner).__name__}: {_one_line(inner)}"
    if isinstance(error, OSError):
        return _os_reason(error)
    return f"{type(error).__name__}: {_one_line(error)}"


__all__ = ["CHECKPOINT_DIR", "CheckpointError", "CheckpointManager", "InitFromError",
           "build_mesh", "checkpoint_root", "hf_model_config", "init_optimizer_state",
           "list_checkpoints", "load_hf_into", "load_weights_from_checkpoint", "mesh_tensor",
           "placements_for", "read_manifest",
           "rng_state", "set_rng_state", "step_of", "verify_checkpoint"]
