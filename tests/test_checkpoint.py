"""Checkpoints: exact resume, resharding across grids (8 ranks -> 4 ranks; 4 ranks -> 2 ranks
of another shape -> one process), damaged and failed checkpoints, and starting from a Hugging
Face checkpoint.

Two torchrun launches (checkpoint_worker.py) check many things each; the single-process checks
run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fourfold.config import CheckpointConfig
from fourfold.data.manifest import sha256_file
from fourfold.models import build_model
from fourfold.parallel import Grid, parallelize
from fourfold.train.checkpoint import (CheckpointError, CheckpointManager, list_checkpoints,
                                       load_weights_from_checkpoint, verify_checkpoint)

WORKER = Path(__file__).with_name("checkpoint_worker.py")
sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_worker as worker  # noqa: E402  (the same model and steps on one process)

SAVE_SHAPE = [1, 2, 1, 2]  # (data, z, y, x): z and x split
LOAD_SHAPE = [1, 1, 2, 1]  # y split: every parameter's blocks change


pytestmark = pytest.mark.usefixtures("one_thread")


def run_worker(nproc: int, phase: str, shape: list[int], out: Path, hf_dir: Path) -> list[dict]:
    env = dict(os.environ, FOURFOLD_TEST_PHASE=phase, FOURFOLD_TEST_SHAPE=json.dumps(shape),
               FOURFOLD_TEST_OUT=str(out), FOURFOLD_TEST_HF=str(hf_dir), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / f"{phase}_{nproc}.json").read_text())
    for rank, r in enumerate(results):
        assert r["ok"], f"rank {rank}:\n{r['error']}"
    return results


def write_hf_checkpoint(path: Path) -> None:
    """A tiny random HF LlamaForCausalLM saved with save_pretrained, and its logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, path / "reference.pt")


@pytest.fixture(scope="module")
def grids_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    hf_dir = out / "hf"
    write_hf_checkpoint(hf_dir)
    saved = run_worker(4, "save", SAVE_SHAPE, out, hf_dir)
    loaded = run_worker(2, "load", LOAD_SHAPE, out, hf_dir)
    return {"out": out, "save": saved, "load": loaded}


