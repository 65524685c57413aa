"""What a run directory holds, read without torch: its checkpoints, the tokenizer it trained
with, and the identity of the run a checkpoint belongs to.

A checkpoint's manifest records the run's identity (`run_identity`): the training method, the
adapter, the shapes of the model, the data (by the checksums of its shards) and the tokenizer
(by its fingerprint). Resuming compares it with the run about to go on (`check_resumable`) and
names every difference in one line, instead of failing later on a tensor that does not fit (or
not at all, for data or a tokenizer). The command line uses this module before torch is
imported: `--resume` without a checkpoint and `--no-resume` are dealt with here.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol

from fourfold.config import Config, ConfigError

if TYPE_CHECKING:
    from fourfold.data.tokenizers import Tokenizer

CONFIG_FILE = "config.toml"  # RUN_DIR/config.toml: the run's resolved config
CHECKPOINT_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"  # RUN_DIR/.lock: locked by the job that trains there; says who it is
LOCK_WAIT_S = 5.0  # how long a job waits for RUN_DIR's lock before it gives up
TOKENIZER_DIR = "tokenizer"  # RUN_DIR/tokenizer: the tokenizer the run trained with
_STEP_DIR = re.compile(r"^step_(\d+)$")
# the fields of ModelConfig that give the parameters their shapes
SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                "tie_embeddings", "bias")
# identity keys shown beside a difference but not compared themselves
_SHOWN_ONLY = ("data.path",)


class ResumeError(ConfigError):
    """A run that cannot go on from its run directory as asked; one line for the user."""


class RunDirInUse(ConfigError):
    """Another job is training in the run directory; one line for the user."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_of(path: Path) -> int:
    """The step number of a checkpoint directory (step_00000100 -> 100)."""
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint directory (expected step_NNNNNNNN)")
    return int(m.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Visible (renamed, so once complete) checkpoint directories, newest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=step_of, reverse=True)


