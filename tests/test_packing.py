"""Packed documents on one process: the packer, the loader's packed rows, attention that never
crosses a document (logits equal to each document's alone), the masked loss against
transformers' labels = -100, gradient accumulation weighted by trained tokens, and the
balancer on a heavy-tailed length mix."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fourfold.config import load_config, model_config
from fourfold.data import BatchLoader, DataError, prepare
from fourfold.data.balance import SequenceCost, balanced_order, imbalance
from fourfold.data.loader import Batch, TokenDataset, documents
from fourfold.data.packing import Pieces, RowStream, document_pieces, pack_rows
from fourfold.models import build_model
from fourfold.models.attention import PackedDocuments, attention_kernel
from fourfold.plan.perf import sequence_cost

SEQ = 64
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: more threads only wait


def heavy_tailed_chats(n: int, seed: int) -> list[dict]:
    """Chats whose answers have Pareto lengths: mostly a few words, now and then hundreds."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "x", "y", "über", "42"]
    records = []
    for i in range(n):
        answer_words = min(int(rng.paretovariate(1.2) * 2), 400)
        records.append({"messages": [
            {"role": "user", "content": f"q{i} " + " ".join(rng.choice(words)
                                                            for _ in range(rng.randint(1, 6)))},
            {"role": "assistant", "content": " ".join(rng.choice(words)
                                                      for _ in range(answer_words))}]})
    return records


def prepare_chats(root: Path, n: int, seed: int) -> Path:
    """A DATA_DIR of n heavy_tailed_chats (byte tokenizer, a tenth held out)."""
    with open(root / "chat.jsonl", "w") as f:
        for r in heavy_tailed_chats(n, seed):
            f.write(json.dumps(r) + "\n")
    prepare([root / "chat.jsonl"], root / "data", data_format="chat", val_fraction=0.1,
            progress=False)
    return root / "data"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return prepare_chats(tmp_path_factory.mktemp("chat"), 300, seed=5)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    rng = random.Random(3)
    for i in range(40):
        (root / f"doc{i:02d}.txt").write_text("".join(rng.choice("abcdef \n")
                                                      for _ in range(rng.randint(5, 300))))
    prepare([root], root / "data", val_fraction=0.1, progress=False)
    return root / "data"


# --------------------------------------------------------------------------------------------
# The packer


def test_pieces_cover_every_position_of_every_document_once():
    starts = np.array([0, 10, 11, 200, 203])  # a one-token document at 10
    pieces = document_pieces(starts, 500, seq_len=SEQ)
    assert (pieces.lengths <= SEQ).all() and (pieces.lengths > 0).all()
    covered = set()
    for s, n in zip(pieces.starts.tolist(), pieces.lengths.tolist()):
        covered.update(range(s, s + n))  # the input positions; targets are one further
    ends = [10, 11, 200, 203, 500]
    expected = {p for a, b in zip(starts.tolist(), ends) for p in range(a, b - 1)}
    assert covered == expected and int(pieces.lengths.sum()) == len(expected)
    assert 10 not in pieces.starts.tolist()  # the one-token document predicts nothing


def test_rows_hold_every_piece_once_and_fill_up():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, SEQ + 1, size=3000)
    rows = pack_rows(lengths, SEQ, np.random.default_rng(1))
    flat = np.concatenate(rows)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(lengths[r].sum() <= SEQ for r in rows)
    assert lengths.sum() / (len(rows) * SEQ) > 0.95  # best-fit decreasing leaves little room
    assert [r.tolist() for r in rows] == [r.tolist() for r in
                                          pack_rows(lengths, SEQ, np.random.default_rng(1))]


def test_the_row_stream_runs_through_epochs_deterministically():
    pieces = Pieces(np.arange(50) * 100, np.full(50, 20))
    a, b = RowStream(pieces, SEQ, seed=3), RowStream(pieces, SEQ, seed=3)
    first = [r.tolist() for r in a.rows(0, 40)]  # 17 rows an epoch: past the second
    assert [r.tolist() for r in b.rows(30, 10)] == first[30:]
    assert sorted(np.concatenate(a.rows(0, 17)).tolist()) == list(range(50))
    assert first[:17] != first[17:34]  # each epoch shuffled anew
    assert [r.tolist() for r in RowStream(pieces, SEQ, seed=4).rows(0, 17)] != first[:17]


# --------------------------------------------------------------------------------------------
# Packed batches


