"""The memorization audit on a process grid reports exactly what it reports on one process.

The run is written by hand: a small random model whose output layer can only pick letters, and
documents made of the model's own greedy continuations (memorized) or of continuations with one
letter changed (not memorized), so the report holds both outcomes and a wrong parallel argmax
(a lost vocabulary offset, a tie broken the other way) would change it. The letters span both
halves of the vocabulary, so with y = 2 each rank's shard holds some of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fourfold.config import load_config
from fourfold.eval.memorization import greedy_decode, memorization_main
from fourfold.models.llama import build_model
from fourfold.train.runs import save_weights

from conftest import outside_job_env

PREFIX, SUFFIX, N_DOCS = 8, 12, 6
VOCAB = 192  # y = 2 splits it at 96: upper-case letters (65..90) left, lower-case (97..122) right
LETTERS = list(range(65, 91)) + list(range(97, 123))


@pytest.fixture(scope="module")
def run_and_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from fourfold.data.prepare import prepare

    root = tmp_path_factory.mktemp("memorization_grid")
    run = root / "run"
    cfg = load_config(None, ["model.preset=debug", f"model.vocab_size={VOCAB}",
                             "model.max_seq_len=64", "train.seq_len=32",
                             "train.device=cpu"])
    run.mkdir()
    cfg.save(run / "config.toml")
    model = build_model(cfg.model, seed=3).eval()
    with torch.no_grad():
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[LETTERS] = True
        model.output.weight[~keep] = 0.0  # logit 0: below the best letter's, in practice always
        model.output.weight[keep] *= 40.0  # wide gaps between letters: no near-ties to flip
    save_weights(model.state_dict(), run / "model.safetensors", cfg.model.tie_embeddings)

    rng = np.random.default_rng(0)
    texts = root / "texts"
    texts.mkdir()
    prompts = torch.tensor(rng.choice(LETTERS, size=(N_DOCS, PREFIX)))
    continuations = greedy_decode(lambda t, cache=None: model(t), prompts, SUFFIX)
    assert set(continuations.flatten().tolist()) <= set(LETTERS)
    for i, (prompt, cont) in enumerate(zip(prompts.tolist(), continuations.tolist())):
        if i % 2:  # not memorized: one letter, later in each document, changes case
            cont[i] = cont[i] ^ 0x20
        (texts / f"doc{i}.txt").write_text(bytes(prompt + cont).decode("ascii") + "tail")
    data = root / "data"
    prepare([texts], data, "byte", val_fraction=0.0, progress=False)
    return run, data


def _audit_on_ranks(run: Path, data: Path, nproc: int, grid: list[str]) -> dict:
    env = outside_job_env(PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "fourfold", "eval", "memorization", str(run), "--data", str(data),
         "--docs", str(N_DOCS), "--prefix", str(PREFIX), "--suffix", str(SUFFIX), "--json",
         "--nproc", str(nproc), *grid],
        capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{"):])  # one report: only rank 0 prints


@pytest.mark.ranks
def test_grid_audit_equals_one_process(run_and_data: tuple[Path, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    run, data = run_and_data
    assert memorization_main(str(run), str(data), N_DOCS, PREFIX, SUFFIX, as_json=True) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["documents_audited"] == N_DOCS
    # The documents were built to be half memorized: the audit must see both kinds.
    assert [row["exact_match"] for row in single["rows"]] == [i % 2 == 0 for i in range(N_DOCS)]
    assert [row["matched_prefix"] for row in single["rows"]] == [
        SUFFIX if i % 2 == 0 else i for i in range(N_DOCS)]

    assert _audit_on_ranks(run, data, 2, ["--y", "2"]) == single
    # x = 2 and two data replicas, each decoding half of the documents
    assert _audit_on_ranks(run, data, 4, ["--x", "2"]) == single


@pytest.mark.ranks
def test_grid_that_does_not_fit_is_one_error(run_and_data: tuple[Path, Path]) -> None:
    run, data = run_and_data
    done = subprocess.run(
        [sys.executable, "-m", "fourfold", "eval", "memorization", str(run), "--data", str(data),
         "--nproc", "2", "--y", "3"], capture_output=True, text=True, timeout=60,
        check=False)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error:") and "3" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


class _Gathered:
    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class _FakeComm:
    """all_gather over y answers with `gathered` (all ranks' pieces) and keeps this rank's."""

    def __init__(self, gathered: torch.Tensor | None) -> None:
        self.gathered, self.sent = gathered, None

    def all_gather(self, t: torch.Tensor, axis: str) -> _Gathered:
        assert axis == "y"
        self.sent = t
        return _Gathered(t if self.gathered is None else self.gathered)


def _fake_rank(vocab_start: int, comm: _FakeComm):
    from types import SimpleNamespace

    return SimpleNamespace(criterion=SimpleNamespace(vocab_start=vocab_start), comm=comm,
                           grid=SimpleNamespace(size=lambda axis: 4 if axis == "y" else 1))


def test_parallel_argmax_is_torch_argmax_with_ties_across_shards() -> None:
    from fourfold.eval.memorization import vocab_parallel_greedy_next

    shards, width = 4, 5
    logits = torch.randint(0, 4, (64, 3, shards * width)).float()  # many ties, within and across
    logits[0, -1] = 7.0  # all tied: the lowest index wins
    pieces = []
    for r in range(shards):  # what each y-rank sends
        comm = _FakeComm(None)
        vocab_parallel_greedy_next(_fake_rank(r * width, comm))(
            logits[..., r * width:(r + 1) * width])
        pieces.append(comm.sent)
    gathered = torch.cat(pieces)
    expected = logits[:, -1].argmax(-1)
    for r in range(shards):  # every rank picks the same, torch.argmax's choice
        pick = vocab_parallel_greedy_next(_fake_rank(r * width, _FakeComm(gathered)))
        assert torch.equal(pick(logits[..., r * width:(r + 1) * width]), expected)