@pytest.fixture(scope="module")
def eight_to_four_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The issue's larger example: saved by 8 ranks (data 2, z 2, x 2), resumed on 4 ranks of
    another shape (y 2, x 2)."""
    out = tmp_path_factory.mktemp("ckpt8")
    hf_dir = out / "hf"
    write_hf_checkpoint(hf_dir)
    saved = run_worker(8, "save", [2, 2, 1, 2], out, hf_dir)
    loaded = run_worker(4, "load", [1, 1, 2, 2], out, hf_dir)
    return {"save": saved, "load": loaded}


def check_save_phase(save: list[dict]) -> None:
    """Everything a `save` launch checked, on each of its ranks."""
    for rank, r in enumerate(save):
        assert r["bad_offsets"] == [], f"rank {rank}: DTensor offsets differ from Layout.offsets"
        assert r["split_params"] > 0, f"rank {rank}"
        assert r["extra_step"] == worker.SAVE_AT
        assert Path(r["loaded_path"]).name == f"step_{worker.SAVE_AT:08d}"
        # every rank saw the same losses, and a fresh model with other weights, loaded on the
        # same grid, continues bit for bit
        assert r["losses"] == save[0]["losses"], f"rank {rank}"
        assert r["resumed_losses"] == r["losses"][worker.SAVE_AT:], f"rank {rank}"


def check_load_phase(save: list[dict], load: list[dict]) -> None:
    """Everything a `load` launch checked, on each of its ranks."""
    reference = save[0]["losses"][worker.SAVE_AT:]
    n = len(load)
    for rank, r in enumerate(load):
        # resharded onto this grid: the same weights, and training goes on as before
        assert r["max_weight_diff"] == 0.0, f"rank {rank}: weights differ after resharding"
        assert r["extra_step"] == worker.SAVE_AT
        for a, b in zip(r["continued_losses"], reference, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r["continued_losses"], reference)
        # saved after step SAVE_AT + 1 on this grid and resumed from it, bit for bit
        assert r["resumed_losses"] == r["continued_losses"][1:]
        # then a byte of a file that rank 1 alone hashes was flipped: no rank takes it
        assert r["damage_seen_by"] == [1], f"rank {rank}: {r['damage_seen_by']}"
        assert r["after_damage"] == "None", f"rank {rank}"
        # the straggler report's all-gather: every rank's time, in rank order
        assert r["step_times"] == [0.25 + i for i in range(n)]
        # a Hugging Face checkpoint loaded slice by slice onto this grid
        assert r["hf_logits_shape_ok"], f"rank {rank}"
        assert r["hf_logits_scale"] > 0.05, r  # random weights give logits of this size
        assert r["hf_logits_max_diff"] < 1e-5, f"rank {rank}: {r['hf_logits_max_diff']}"


@pytest.mark.ranks
def test_reshard_eight_ranks_to_four_ranks(eight_to_four_run: dict) -> None:
    save = eight_to_four_run["save"]
    check_save_phase(save)
    check_load_phase(save, eight_to_four_run["load"])


@pytest.mark.ranks
def test_four_rank_stop_and_resume_is_exact(grids_run: dict) -> None:
    check_save_phase(grids_run["save"])


@pytest.mark.ranks
def test_four_ranks_to_two_ranks(grids_run: dict) -> None:
    check_load_phase(grids_run["save"], grids_run["load"])


@pytest.mark.ranks
def test_reshard_four_ranks_to_one_process(grids_run: dict) -> None:
    out = grids_run["out"]
    pmodel, optimizer = worker.build(Grid.single(), seed=11)
    manager = CheckpointManager.for_model(out / "run_save", CheckpointConfig(), Grid.single(),
                                          pmodel, optimizer)
    extra = manager.load(manager.latest_valid())
    expected = torch.load(out / "full_at_save.pt")
    state = pmodel.module.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    # weights only, into a plain model (what `fourfold convert` uses without model.safetensors)
    plain = build_model(worker.MODEL, seed=12)
    load_weights_from_checkpoint(manager.latest_valid(), plain)
    for name, tensor in expected.items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    losses = [worker.train_step(pmodel, optimizer, s)
              for s in range(extra["step"] + 1, worker.STEPS + 1)]
    reference = grids_run["save"][0]["losses"][worker.SAVE_AT:]
    for a, b in zip(losses, reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, reference)


# ---- one process ------------------------------------------------------------------------------


def _train(pmodel, optimizer, steps: range) -> list[float]:
    return [worker.train_step(pmodel, optimizer, s) for s in steps]


@pytest.mark.parametrize("async_save", [True, False])
def test_one_process_round_trip_is_bit_exact(tmp_path: Path, async_save: bool) -> None:
    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(
        tmp_path, CheckpointConfig(every=2, keep=2, async_save=async_save), Grid.single(),
        pmodel, optimizer)
    losses = []
    for step in range(1, 7):
        losses.append(worker.train_step(pmodel, optimizer, step))
        if manager.due(step):
            torch.manual_seed(100 + step)  # the RNG state the checkpoint must restore
            manager.save(step, {"step": step, "note": "hello"})
    manager.close()
    # keep = 2: the oldest of three is gone, and only complete checkpoints are visible
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000004"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]

    resumed, resumed_opt = worker.build(Grid.single(), seed=8)
    path = list_checkpoints(tmp_path)[1]
    extra = CheckpointManager.for_model(tmp_path, CheckpointConfig(), Grid.single(), resumed,
                                        resumed_opt).load(path)
    assert extra == {"step": 4, "note": "hello"}
    after_load = torch.rand(3)
    torch.manual_seed(104)
    assert torch.equal(after_load, torch.rand(3)), "RNG state not restored"
    assert _train(resumed, resumed_opt, range(5, 7)) == losses[4:]


def _save_two(tmp_path: Path) -> tuple[CheckpointManager, list[Path]]:
    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(
        tmp_path, CheckpointConfig(every=1, keep=3, async_save=False), Grid.single(), pmodel,
        optimizer)
    for step in (1, 2):
        worker.train_step(pmodel, optimizer, step)
        manager.save(step, {"step": step})
    return manager, list_checkpoints(tmp_path)


def _recorded(checkpoint: Path, name: str) -> dict:
    """What the checkpoint's manifest recorded of one of its files (sha256, bytes)."""
    return json.loads((checkpoint / "manifest.json").read_text())["files"][name]


def test_truncated_newest_checkpoint_falls_back_with_warning(tmp_path: Path) -> None:
    manager, (newest, previous) = _save_two(tmp_path)
    data_file = sorted(newest.glob("*.distcp"))[0]
    data_file.write_bytes(data_file.read_bytes()[:-100])
    # the damage is real: a file the manifest lists, now shorter than it recorded
    assert data_file.stat().st_size == _recorded(newest, data_file.name)["bytes"] - 100
    fresh = CheckpointManager(tmp_path, CheckpointConfig(), Grid.single())
    with pytest.warns(UserWarning, match=f"{newest}.*truncated"):
        assert fresh.latest_valid() == previous
    pmodel, optimizer = worker.build(Grid.single(), seed=8)
    assert CheckpointManager.for_model(tmp_path, CheckpointConfig(), Grid.single(), pmodel,
                                       optimizer).load(previous) == {"step": 1}