def test_packed_rows_are_whole_documents_with_their_trained_tokens(chat_dir):
    loader = BatchLoader(chat_dir, "train", batch_size=8, seq_len=SEQ, seed=1)
    assert loader.packing == "documents"
    dataset = TokenDataset(chat_dir, "train")
    mask = np.concatenate([np.fromfile(chat_dir / f.file, dtype=np.uint8)
                           for f in dataset.manifest.split("train").trained]).astype(bool)
    tokens = dataset.window(0, len(dataset))
    bounds = list(dataset.document_starts) + [len(dataset)]
    for _ in range(3):
        batch = loader.next_batch()
        assert batch.documents is not None and batch.trained is not None
        with pytest.raises(TypeError, match="would drop"):
            inputs, targets = batch
        for row in range(batch.rows):
            ids = batch.documents[row]
            for d in ids.unique().tolist():
                where = (ids == d).nonzero().flatten()
                assert where.tolist() == list(range(int(where[0]), int(where[-1]) + 1))
                x, y = batch.inputs[row, where].numpy(), batch.targets[row, where].numpy()
                flags = batch.trained[row, where].numpy()
                if d == ids.max().item() and not flags.any() and (x == 256).all():
                    continue  # the padding: untrained
                # somewhere in one document of the split: these tokens, then the targets,
                # trained as the mask says
                window = np.append(x, y[-1])
                assert any(np.array_equal(mask[s + 1:s + 1 + len(x)], flags)
                           and s + len(x) < bounds[int(np.searchsorted(bounds, s, "right"))]
                           for s in _occurrences(tokens, window)), (row, d)


def _occurrences(tokens: np.ndarray, piece: np.ndarray) -> list[int]:
    hits = np.flatnonzero(tokens[:len(tokens) - len(piece) + 1] == piece[0])
    return [int(h) for h in hits if np.array_equal(tokens[h:h + len(piece)], piece)]


def test_shards_split_the_same_global_batch_balanced_or_not(chat_dir):
    def rows(batch: Batch) -> list[tuple]:
        return [tuple(batch.inputs[r].tolist() + batch.documents[r].tolist())
                for r in range(batch.rows)]

    cost = SequenceCost(token=1.0, square=0.05)
    for balance in (True, False):
        whole = BatchLoader(chat_dir, "train", 16, SEQ, seed=2, micro_batches=2, cost=cost,
                            balance=balance)
        shards = [BatchLoader(chat_dir, "train", 16, SEQ, seed=2, shard_index=i, num_shards=4,
                              micro_batches=2, cost=cost, balance=balance) for i in range(4)]
        for _ in range(3):
            everything = rows(whole.next_batch())
            parts = [rows(s.next_batch()) for s in shards]
            assert sorted(sum(parts, [])) == sorted(everything)
            if not balance:  # dealt in order: shard i holds rows [4i, 4i + 4)
                assert sum(parts, []) == everything


def test_a_resumed_packed_loader_continues_with_the_same_batches(chat_dir):
    reference = BatchLoader(chat_dir, "train", 4, SEQ, seed=3)
    expected = [reference.next_batch() for _ in range(5)]
    first = BatchLoader(chat_dir, "train", 4, SEQ, seed=3)
    for _ in range(2):
        first.next_batch()
    resumed = BatchLoader(chat_dir, "train", 4, SEQ, seed=99)
    resumed.load_state_dict(first.state_dict())
    for want in expected[2:]:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.trained, want.trained)


