"""What the memorization safeguards claim, on a planted text: a model trained on it with the
standard loss reproduces it, and `fourfold eval memorization` says so; the goldfish loss drops
about 1 in k of the tokens it trains on, and the same training with it reproduces the text
less.

The planted text is two documents of random letters, which nothing but memorization can
continue; the unseen control is two more, drawn the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fourfold.cli import main
from fourfold.config import load_config
from fourfold.train import Trainer
from fourfold.train.metrics import read_metrics

from test_goldfish import goldfish_kept_band

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fourfold_cache")]

LETTERS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
DOCS, DOC_LEN, PREFIX, SUFFIX = 2, 100, 16, 32
SEQ_LEN, BATCH, STEPS, K, H = 64, 4, 60, 4, 13
# a one-layer debug model learns the planted letters by heart in 60 steps at this rate
RUN = ["model.preset=debug", "model.n_layers=1", "model.vocab_size=320",
       f"train.steps={STEPS}", f"train.batch_size={BATCH}", f"train.seq_len={SEQ_LEN}",
       "train.lr=1e-2", "train.warmup_steps=10", "train.eval_every=0", "train.eval_batches=0",
       "train.sample_tokens=0", "train.log_every=1", "train.device=cpu"]


def _write_docs(folder: Path, rng: np.random.Generator, names: list[str]) -> None:
    folder.mkdir()
    for name in names:
        (folder / f"{name}.txt").write_bytes(bytes(rng.choice(np.frombuffer(LETTERS, np.uint8),
                                                              DOC_LEN)))


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The planted data (its training split the planted documents, one more for validation),
    the unseen control, and a run with each loss."""
    from fourfold.data.prepare import prepare

    root = tmp_path_factory.mktemp("planted")
    rng = np.random.default_rng(0)
    # a tiny val_fraction hashes every document to train; prepare then moves the last
    # (zz_validation) to the validation split, which a run needs
    _write_docs(root / "planted_texts", rng, [f"planted{i}" for i in range(DOCS)] +
                ["zz_validation"])
    _write_docs(root / "unseen_texts", rng, [f"unseen{i}" for i in range(DOCS)] +
                ["zz_validation"])
    paths = {"planted": root / "planted", "unseen": root / "unseen"}
    for name, out in paths.items():
        prepare([root / f"{name}_texts"], out, "byte", val_fraction=0.001, progress=False)
    for loss in ("cross_entropy", "goldfish"):
        run = root / loss
        cfg = load_config(None, [*RUN, f"data.path={paths['planted']}", f"train.loss={loss}",
                                 f"train.goldfish_k={K}", f"train.goldfish_h={H}"])
        Trainer(cfg, run, progress=False).fit()
        paths[loss] = run
    return paths


def _audit(capsys: pytest.CaptureFixture[str], run: Path, data: Path) -> dict:
    capsys.readouterr()
    assert main(["eval", "memorization", str(run), "--data", str(data), "--docs", str(DOCS),
                 "--prefix", str(PREFIX), "--suffix", str(SUFFIX), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents_audited"] == DOCS
    return report


def test_the_audit_finds_the_planted_text_memorized(planted: dict[str, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from fourfold.data import documents

    planted_docs = documents(planted["planted"], "train", DOCS + 1)
    assert [bytes(d.astype(np.uint8)).decode()[:6] for d in planted_docs] == [
        (planted["planted"].parent / "planted_texts" / f"planted{i}.txt").read_text()[:6]
        for i in range(DOCS)]  # the training split is the planted documents, nothing else
    report = _audit(capsys, planted["cross_entropy"], planted["planted"])
    assert report["exact_match_rate"] == 1.0, report
    assert report["token_match_rate"] == 1.0 and report["rouge_l"] == 1.0, report
    # the same model on text it never saw: no continuation right, few letters by chance
    unseen = _audit(capsys, planted["cross_entropy"], planted["unseen"])
    assert unseen["exact_match_rate"] == 0.0, unseen
    assert unseen["token_match_rate"] < 0.2, unseen


def test_goldfish_drops_about_one_in_k(planted: dict[str, Path]) -> None:
    fractions = [r["loss_token_fraction"]
                 for r in read_metrics(planted["goldfish"] / "metrics.jsonl") if "loss" in r]
    assert len(fractions) == STEPS
    # the steps' windows overlap: their verdicts are those of the planted tokens, one each
    expected, tolerance = goldfish_kept_band(K, H, SEQ_LEN, verdicts=DOCS * (DOC_LEN + 1))
    mean = sum(fractions) / len(fractions)
    assert abs(mean - expected) <= tolerance, (mean, expected, tolerance)


def test_goldfish_reproduces_the_planted_text_less(planted: dict[str, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    standard = _audit(capsys, planted["cross_entropy"], planted["planted"])
    goldfish = _audit(capsys, planted["goldfish"], planted["planted"])
    for metric in ("exact_match_rate", "token_match_rate", "rouge_l"):
        assert goldfish[metric] < standard[metric], (metric, goldfish, standard)
    # the tokens it never trained on keep it from a whole continuation
    assert goldfish["exact_match_rate"] == 0.0, goldfish
