"""Each training method's checkpoint resumed on other grids: one process -> x = 2, z = 2 -> y = 2
and z = 2 -> one process. The state loads bit for bit as the loading rank's block of the saved
full state (AdaLomo's row/column means and vector moments, BlockLLM's AdamW moments and
selection, GaLore's projections and low-rank moments; LOMO, MeZO and ES keep a step count at
most), and the run goes on as the uninterrupted one-process run does (float32). A state without
a layout stays per rank: it loads on its own grid and is refused, in one line, on another.

One torchrun job (reshard_worker.py) does every grid case; the one-process runs happen here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import outside_job_env
from reshard_worker import (METHODS, SAVE_AT, STEPS, config, copy_run, resume, train_on)

WORKER = Path(__file__).with_name("reshard_worker.py")
SHARDED = ("adalomo", "blockllm", "galore")  # per-parameter tensors with a global layout
SCALAR = ("lomo", "mezo", "es")  # a step count at most: nothing to reshard
LR = 3e-3  # train.lr of the Adam-style methods (the default)

pytestmark = pytest.mark.usefixtures("fourfold_cache")  # tests/conftest.py


def one_process_reference(method: str, root: Path) -> dict:
    """The uninterrupted one-process run, with a checkpoint after SAVE_AT and the method's full
    state then (written for the worker)."""
    from safetensors.torch import save_file

    from fourfold.train import Trainer

    trainer = Trainer(config(method), root / method, progress=False)
    losses = train_on(trainer, SAVE_AT)
    trainer.save_checkpoint()
    trainer.checkpoints.close()
    tensors, meta = trainer.method.state_dict()
    # every tensor of the state has a layout whose global shape is this process's tensor
    layouts = {k: trainer.method.state_layout(k) for k in tensors}
    unplaced = [k for k, t in tensors.items() if t.dim() and (
        layouts[k] is None or layouts[k].full_shape(tuple(t.shape), trainer.grid.shape)
        != tuple(t.shape))]
    save_file({k: t.detach().clone().contiguous() for k, t in tensors.items()},
              str(root / f"{method}.state.safetensors"))
    losses += train_on(trainer, STEPS)
    weights = root / f"{method}.weights.safetensors"
    save_file({k: v.contiguous() for k, v in trainer.pmodel.full_state_dict().items()},
              str(weights))
    ref = {"losses": losses, "meta": meta, "weights": str(weights), "unplaced": unplaced,
           "state_keys": len(tensors)}
    (root / f"{method}.json").write_text(json.dumps(ref))
    trainer.checkpoints.close()
    return ref


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fourfold_cache: Path) -> dict:
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("reshard")
    (root / "one").mkdir()
    (root / "grid").mkdir()
    refs = {m: one_process_reference(m, root / "one") for m in METHODS}
    out = root / "results.json"
    env = outside_job_env(FOURFOLD_TEST_DIR=str(root), FOURFOLD_TEST_OUT=str(out),
                          FOURFOLD_CACHE=os.environ["FOURFOLD_CACHE"], OMP_NUM_THREADS="1",
                          PYTHONPATH=str(WORKER.parent))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(WORKER)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    grid = json.loads(out.read_text())
    # z = 2 -> one process, here
    for m in METHODS:
        full = load_file(str(root / "grid" / f"{m}_z2.state.safetensors"))
        grid[m]["one"] = resume(m, root / "grid" / f"{m}_z2", root / "one_from_z2" / m, "parallel.x=1",
                                full, refs[m])
    return {"refs": refs, "grid": grid, "root": root}


def close(losses: list[float], ref: list[float]) -> bool:
    return all(math.isclose(a, b, rel_tol=1e-5, abs_tol=0) for a, b in zip(losses, ref, strict=True))


def check_resumed(method: str, case: str, r: dict, ref: dict, saved_meta: dict) -> None:
    label = f"{method} {case}"
    assert r["step"] == SAVE_AT, label
    assert r["bad_state"] == [], f"{label}: state not bit for bit: {r['bad_state']}"
    assert r["meta"] == saved_meta, label
    assert close(r["losses"], ref["losses"][SAVE_AT:]), \
        f"{label}: {r['losses']} vs {ref['losses'][SAVE_AT:]}"
    # Adam's step divides tiny gradients by their own size, so a grid's float rounding shows
    # in the weights (test_lean_optim allows GaLore a fifth of lr); the others stay at 1e-5
    bound = 0.02 * LR if method in ("blockllm", "galore") else 1e-5
    assert r["max_weight_diff"] < bound, f"{label}: weights differ by {r['max_weight_diff']}"


@pytest.mark.ranks
@pytest.mark.parametrize("method", SHARDED)
def test_per_parameter_state_reshards_bit_for_bit(runs: dict, method: str) -> None:
    ref, grid = runs["refs"][method], runs["grid"][method]
    assert ref["state_keys"] > 0 and ref["unplaced"] == [], ref
    assert close(grid["z2"]["losses"], ref["losses"]), f"{method} z2: {grid['z2']['losses']}"
    # the z = 2 state, gathered by its layouts, is the one-process state (to rounding): the
    # layouts place each shard where it belongs. GaLore's singular vectors take arbitrary signs
    # and, for near-equal singular values, move with the gradient's rounding (read 7e-4)
    assert grid["z2"]["state_vs_one_process"], method
    worst = max(grid["z2"]["state_vs_one_process"].items(), key=lambda kv: kv[1])
    assert worst[1] < (1e-2 if method == "galore" else 1e-4), f"{method} z2: {worst}"
    check_resumed(method, "1 -> x=2", grid["x2"], ref, ref["meta"])
    check_resumed(method, "z=2 -> y=2", grid["y2"], ref, grid["z2"]["meta"])
    check_resumed(method, "z=2 -> 1", grid["one"], ref, grid["z2"]["meta"])
    if method == "blockllm":  # the JSON selection came along (step 4's loss is no better
        # than step 3's, so with block_patience = 1 step 5 selects anew, after the resume)
        assert ref["meta"]["selected"] and ref["meta"]["since_best"] == 0, ref["meta"]
        assert ref["losses"][SAVE_AT] > ref["losses"][SAVE_AT - 1], ref["losses"]


@pytest.mark.ranks
@pytest.mark.parametrize("method", SCALAR)
def test_scalar_state_resumes_on_any_grid(runs: dict, method: str) -> None:
    ref, grid = runs["refs"][method], runs["grid"][method]
    assert ref["state_keys"] == 0, ref
    if method != "lomo":  # the noise of a step is keyed by the step count
        assert ref["meta"]["steps_done"] == SAVE_AT, ref["meta"]
    check_resumed(method, "1 -> x=2", grid["x2"], ref, ref["meta"])
    check_resumed(method, "z=2 -> y=2", grid["y2"], ref, grid["z2"]["meta"])
    check_resumed(method, "z=2 -> 1", grid["one"], ref, grid["z2"]["meta"])


@pytest.mark.ranks
def test_state_without_a_layout_loads_on_its_grid_only(runs: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from fourfold.train import Trainer, TrainingError
    from fourfold.train.methods.galore import GaLore

    r = runs["grid"]["perrank"]
    assert r["same_grid_step"] == SAVE_AT and r["same_grid_bad"] == [], r
    refusal = r["refusal"]
    assert refusal is not None and "\n" not in refusal, r
    assert "train.optimizer = 'galore'" in refusal and "does not reshard" in refusal, refusal
    assert "resume on data=1 z=2 y=1 x=1" in refusal, refusal
    # and on one process
    monkeypatch.setattr(GaLore, "state_layout", lambda self, key: None)
    root = runs["root"]
    copy_run(root / "grid" / "perrank_z2", root / "perrank_one")
    with pytest.raises(TrainingError, match=r"train.optimizer = 'galore'.*does not reshard to "
                                            r"data=1 z=1 y=1 x=1; resume on data=1 z=2"):
        Trainer(config("galore"), root / "perrank_one", progress=False)
