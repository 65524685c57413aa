"""The memorization audit: metrics on hand-made models, ROUGE-L, greedy decoding with a cache."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from fourfold.config import Config, ModelConfig
from fourfold.eval.memorization import (
    MemorizationAuditError,
    audit_memorization,
    greedy_decode,
    greedy_next,
    lcs_length,
    memorization_main,
    rouge_l_f1,
)
from fourfold.models import KVCache, build_model

VOCAB = 50


def _one_hot_logits(next_ids: list[int], T: int) -> torch.Tensor:
    logits = torch.zeros(len(next_ids), T, VOCAB)
    logits[torch.arange(len(next_ids)), -1, torch.tensor(next_ids)] = 1.0
    return logits


class CopyingModel:
    """Knows the training documents by heart: the next token of whichever document the row
    started as, at the row's current length (so it keeps copying even after a mistake)."""

    def __init__(self, documents: list[list[int]], prefix: int, wrong_at_odd: bool = False):
        self.by_prompt = {tuple(d[:prefix]): d for d in documents}
        self.prefix = prefix
        self.wrong_at_odd = wrong_at_odd

    def __call__(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        assert cache is None
        T = tokens.shape[1]
        out = []
        for row in tokens.tolist():
            true_next = self.by_prompt[tuple(row[:self.prefix])][T]
            wrong = self.wrong_at_odd and (T - self.prefix) % 2 == 1
            out.append((true_next + 1) % VOCAB if wrong else true_next)
        return _one_hot_logits(out, T)


class ConstantModel:
    def __init__(self, token: int):
        self.token = token

    def __call__(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        return _one_hot_logits([self.token] * tokens.shape[0], tokens.shape[1])


def _documents(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(n)]


def test_copying_model_is_fully_memorized():
    docs = _documents(5, 30)
    report = audit_memorization(CopyingModel(docs, 10), docs, prefix=10, suffix=12, batch_size=2)
    assert report.documents_audited == 5
    assert (report.exact_match_rate, report.token_match_rate, report.rouge_l) == (1.0, 1.0, 1.0)
    assert [r.document for r in report.rows] == [0, 1, 2, 3, 4]
    assert all(r.matched_prefix == 12 for r in report.rows)


def test_constant_model_gets_the_counted_values():
    c = 7
    prompt = [1, 2, 3]
    docs = [prompt[:2] + [10] + [c, c, c, c],  # suffix all c: exact, token 1, ROUGE-L 1
            prompt[:2] + [11] + [c, 5, c, 5],  # half: token 0.5, LCS 2 of 4 -> ROUGE-L 0.5
            prompt[:2] + [12] + [5, 5, c, 5],  # LCS 1, one position right -> 0.25, 0.25
            prompt[:2] + [13] + [1, 2, 3, 4]]  # nothing in common
    report = audit_memorization(ConstantModel(c), docs, prefix=3, suffix=4)
    assert [r.exact_match for r in report.rows] == [True, False, False, False]
    assert [r.token_match for r in report.rows] == [1.0, 0.5, 0.25, 0.0]
    assert [r.rouge_l for r in report.rows] == [1.0, 0.5, 0.25, 0.0]
    assert [r.matched_prefix for r in report.rows] == [4, 1, 0, 0]
    assert report.exact_match_rate == 0.25
    assert report.token_match_rate == pytest.approx(1.75 / 4)
    assert report.rouge_l == pytest.approx(1.75 / 4)


def test_constant_model_on_random_documents_matches_the_formula():
    # Generated [c]*n against a reference: token matches = LCS = count of c; lengths are equal
    # so ROUGE-L F1 = count / n.
    docs = _documents(12, 40, seed=3)
    c = 4
    report = audit_memorization(ConstantModel(c), docs, prefix=8, suffix=20, batch_size=5)
    expected = [d[8:28].count(c) / 20 for d in docs]
    assert [r.token_match for r in report.rows] == pytest.approx(expected)
    assert [r.rouge_l for r in report.rows] == pytest.approx(expected)
    assert report.exact_match_rate == 0.0
    assert sum(expected) > 0


def test_half_right_model_gets_token_rate_one_half():
    docs = _documents(6, 40, seed=1)
    model = CopyingModel(docs, 10, wrong_at_odd=True)
    report = audit_memorization(model, docs, prefix=10, suffix=16)
    assert report.token_match_rate == 0.5
    assert report.exact_match_rate == 0.0
    assert all(r.matched_prefix == 1 for r in report.rows)
    # the right tokens are a common subsequence of length 8 at least
    assert all(r.rouge_l >= 0.5 for r in report.rows)


def test_short_documents_are_skipped_and_counted():
    docs = _documents(4, 30) + [[1, 2, 3]]
    docs.insert(1, list(range(10)))
    report = audit_memorization(CopyingModel(docs, 10), docs, prefix=10, suffix=10)
    assert report.documents_audited == 4 and report.documents_too_short == 2
    assert [r.document for r in report.rows] == [0, 2, 3, 4]
    with pytest.raises(MemorizationAuditError, match="prefix \\+ suffix = 40"):
        audit_memorization(CopyingModel(docs, 10), docs, prefix=10, suffix=30)


def test_numpy_documents_and_batch_size_do_not_change_results():
    docs = _documents(7, 30, seed=2)
    arrays = [np.array(d, dtype=np.uint16) for d in docs]
    model = CopyingModel(docs, 5, wrong_at_odd=True)
    a = audit_memorization(model, arrays, prefix=5, suffix=9, batch_size=1)
    b = audit_memorization(model, docs, prefix=5, suffix=9, batch_size=4)
    assert a == b


def test_bad_arguments_are_user_errors():
    docs = _documents(2, 30)
    with pytest.raises(MemorizationAuditError, match="prefix = 0"):
        audit_memorization(ConstantModel(1), docs, prefix=0, suffix=5)
    model = build_model(ModelConfig(n_layers=1, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                    vocab_size=VOCAB, max_seq_len=16), seed=0)
    with pytest.raises(MemorizationAuditError, match="max_seq_len 16"):
        audit_memorization(model, docs, prefix=10, suffix=10)


@pytest.mark.parametrize("a, b, expected", [
    ("ABCBDAB", "BDCABA", 4),
    ("", "ABC", 0),
    ("ABC", "ABC", 3),
    ("ABC", "DEF", 0),
    ("AXBXC", "ABC", 3),
    ("ABC", "CBA", 1),
])
def test_lcs_length(a, b, expected):
    assert lcs_length([ord(x) for x in a], [ord(x) for x in b]) == expected
    assert lcs_length([ord(x) for x in b], [ord(x) for x in a]) == expected


def test_rouge_l_f1():
    assert rouge_l_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert rouge_l_f1([4, 5], [1, 2, 3]) == 0.0
    # LCS 3: precision 3/3, recall 3/6 -> F1 2/3
    assert rouge_l_f1([1, 2, 3], [1, 2, 3, 4, 5, 6]) == pytest.approx(2 / 3)
    # a shifted copy keeps most of the credit
    assert rouge_l_f1([9, 1, 2, 3, 4], [1, 2, 3, 4, 5]) == pytest.approx(0.8)


def test_greedy_next_takes_the_last_position():
    logits = torch.zeros(2, 3, 5)
    logits[0, -1, 4] = 1.0
    logits[1, -1, 2] = 1.0
    logits[:, 0, 0] = 9.0  # earlier positions do not matter
    assert greedy_next(logits).tolist() == [4, 2]


@pytest.mark.slow
def test_llama_decoding_with_kv_cache_equals_full_recompute():
    cfg = ModelConfig(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      vocab_size=VOCAB, max_seq_len=64)
    model = build_model(cfg, seed=3).eval()
    prompts = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    cached = greedy_decode(model, prompts, 12, cache=KVCache.empty(cfg.n_layers))
    full = greedy_decode(model, prompts, 12, cache=None)
    assert cached.shape == (3, 12)
    assert torch.equal(cached, full)

    # the audit on a real Llama (default KV cache) agrees with a hand-rolled comparison
    docs = [torch.cat([p, g]).tolist() + [0] for p, g in zip(prompts, full)]
    docs[1][12] = (docs[1][12] + 1) % VOCAB  # one wrong continuation token in document 1
    model.train()
    report = audit_memorization(model, docs, prefix=9, suffix=12, batch_size=2)
    assert model.training  # the audit restores the mode
    assert [r.exact_match for r in report.rows] == [True, False, True]
    assert report.rows[1].matched_prefix == 3
    assert report.rows[1].token_match == pytest.approx(11 / 12)


def test_report_json_and_table():
    docs = _documents(3, 30)
    report = audit_memorization(ConstantModel(3), docs, prefix=10, suffix=10)
    data = json.loads(report.to_json())
    assert data["documents_audited"] == 3
    assert len(data["rows"]) == 3
    assert data["token_match_rate"] == report.token_match_rate
    table = report.format_table(max_rows=2)
    assert f"{report.rouge_l:.3f}" in table
    assert "1 more documents" in table


def test_memorization_main_wires_run_and_data(monkeypatch, capsys):
    cfg = Config()
    cfg.model = ModelConfig(n_layers=1, dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32,
                            vocab_size=VOCAB, max_seq_len=64)
    model = build_model(cfg.model, seed=0)
    docs = [np.array(d) for d in _documents(5, 40)]
    calls = {}

    def load_trained(run_dir):
        calls["run_dir"] = run_dir
        return model, cfg

    def resolve_data_path(path, tokenizer):
        calls["resolve"] = (path, tokenizer)
        return "/resolved"

    def documents(data_dir, split, n):
        calls["documents"] = (data_dir, split, n)
        return docs[:n]

    # The real modules are written elsewhere; the audit only relies on these signatures.
    monkeypatch.setitem(sys.modules, "fourfold.train.runs",
                        types.SimpleNamespace(load_trained=load_trained))
    monkeypatch.setitem(sys.modules, "fourfold.data",
                        types.SimpleNamespace(documents=documents,
                                              resolve_data_path=resolve_data_path))
    assert memorization_main("runs/x", "builtin:stdlib", 4, 8, 8, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["documents_audited"] == 4 and out["prefix"] == 8
    assert calls == {"run_dir": "runs/x", "resolve": ("builtin:stdlib", cfg.data.tokenizer),
                     "documents": ("/resolved", "train", 4)}
    assert memorization_main("runs/x", "builtin:stdlib", 2, 8, 8, as_json=False) == 0
    assert "memorization audit" in capsys.readouterr().out
