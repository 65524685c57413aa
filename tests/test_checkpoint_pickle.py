"""Opening a checkpoint runs none of its code: what a checkpoint holds besides tensors is JSON,
and one that carries a pickled object (in its data or in DCP's index) is refused with one line,
before anything is unpickled."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from fourfold.cli import main
from fourfold.config import CheckpointConfig
from fourfold.data.manifest import sha256_file
from fourfold.parallel import Grid
from fourfold.train.checkpoint import CheckpointError, CheckpointManager, list_checkpoints

import checkpoint_worker as worker  # noqa: E402  (a tiny model and its optimizer)
from conftest import JOB_VARIABLES
from test_cli import TINY_TRAIN

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


class Planted:
    """Unpickling this makes a directory: the proof that a loader ran the checkpoint's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _dcp_save(state: dict[str, object], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def _assert_one_line_refusal(error: CheckpointError, *fragments: str) -> None:
    message = str(error)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_checkpoint_with_a_pickled_object_is_refused_unread(tmp_path: Path) -> None:
    pmodel, _ = worker.build(Grid.single(), seed=7)
    marker = tmp_path / "planted-code-ran"
    path = tmp_path / "checkpoints" / "step_00000001"
    state: dict[str, object] = {f"model/{n}": p.detach().clone()
                                for n, p in pmodel.named_parameters()}
    state["state/extra/json"] = Planted(marker)  # what the trainer's extra state used to be
    _dcp_save(state, path)

    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(), Grid.single(), pmodel)
    with pytest.raises(CheckpointError) as info:
        manager.load(path)
    _assert_one_line_refusal(info.value, str(path), "pickled", "state/extra/json")
    assert not marker.exists()

    # The threat is real: a loader that unpickles (DCP's default for non-tensor values) runs it.
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"state/extra/json": b""}, checkpoint_id=path, no_dist=True)
    assert marker.is_dir()


def test_checkpoint_index_that_would_run_code_is_refused(tmp_path: Path) -> None:
    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(async_save=False),
                                          Grid.single(), pmodel, optimizer)
    worker.train_step(pmodel, optimizer, 1)
    manager.save(1, {"step": 1})
    path = list_checkpoints(tmp_path)[0]
    marker = tmp_path / "planted-code-ran"
    (path / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CheckpointError) as info:
        manager.load(path)
    _assert_one_line_refusal(info.value, str(path), ".metadata", "mkdir")
    assert not marker.exists()


def test_extra_state_is_tensors_and_json(tmp_path: Path) -> None:
    """What save() stores besides the model: JSON (NaN included) and tensors, read back as
    saved; a value that JSON cannot hold is refused when saving, not pickled."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fourfold.train.checkpoint import read_metadata

    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(async_save=False),
                                          Grid.single(), pmodel, optimizer)
    worker.train_step(pmodel, optimizer, 1)
    extra = {"step": 1, "losses": [2.5, float("nan")], "note": "hi",
             "nested": {"t": torch.arange(3)}}
    manager.save(1, extra)
    path = list_checkpoints(tmp_path)[0]
    saved = read_metadata(path).state_dict_metadata
    assert all(isinstance(v, TensorStorageMetadata) for v in saved.values())
    assert any(k.startswith("rank0/rng/") for k in saved)
    back = manager.load(path)
    assert back["step"] == 1 and back["note"] == "hi" and back["losses"][0] == 2.5
    assert back["losses"][1] != back["losses"][1]  # NaN
    assert torch.equal(back["nested"]["t"], torch.arange(3))
    with pytest.raises(CheckpointError, match="cannot be saved"):
        manager.save(2, {"step": object()})


def _rehash(path: Path) -> None:
    """Rewrite a checkpoint's manifest for its files as they are now (so that it verifies)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                         for f in path.iterdir() if f.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_resuming_from_a_pickled_checkpoint_is_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in JOB_VARIABLES:  # one process of its own, even inside a job
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, "--set", "checkpoint.every=1", "--set",
                 "checkpoint.async=false", "--out", str(run)]) == 0
    capsys.readouterr()
    path = list_checkpoints(run)[0]
    # the same checkpoint, with its trainer state replaced by a planted object
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=True)
    marker = tmp_path / "planted-code-ran"
    state["state/trainer/json"] = Planted(marker)
    manifest = (path / "manifest.json").read_text()
    shutil.rmtree(path)
    _dcp_save(state, path)
    (path / "manifest.json").write_text(manifest)
    _rehash(path)

    code = main(["train", str(run), "--set", "train.steps=4", "--out", str(run)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1, err
    assert len(lines) == 1 and "pickled" in lines[0] and str(path) in lines[0], err
    assert "Traceback" not in err
    assert not marker.exists()