def test_verify_shares_split_the_hashing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    files = {}
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (path / name).write_bytes(name.encode() * 100)
        files[name] = {"sha256": sha256_file(path / name), "bytes": (path / name).stat().st_size}
    (path / "manifest.json").write_text(json.dumps({"files": files}))
    assert all(verify_checkpoint(path, (i, 2)) is None for i in range(2))
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[7] ^= 1  # same size: only its hash can tell
    (path / "__0_0.distcp").write_bytes(bytes(data))
    # sorted: .metadata, __0_0, __1_0 -> share (1, 2) hashes __0_0 alone
    assert verify_checkpoint(path, (0, 2)) is None
    assert "__0_0.distcp fails its sha256" in (verify_checkpoint(path, (1, 2)) or "")
    assert "__0_0.distcp fails its sha256" in (verify_checkpoint(path) or "")


def test_corrupted_checkpoint_fails_its_checksum(tmp_path: Path) -> None:
    manager, (newest, previous) = _save_two(tmp_path)
    data_file = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one flipped byte
    data_file.write_bytes(bytes(raw))
    # the damage is real: a file the manifest lists, its size as recorded, its hash not
    recorded = _recorded(newest, data_file.name)
    assert data_file.stat().st_size == recorded["bytes"]
    assert sha256_file(data_file) != recorded["sha256"]
    assert f"{data_file.name} fails its sha256" in (verify_checkpoint(newest) or "")
    fresh = CheckpointManager(tmp_path, CheckpointConfig(), Grid.single())
    with pytest.warns(UserWarning, match=str(newest)):
        assert fresh.latest_valid() == previous


FAILED_WRITE = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import checkpoint_worker as worker
    from fourfold.config import CheckpointConfig
    from fourfold.parallel import Grid
    from fourfold.train.checkpoint import CheckpointError, CheckpointManager

    runs = [(Path({root!r}) / mode, mode == "async") for mode in ("sync", "async")]
    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    managers = [CheckpointManager.for_model(run, CheckpointConfig(keep=1, async_save=is_async),
                                            Grid.single(), pmodel, optimizer)
                for run, is_async in runs]
    worker.train_step(pmodel, optimizer, 1)
    for manager in managers:
        manager.save(1, {{"step": 1}})
        manager.wait()
    # a full disk: files may not grow past 4 KiB from now on (applies to root too)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    worker.train_step(pmodel, optimizer, 2)
    for manager in managers:
        try:
            manager.save(2, {{"step": 2}})
            manager.wait()
        except CheckpointError as e:
            print("ERROR:" + str(e))
""")


@pytest.mark.slow
def test_failed_write_keeps_earlier_checkpoints(tmp_path: Path) -> None:
    script = FAILED_WRITE.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2, proc.stdout + proc.stderr[-2000:]  # synchronous and asynchronous
    for mode, error in zip(("sync", "async"), errors):
        run = tmp_path / mode
        assert f"{run}/checkpoints/step_00000002" in error, error
        assert "earlier checkpoints are intact" in error and "File too large" in error, error
        # keep = 1, yet step 1 survives: nothing old is deleted before a newer one is complete
        assert [p.name for p in list_checkpoints(run)] == ["step_00000001"]
        assert verify_checkpoint(list_checkpoints(run)[0]) is None
        assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_unwritable_checkpoint_directory_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("not a directory")
    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(async_save=False),
                                          Grid.single(), pmodel, optimizer)
    with pytest.raises(CheckpointError) as info:
        manager.save(1, {"step": 1})
    assert "\n" not in str(info.value) and "step_00000001" in str(info.value)


def test_load_rejects_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    from fourfold.config import model_config

    _save_two(tmp_path)
    wrong = parallelize(build_model(model_config("debug", bias=True, vocab_size=640), seed=1),
                        Grid.single())
    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(), Grid.single(), wrong)
    with pytest.raises(CheckpointError, match="cannot load checkpoint") as info:
        manager.load(manager.latest_valid())
    assert "\n" not in str(info.value)


def test_async_auto_writes_synchronously_on_a_cpu_rank_only(tmp_path: Path) -> None:
    """checkpoint.async = "auto" (the default): a CPU rank's snapshot would be a second copy
    of its weights and AdamW states in the memory it trains in, so it writes synchronously; a
    GPU rank writes in the background; true / false are taken as given."""
    from fourfold.config import ConfigError, load_config

    default = load_config(None).checkpoint
    assert default.async_save == "auto"
    assert (default.is_async(on_host=True), default.is_async(on_host=False)) == (False, True)
    for value, expected in (("true", True), ("false", False)):
        cfg = load_config(None, [f"checkpoint.async={value}"]).checkpoint
        assert cfg.is_async(on_host=True) is expected and cfg.is_async(on_host=False) is expected
    with pytest.raises(ConfigError, match=r"checkpoint.async = 'sometimes': expected true"):
        load_config(None, ["checkpoint.async=sometimes"])

    pmodel, optimizer = worker.build(Grid.single(), seed=7)
    manager = CheckpointManager.for_model(tmp_path, CheckpointConfig(every=1), Grid.single(),
                                          pmodel, optimizer)
    worker.train_step(pmodel, optimizer, 1)
    manager.save(1, {"step": 1})
    # complete when save returns: no writer thread, the checkpoint already listed
    assert manager._thread is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