def test_raw_text_packs_by_its_document_index_or_by_eos(text_dir, tmp_path):
    loader = BatchLoader(text_dir, "train", 4, SEQ, seed=0, packing="documents")
    batch = loader.next_batch()
    for row in range(batch.rows):  # every text token trained; the padding, at the end, not
        untrained = (~batch.trained[row]).nonzero().flatten().tolist()
        assert untrained == list(range(SEQ - len(untrained), SEQ))
        if untrained:
            assert (batch.documents[row, untrained] == batch.documents[row].max()).all()
    # a directory prepared before the index existed (format 1) finds documents after each EOS
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((text_dir / "manifest.json").read_text())
    for name, split in manifest["splits"].items():
        for f in split["shards"]:
            (old / f["file"]).write_bytes((text_dir / f["file"]).read_bytes())
        split.pop("document_index")
        split.pop("trained")
    manifest["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(manifest))
    for extra in ("fourfold_tokenizer.json",):
        (old / extra).write_bytes((text_dir / extra).read_bytes())
    assert np.array_equal(TokenDataset(old, "train").document_boundaries(),
                          TokenDataset(text_dir, "train").document_starts)
    assert [d.tolist() for d in documents(old, "train", 50)] == \
        [d.tolist() for d in documents(text_dir, "train", 50)]
    again = BatchLoader(old, "train", 4, SEQ, seed=0, packing="documents").next_batch()
    assert torch.equal(again.inputs, batch.inputs) and torch.equal(again.documents,
                                                                   batch.documents)


def test_windows_of_chat_data_carry_its_trained_mask(chat_dir):
    loader = BatchLoader(chat_dir, "train", 4, SEQ, seed=0, packing="none")
    batch = loader.next_batch()
    assert batch.documents is None and batch.trained is not None
    assert 0 < batch.trained.float().mean() < 1
    with pytest.raises(DataError, match="data.packing = 'packed'"):
        BatchLoader(chat_dir, "train", 4, SEQ, seed=0, packing="packed")


# --------------------------------------------------------------------------------------------
# Attention inside documents


def _packed_row(lengths: list[list[int]], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths[0])
    tokens = torch.randint(0, vocab, (len(lengths), T), generator=g)
    docs = torch.zeros(len(lengths), T, dtype=torch.int32)
    for r, row in enumerate(lengths):
        assert sum(row) == T
        docs[r] = torch.repeat_interleave(torch.arange(len(row), dtype=torch.int32),
                                          torch.tensor(row))
    return tokens, docs


ROWS = [[30, 50, 20, 28], [128], [1, 7, 60, 60], [3, 5, 9, 4, 6, 2, 99]]  # short runs group


@pytest.mark.parametrize("variant", ["plain", "checkpointing", "tied+bias"])
def test_a_documents_logits_inside_a_packed_row_are_its_logits_alone(variant):
    cfg = model_config("debug", max_seq_len=128, bias=variant == "tied+bias",
                       tie_embeddings=variant == "tied+bias")
    model = build_model(cfg, seed=7)
    model.activation_checkpointing = variant == "checkpointing"
    tokens, docs = _packed_row(ROWS, cfg.vocab_size, seed=1)
    assert attention_kernel(torch.zeros(1)) == "split"
    with torch.no_grad():
        packed = model(tokens, documents=docs)
        worst = 0.0
        for r, row in enumerate(ROWS):
            at = 0
            for length in row:
                alone = model(tokens[r:r + 1, at:at + length])[0]
                worst = max(worst, float((alone - packed[r, at:at + length]).abs().max()))
                at += length
    assert worst < 1e-5
    # without the boundaries the same tokens attend across documents: not the same logits
    with torch.no_grad():
        assert float((model(tokens) - packed).abs().max()) > 1e-2


def test_a_packed_rows_gradients_are_the_sum_of_its_documents():
    cfg = model_config("debug", max_seq_len=128)
    tokens, docs = _packed_row(ROWS[:2], cfg.vocab_size, seed=2)
    targets = torch.randint(0, cfg.vocab_size, tokens.shape, generator=torch.Generator()
                            .manual_seed(3))
    packed_model, alone_model = build_model(cfg, seed=1), build_model(cfg, seed=1)
    packed_model.activation_checkpointing = True
    packed_model(tokens, targets, documents=docs).sum().backward()
    for r, row in enumerate(ROWS[:2]):
        at = 0
        for length in row:
            alone_model(tokens[r:r + 1, at:at + length],
                        targets[r:r + 1, at:at + length]).sum().backward()
            at += length
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=2e-5, msg=name)


def test_positions_restart_in_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    packed = PackedDocuments.from_ids(docs, torch.device("cpu"))
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert packed.lengths == [3, 2, 1, 1, 5] and not packed.one_per_row
    assert PackedDocuments.from_ids(torch.zeros(2, 6, dtype=torch.int32),
                                    torch.device("cpu")).one_per_row


# --------------------------------------------------------------------------------------------
# The loss of what is trained


def _hf_twin(model):  # noqa: ANN001, ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    from fourfold.models.hf import config_to_hf, state_dict_to_hf

    hf = LlamaForCausalLM(LlamaConfig(**config_to_hf(model.cfg)))
    hf.load_state_dict(state_dict_to_hf(model.state_dict(), model.cfg), strict=False)
    return hf.eval()