def move_checkpoints_aside(run_dir: str | Path) -> Path | None:
    """Rename RUN_DIR/checkpoints to checkpoints.before-<time> (so that a fresh run neither
    resumes nor prunes them); the new name, or None when there were none."""
    root = checkpoint_root(run_dir)
    if not list_checkpoints(run_dir):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = root.with_name(f"{CHECKPOINT_DIR}.before-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = root.with_name(f"{CHECKPOINT_DIR}.before-{stamp}-{n}")
    os.rename(root, target)
    return target


@contextmanager
def hold_run_dir(run_dir: str | Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold RUN_DIR's lock (an flock on RUN_DIR/.lock) while the block runs, so that one job
    at a time trains there: two would resume from the same checkpoint, then overwrite and
    prune each other's. The lock goes with the process, however it ends. A lock still held
    after `wait_s` (LOCK_WAIT_S: a restarted rank may briefly overlap the one it replaces) is
    a RunDirInUse naming the holder. Where the file system has no locks, the block runs
    unguarded."""
    root = Path(run_dir)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    held = False
    with open(path, "a+") as lock:
        deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    break  # e.g. ENOLCK on a network file system without locks: unguarded
                if time.monotonic() >= deadline:
                    lock.seek(0)
                    holder = lock.read().strip() or "another process"
                    raise RunDirInUse(f"{str(run_dir)!r} is in use by another training job "
                                      f"({holder}); wait for it to end or stop it, or train "
                                      "into another --out") from None
                time.sleep(0.1)
        if held:
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            lock.flush()
        try:
            yield
        finally:
            # a command that stopped before it wrote anything leaves no directory behind
            # (undone while the lock is still held; unguarded, another job may be starting
            # in it)
            if held and created and [p.name for p in root.iterdir()] == [LOCK_FILE]:
                path.unlink(missing_ok=True)
                with suppress(OSError):
                    root.rmdir()


def check_resume_requested(run_dir: str | Path, named: bool) -> None:
    """`--resume`: a ResumeError unless RUN_DIR holds a checkpoint. `named`: the user named the
    run directory (else it is a fresh runs/<time>)."""
    if list_checkpoints(run_dir):
        return
    if not named:
        raise ResumeError("--resume: no run directory to resume; give it as `fourfold train "
                          "RUN_DIR --resume` or with --out RUN_DIR")
    raise ResumeError(f"--resume: {str(run_dir)!r} holds no checkpoint "
                      f"({CHECKPOINT_DIR}/step_*); leave --resume out to start a new run there")


# --------------------------------------------------------------------------------------------
# The identity of a run


def data_fingerprint(data_dir: str | Path) -> str:
    """The data a run trains on, by content: a hash of the checksums of its shards (the same
    data prepared into another directory has the same fingerprint)."""
    from fourfold.data.manifest import Manifest

    manifest = Manifest.load(data_dir)
    digest = hashlib.sha256()
    for name in sorted(manifest.splits):
        for shard in manifest.splits[name].shards:
            digest.update(f"{name}:{shard.tokens}:{shard.sha256}\n".encode())
    return "sha256:" + digest.hexdigest()


def run_identity(cfg: Config, data_dir: str | Path, tokenizer_fingerprint: str) -> dict[str, str]:
    """What a checkpoint of this run may only be resumed by (recorded in its manifest)."""
    identity = {"train.optimizer": cfg.train.optimizer, "adapter.kind": cfg.adapter.kind}
    for name in SHAPE_FIELDS:
        identity[f"model.{name}"] = str(getattr(cfg.model, name))
    identity["data"] = data_fingerprint(data_dir)
    identity["data.path"] = str(Path(data_dir).resolve())
    identity["tokenizer"] = tokenizer_fingerprint
    return identity


def saved_identity(checkpoint: Path) -> dict[str, str]:
    """The identity a checkpoint's manifest records ({} for one that records none)."""
    try:
        run = json.loads((checkpoint / MANIFEST_FILE).read_text()).get("run", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in run.items()} if isinstance(run, dict) else {}


def identity_changes(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """Each difference as `key old -> new` (keys either side lacks are not compared)."""
    from fourfold.data.tokenizers import short_fingerprint

    changes = []
    for key, old in saved.items():
        new = now.get(key)
        if key in _SHOWN_ONLY or new is None or new == old:
            continue
        if key == "data":
            changes.append(f"data {saved.get('data.path', '?')} ({short_fingerprint(old)}) -> "
                           f"{now.get('data.path', '?')} ({short_fingerprint(new)})")
        elif key == "tokenizer":
            changes.append(f"tokenizer {short_fingerprint(old)} -> {short_fingerprint(new)}")
        else:
            changes.append(f"{key} {old} -> {new}")
    return changes


def check_resumable(checkpoint: Path, identity: Mapping[str, str]) -> None:
    """A ResumeError naming every change since `checkpoint` was written, if any."""
    changes = identity_changes(saved_identity(checkpoint), identity)
    if changes:
        raise ResumeError(f"cannot resume from {checkpoint}: the run changed since ("
                          f"{'; '.join(changes)}); change it back, or start a new run with "
                          "--no-resume or another --out RUN_DIR")


class _Checkpoints(Protocol):
    root: Path
    damaged: list[tuple[str, str]]

    def latest_valid(self) -> Path | None: ...


def resume_point(checkpoints: _Checkpoints, identity: Mapping[str, str]) -> Path | None:
    """The checkpoint a resuming run goes on from: the newest valid one, checked against the
    run's identity; None when there is none at all. When checkpoints exist but none is valid,
    a ResumeError names each and why (a run must not start again from step 0 over them).
    Collective on a grid, as latest_valid is."""
    path = checkpoints.latest_valid()
    if path is None and checkpoints.damaged:
        listed = ", ".join(f"{name} ({why})" for name, why in checkpoints.damaged)
        raise ResumeError(f"no valid checkpoint to resume in {checkpoints.root}: {listed}; "
                          "nothing was changed; move them away or train with --no-resume")
    if path is not None:
        check_resumable(path, identity)
    return path


# --------------------------------------------------------------------------------------------
# The run's tokenizer


def save_run_tokenizer(run_dir: str | Path, tokenizer: "Tokenizer", data_dir: Path) -> Path:
    """Copy the run's tokenizer into RUN_DIR/tokenizer (a saved tokenizer keeps its
    fingerprint: see data.tokenizers), and the chat template of chat or instruction data into
    RUN_DIR (where `generate --chat` and `convert` read it)."""
    from fourfold.data.chat_template import TEMPLATE_FILE
    from fourfold.files import atomic_write_text

    directory = Path(run_dir) / TOKENIZER_DIR
    tokenizer.save(directory)
    if (data_dir / TEMPLATE_FILE).is_file():
        atomic_write_text(Path(run_dir) / TEMPLATE_FILE, (data_dir / TEMPLATE_FILE).read_text())
    return directory


def tokenizer_mismatch(what: str, theirs: str, ours: str, whose: str) -> str:
    """One line naming two tokenizers that differ."""
    from fourfold.data.tokenizers import short_fingerprint

    return (f"{what} was made with tokenizer {short_fingerprint(theirs)}, but {whose} uses "
            f"{short_fingerprint(ours)}; token ids of one mean other text in the other")


def resolved_data_path(path: str) -> str:
    """config data.path with a directory made absolute (a built-in corpus stays as named), so
    that a run's config.toml works from any directory."""
    if path.startswith("builtin:") or not path:
        return path
    return str(Path(path).expanduser().resolve())


def model_tokenizer_fingerprint(init_from: str) -> str | None:
    """The fingerprint of the tokenizer a model to start from was trained with: a fourfold
    RUN_DIR's own, or the tokenizer.json beside an HF checkpoint; None when it names none."""
    from fourfold.data.tokenizers import HF_FILE, META_FILE, stored_fingerprint

    root = Path(init_from).expanduser()
    for directory in (root / TOKENIZER_DIR, root):
        if (directory / HF_FILE).is_file() or (directory / META_FILE).is_file():
            return stored_fingerprint(directory)
    return None


def check_run_tokenizer(cfg: Config, data_dir: Path, fingerprint: str) -> None:
    """Refuse data whose tokenizer (`fingerprint`) is not the one the run recorded
    (data.tokenizer_fingerprint: a resumed run's config.toml) or the one the model it starts
    from (model.init_from) was trained with, in one line naming both."""
    recorded = cfg.data.tokenizer_fingerprint
    if recorded and recorded != fingerprint:
        raise ConfigError(tokenizer_mismatch(f"data.path = {str(data_dir)!r}", fingerprint,
                                             recorded, "this run (data.tokenizer_fingerprint)")
                          + "; train on data made with the run's tokenizer")
    init_from = cfg.model.init_from
    theirs = model_tokenizer_fingerprint(init_from) if init_from else None
    if theirs is not None and theirs != fingerprint:
        raise ConfigError(tokenizer_mismatch(f"data.path = {str(data_dir)!r}", fingerprint,
                                             theirs, f"model.init_from = {init_from!r}")
                          + "; prepare the data with the model's tokenizer (`fourfold prepare "
                          f"... --tokenizer {init_from}`)")


def check_data_for_run(run_dir: str | Path, cfg: Config, data_dir: Path, given: str) -> None:
    """Refuse a DATA_DIR (given on the command line as `given`) made with another tokenizer
    than the run `run_dir` (config `cfg`) trained with, in one line naming both."""
    from fourfold.data.manifest import data_tokenizer_fingerprint
    from fourfold.data.tokenizers import stored_fingerprint

    expected = cfg.data.tokenizer_fingerprint
    if not expected and (Path(run_dir) / TOKENIZER_DIR).is_dir():
        expected = stored_fingerprint(Path(run_dir) / TOKENIZER_DIR)
    if not expected:  # a run from before fingerprints: nothing to compare with
        return
    found = data_tokenizer_fingerprint(data_dir)
    if found != expected:
        raise ConfigError(tokenizer_mismatch(f"--data {given}", found, expected,
                                             f"the run {str(run_dir)!r}"))