@pytest.mark.slow  # imports transformers
def test_the_masked_loss_equals_transformers_with_labels_minus_100(chat_dir):
    cfg = model_config("debug", vocab_size=257, max_seq_len=SEQ)
    model = build_model(cfg, seed=11).eval()
    hf = _hf_twin(model)
    batch = BatchLoader(chat_dir, "train", 6, SEQ, seed=4).next_batch()
    weights = batch.loss_weights()
    with torch.no_grad():
        per_token = model(batch.inputs, batch.targets, documents=batch.documents)
    ours = float((per_token * weights).sum() / weights.sum())
    # transformers, document by document (padded, labels -100 on what is not trained)
    sequences, labels = [], []
    for r in range(batch.rows):
        ids = batch.documents[r]
        for d in ids.unique().tolist():
            where = (ids == d).nonzero().flatten()
            if not batch.trained[r, where].any():
                continue
            full = torch.cat([batch.inputs[r, where[:1]], batch.targets[r, where]])
            label = full.clone()
            label[0] = -100
            label[1:][~batch.trained[r, where]] = -100
            sequences.append(full)
            labels.append(label)
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    label_ids = torch.full((len(sequences), width), -100)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, (s, label) in enumerate(zip(sequences, labels)):
        input_ids[i, :len(s)], label_ids[i, :len(s)], attention[i, :len(s)] = s, label, 1
    with torch.no_grad():
        theirs = float(hf(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss)
    assert abs(ours - theirs) < 1e-6, (ours, theirs)
    # every token counted instead: not the same loss
    assert abs(float(per_token.mean()) - theirs) > 1e-3


def _trainer(chat_dir: Path, run_dir: Path, *overrides: str):  # noqa: ANN202
    from fourfold.train import Trainer

    cfg = load_config(None, ["model.preset=debug", "model.vocab_size=257",
                             f"data.path={chat_dir}", "train.batch_size=8",
                             f"train.seq_len={SEQ}", "train.steps=2", "train.warmup_steps=0",
                             "train.grad_clip=0", "train.eval_every=0", "train.eval_batches=0",
                             "train.sample_tokens=0", "train.log_every=1",
                             "checkpoint.resume=false", *overrides])
    return Trainer(cfg, run_dir, progress=False)


@pytest.mark.slow
@pytest.mark.usefixtures("fourfold_cache")
def test_gradient_accumulation_weights_micro_batches_by_their_trained_tokens(chat_dir,
                                                                          tmp_path):
    results = {}
    for accum in (1, 2, 4):
        trainer = _trainer(chat_dir, tmp_path / f"a{accum}", f"train.grad_accum={accum}")
        grads: dict[str, torch.Tensor] = {}
        optimizer = trainer.method.optimizer  # AdamW's: the gradients as its step sees them
        optimizer_step = optimizer.step

        def capture(*args, _grads=grads, _step=optimizer_step, _trainer=trainer, **kwargs):
            _grads.update({n: p.grad.clone() for n, p in _trainer.pmodel.named_parameters()})
            return _step(*args, **kwargs)

        optimizer.step = capture
        stats = trainer.train_step()
        batch = trainer.loader.state_dict()
        results[accum] = (stats.loss, grads, batch)
    loss1, grads1, _ = results[1]
    for accum in (2, 4):
        loss, grads, _ = results[accum]
        assert abs(loss - loss1) < 1e-6 * max(1.0, abs(loss1))
        for name, g in grads.items():
            torch.testing.assert_close(g, grads1[name], rtol=1e-5, atol=1e-6, msg=name)
    # the micro-batches of that step hold different numbers of trained tokens: the mean of
    # their own means would be another loss
    trainer = _trainer(chat_dir, tmp_path / "check", "train.grad_accum=4")
    micro = trainer.loader.next_batch().split(4)
    counts = [float(m.loss_weights().sum()) for m in micro]
    assert max(counts) > 1.3 * min(counts), counts
    with torch.no_grad():
        means = [float((trainer.pmodel(m.inputs, m.targets, documents=m.documents)
                        * m.loss_weights()).sum()) / c for m, c in zip(micro, counts)]
    assert abs(sum(means) / 4 - loss1) > 1e-3


# --------------------------------------------------------------------------------------------
# Balance


LONG_SEQ = 4096


def heavy_tailed_texts(n: int, seed: int) -> list[str]:
    """Texts of Pareto(1) lengths from 40 bytes up to LONG_SEQ: most short, a few filling a
    row alone (a quarter of the tokens are in texts of over half a row)."""
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh ") for _ in range(min(int(rng.paretovariate(1.0) * 40),
                                                              LONG_SEQ)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def long_tail_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("long_tail")
    with open(root / "texts.jsonl", "w") as f:
        for text in heavy_tailed_texts(3000, seed=0):
            f.write(json.dumps({"text": text}) + "\n")
    prepare([root / "texts.jsonl"], root / "data", val_fraction=0.01, progress=False)
    return root / "data"


def long_context_cost() -> SequenceCost:
    """The planner's cost of a row of LONG_SEQ positions for a narrow model, whose attention
    outweighs its GEMMs on a whole row (4.6x): where documents' lengths matter most."""
    cfg = model_config("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=257,
                       max_seq_len=LONG_SEQ)
    return sequence_cost(cfg, LONG_SEQ)


def test_balancing_a_heavy_tailed_mix_brings_the_slowest_shard_within_5_percent(long_tail_dir):
    """Global batches of 32 packed rows of 4096 positions over 4 data shards x 2
    micro-batches: dealt in order, the dearest shard does 30% or more above the mean on some
    of them; balanced, at most 5% on every one, with the same rows. Micro-batches, which run
    one after the other on their shard, come second: within 10%, and never less even than in
    order."""
    loader = BatchLoader(long_tail_dir, "train", 32, LONG_SEQ, seed=0, num_shards=4,
                         micro_batches=2, cost=long_context_cost(), packing="documents")
    plain_worst = balanced_worst = micro_worst = 0.0
    plain_micro_worst = 0.0
    for k in range(6):
        rows = loader._stream.rows(k * 32, 32)
        costs = loader.row_costs(rows)
        order = loader.order(rows)
        assert sorted(order.tolist()) == list(range(32))
        plain_worst = max(plain_worst, imbalance(costs, np.arange(32), 4))
        balanced_worst = max(balanced_worst, imbalance(costs, order, 4))
        micro_worst = max(micro_worst, imbalance(costs, order, 8))
        plain_micro_worst = max(plain_micro_worst, imbalance(costs, np.arange(32), 8))
    assert plain_worst >= 0.30, plain_worst
    assert balanced_worst <= 0.05, balanced_worst
    assert micro_worst <= min(0.10, plain_micro_worst), (micro_worst, plain_micro_worst)


def test_balanced_order_is_a_deterministic_permutation():
    rng = np.random.default_rng(0)
    costs = rng.pareto(1.1, size=48) + 1
    a, b = balanced_order(costs, 3, 2), balanced_order(costs.copy(), 3, 2)
    assert np.array_equal(a, b) and sorted(a.tolist()) == list(range(48))
    assert imbalance(costs, a, 6) <= imbalance(costs, np.arange(48), 6)
    with pytest.raises(ValueError, match="do not split"):
        balanced_order(costs[:47], 3, 2)


def test_balanced_order_is_never_less_even_than_in_order_with_few_rows_a_shard():
    """Two rows a micro-batch leave little to choose from: on 200 seeded batches of 16 rows
    over 4 shards x 2 micro-batches, each row costing its tokens plus up to 4.6x that in
    attention (most rows of short documents, few of one long one), the balanced order's
    dearest shard is never dearer than in order's (which keeps its order where it cannot win),
    and on the median batch it is within 5% of the mean where in order is 20% or more off."""
    rng = np.random.default_rng(1)
    balanced, plain = [], []
    for _ in range(200):
        costs = 1 + 4.6 * rng.beta(0.3, 1.5, size=16)
        order = balanced_order(costs, 4, 2)
        assert sorted(order.tolist()) == list(range(16))
        balanced.append(imbalance(costs, order, 4))
        plain.append(imbalance(costs, np.arange(16), 4))
        for shard in np.split(order, 4):  # each shard's micro-batches: no worse than in order
            assert imbalance(costs, shard, 2) <= imbalance(costs, np.sort(shard), 2) + 1e-12
    assert all(b <= p + 1e-12 for b, p in zip(balanced, plain))
    assert np.median(balanced) <= 0.05 and np.median(plain) >= 0.20, (np.median(balanced),
                                                                       np.median(plain))


@pytest.mark.compile
def test_the_flex_kernel_keeps_the_same_documents_apart():
    """The GPU's float32 kernel, flex attention with a document x causal block mask, run
    forward on the CPU (its backward needs a GPU): the reference kernel's output, with
    grouped-query heads."""
    from fourfold.models.attention import _flex, split_attention

    docs = torch.tensor([[0] * 30 + [1] * 50 + [2] * 20 + [3] * 28,
                         [0] * 3 + [1] * 5 + [2] * 120], dtype=torch.int32)
    packed = PackedDocuments.from_ids(docs, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(256, 4, 16, generator=g)
    k, v = torch.randn(256, 2, 16, generator=g), torch.randn(256, 2, 16, generator=g)
    torch.testing.assert_close(_flex(q, k, v, packed), split_attention(q, k, v, packed),
                               rtol=0, atol=1e-5)
