"""The data pipeline: tokenizers, prepare, manifest/verify, the rank-aware loader, stdlib corpus."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fourfold.data import (BatchLoader, DataError, Manifest, TokenDataset, builtin_corpus,
                           documents, load_tokenizer, prepare, prepare_main, resolve_data_path,
                           verify)
from fourfold.data.tokenizers import ByteTokenizer, train_bpe

# --------------------------------------------------------------------------------------------
# Helpers


def _generated_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "日本", "émoji🎉", "x", "y", "42"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + f" #{i}\n"
            for i in range(n)]


def _write_corpus(root: Path) -> list[str]:
    """A folder with .txt, .jsonl, .parquet, a binary and a hidden file; returns the documents."""
    texts = _generated_texts(60, seed=1)
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    docs: list[str] = []
    for i in range(10):  # one document per text file
        folder = root / "nested" if i % 2 else root / "nested" / "deeper"
        (folder / f"doc{i:02d}.txt").write_text(texts[i], encoding="utf-8")
        docs.append(texts[i])
    with open(root / "records.jsonl", "w", encoding="utf-8") as f:
        for t in texts[10:30]:
            f.write(json.dumps({"text": t, "id": 7}) + "\n")
            docs.append(t)
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"text": ""}) + "\n")  # so are empty documents
    pq.write_table(pa.table({"text": texts[30:60], "n": list(range(30))}), root / "rows.parquet")
    docs.extend(texts[30:60])
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)  # binary: skipped
    (root / ".hidden" / "secret.txt").write_text("never read")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, _write_corpus(root)


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare([corpus[0]], out, tokenizer="byte", val_fraction=0.1, progress=False)
    return out


def _all_docs(data_dir: Path, split: str) -> list[np.ndarray]:
    return documents(data_dir, split, 10**9)


# --------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_round_trip_and_bad_bytes():
    tok = ByteTokenizer()
    text = "plain ASCII, ünïcödé, 日本語, emoji 🎉, tab\t and newline\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and len(ids) == len(text.encode("utf-8"))
    assert int(ids.max()) < 256 and tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id, tok.spec) == (257, 256, "byte")
    # invalid UTF-8, EOS and ids past the vocabulary: replaced or dropped, never an exception
    assert tok.decode([0xFF, 0xFE, 65, 256, 999]) == "\ufffd\ufffdA"
    assert tok.decode(torch.tensor([104, 105])) == "hi"


def test_bpe_trains_round_trips_and_respects_vocab_size(tmp_path):
    texts = _generated_texts(300, seed=2)
    tok = train_bpe(300, texts)
    assert tok.vocab_size <= 300 and tok.vocab_size > 257  # merges were learned
    assert tok.spec == "bpe:300"
    for text in texts[:20] + ["unseen: ✓ ẞ \x00 é  double  spaces\n\n"]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids.tolist()
        assert tok.decode(ids) == text
    assert len(tok.encode(texts[0])) < len(texts[0].encode("utf-8"))  # it compresses
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.spec == "bpe:300" and again.eos_id == tok.eos_id
    assert np.array_equal(again.encode(texts[5]), tok.encode(texts[5]))


def _hf_word_tokenizer(vocab: dict[str, int]):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    hf = HFTok(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return hf


def test_tokenizer_json_from_path(tmp_path):
    from tokenizers import AddedToken

    hf = _hf_word_tokenizer({"<unk>": 0, "hello": 1, "world": 2})
    hf.add_special_tokens([AddedToken("</s>", special=True)])
    path = tmp_path / "model" / "tokenizer.json"
    path.parent.mkdir()
    hf.save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.eos_id == hf.token_to_id("</s>") == 3 and tok.vocab_size == 4
    assert tok.encode("hello world hello").tolist() == [1, 2, 1]
    assert load_tokenizer(str(path.parent)).eos_id == 3  # a HF model directory works too

    # tokenizer_config.json's eos_token wins over the built-in candidate list
    hf.add_special_tokens([AddedToken("<|mine|>", special=True)])
    hf.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|mine|>"}))
    assert load_tokenizer(str(path)).eos_id == hf.token_to_id("<|mine|>")

    plain = tmp_path / "plain" / "tokenizer.json"
    plain.parent.mkdir()
    _hf_word_tokenizer({"<unk>": 0, "a": 1}).save(str(plain))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(str(plain))


@pytest.mark.parametrize("spec", ["bpe:abc", "bpe:12", "wordpiece", "missing/tokenizer.json"])
def test_bad_tokenizer_spec(spec):
    with pytest.raises(DataError) as info:
        load_tokenizer(spec)
    message = str(info.value)
    assert repr(spec) in message and "\n" not in message
    assert "bpe:VOCAB_SIZE" in message and "tokenizer.json" in message


# --------------------------------------------------------------------------------------------
# prepare, manifest, verify


def test_prepare_counts_and_splits(byte_dir, corpus):
    _, docs = corpus
    manifest = Manifest.load(byte_dir)
    train, val = manifest.splits["train"], manifest.splits["val"]
    assert manifest.dtype == "uint16" and (manifest.vocab_size, manifest.eos_id) == (257, 256)
    assert manifest.skipped_files == 1  # blob.bin; the hidden folder is not even looked at
    assert train.documents + val.documents == len(docs)
    assert val.documents >= 1 and train.documents >= 1
    expected_tokens = sum(len(d.encode("utf-8")) + 1 for d in docs)
    assert train.tokens + val.tokens == expected_tokens
    assert verify(byte_dir) == manifest

    tok = load_tokenizer(byte_dir)
    train_docs = [tok.decode(d) for d in _all_docs(byte_dir, "train")]
    val_docs = [tok.decode(d) for d in _all_docs(byte_dir, "val")]
    assert (len(train_docs), len(val_docs)) == (train.documents, val.documents)
    assert not set(train_docs) & set(val_docs)
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert "never read" not in train_docs + val_docs


def test_prepare_is_deterministic_and_rewrites_in_place(tmp_path, corpus, byte_dir):
    out = tmp_path / "again"
    first = prepare([corpus[0]], out, tokenizer="byte", val_fraction=0.1, progress=False,
                    shard_tokens=500)  # many small shards
    assert len(first.splits["train"].shards) > 3
    # the same token stream as the single-shard preparation
    one = TokenDataset(byte_dir, "train")
    many = TokenDataset(out, "train")
    assert len(one) == len(many) and np.array_equal(one.window(0, len(one)),
                                                    many.window(0, len(many)))
    second = prepare([corpus[0]], out, tokenizer="byte", val_fraction=0.1, progress=False,
                     overwrite=True)
    assert len(second.splits["train"].shards) == 1
    assert sorted(p.name for p in out.glob("*.bin")) == ["train_00000.bin", "train_documents.bin",
                                                         "val_00000.bin", "val_documents.bin"]
    assert not list(out.glob(".*")) and sorted(p.name for p in tmp_path.iterdir()) == ["again"]
    verify(out)


def test_verify_detects_corruption(tmp_path, corpus):
    out = tmp_path / "data"
    prepare([corpus[0]], out, progress=False)
    shard = out / Manifest.load(out).splits["train"].shards[0].file
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=shard.name):
        verify(out)
    shard.write_bytes(bytes(raw[:-2]))  # truncated: the loader notices without hashing
    with pytest.raises(DataError, match="bytes"):
        TokenDataset(out, "train")


def test_prepare_with_bpe(tmp_path, corpus):
    out = tmp_path / "bpe"
    manifest = prepare([corpus[0]], out, tokenizer="bpe:320", val_fraction=0.1, progress=False)
    assert manifest.tokenizer == "bpe:320" and manifest.vocab_size <= 320
    tok = load_tokenizer(out)
    assert tok.vocab_size == manifest.vocab_size and tok.eos_id == manifest.eos_id
    decoded = sorted(tok.decode(d) for s in ("train", "val") for d in _all_docs(out, s))
    assert decoded == sorted(corpus[1])
    verify(out)


def test_uint32_shards_for_big_vocabularies(tmp_path):
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(70_000)}, "<|endoftext|>": 70_001}
    path = tmp_path / "big" / "tokenizer.json"
    path.parent.mkdir()
    _hf_word_tokenizer(vocab).save(str(path))
    (tmp_path / "in.txt").write_text("w69999 w3 w65536")
    out = tmp_path / "data"
    manifest = prepare([tmp_path / "in.txt"], out, tokenizer=str(path), progress=False)
    assert manifest.dtype == "uint32" and manifest.eos_id == 70_001
    assert [d.tolist() for d in documents(out, "train", 5)] == [[70_000, 4, 65_537]]


def test_val_split_has_a_document_even_for_tiny_corpora(tmp_path):
    for n in (2, 3, 5):
        folder = tmp_path / f"tiny{n}"
        folder.mkdir()
        for i in range(n):
            (folder / f"{i}.txt").write_text(f"document number {i}\n" * 5)
        manifest = prepare([folder], tmp_path / f"out{n}", val_fraction=0.005, progress=False)
        assert manifest.splits["val"].documents == 1
        assert manifest.splits["train"].documents == n - 1
    (tmp_path / "single.txt").write_text("only one")
    manifest = prepare([tmp_path / "single.txt"], tmp_path / "out1", progress=False)
    assert (manifest.splits["train"].documents, manifest.splits["val"].documents) == (1, 0)


def test_prepare_user_mistakes(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="nope.txt"):
        prepare([missing], tmp_path / "out", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "image.bin").write_bytes(b"\x00\x01" * 100)
    with pytest.raises(DataError, match="no documents found in .*empty"):
        prepare([empty], tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(DataError, match="no inputs"):
        prepare([], tmp_path / "out", progress=False)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*'text'"):
        prepare([bad_jsonl], tmp_path / "out", progress=False)
    bad_parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"content": ["a"]}), bad_parquet)
    with pytest.raises(DataError, match=r"no 'text' column \(columns: content\)"):
        prepare([bad_parquet], tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="'bpe:x'"):
        prepare([bad_jsonl], tmp_path / "out", tokenizer="bpe:x", progress=False)
    with pytest.raises(DataError, match="val_fraction = 0.9"):
        prepare([bad_jsonl], tmp_path / "out", val_fraction=0.9, progress=False)
    assert not (tmp_path / "out").exists()  # failures leave nothing behind


def test_prepare_main_summary(tmp_path, corpus, capsys):
    assert prepare_main([str(corpus[0])], str(tmp_path / "d"), "byte") == 0
    out = capsys.readouterr().out
    manifest = Manifest.load(tmp_path / "d")
    assert f"{manifest.documents:,} documents" in out
    assert f"{manifest.splits['train'].tokens:,} tokens" in out and "vocab 257" in out


# --------------------------------------------------------------------------------------------
# Loader


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.parametrize("shard_tokens", [None, 100_000])
def test_reading_windows_leaves_no_shard_pages_mapped(tmp_path, shard_tokens):
    """The loader's shards are memory-mapped; the pages a read touches are unmapped after each
    batch (they stay in the page cache), so a run's resident memory does not grow toward the
    corpus's size as it draws random windows. One shard and several."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "big.txt").write_text("".join(_generated_texts(6000, seed=3)),
                                                 encoding="utf-8")
    out = tmp_path / "data"
    extra = {} if shard_tokens is None else {"shard_tokens": shard_tokens}
    prepare([tmp_path / "corpus"], out, tokenizer="byte", val_fraction=0.01, progress=False,
            **extra)
    files = sorted(out.glob("train_0*.bin"))
    assert sum(f.stat().st_size for f in files) > 1 << 20
    assert (len(files) == 1) if shard_tokens is None else (len(files) > 3)
    loader = BatchLoader(out, "train", batch_size=16, seq_len=64, seed=1)
    shards = loader.dataset.shards
    assert sum(int(s[::1024].sum()) for s in shards) > 0  # every page touched, and mapped:
    assert sum(_mapped_kib(f) for f in files) > 512  # (what the reads below must not leave)
    whole = loader.dataset.window(0, len(loader.dataset))  # reads every shard
    assert sum(_mapped_kib(f) for f in files) == 0
    for _ in range(40):
        loader.next_batch()
    assert sum(_mapped_kib(f) for f in files) == 0
    starts = np.random.default_rng(0).integers(0, len(whole) - 65, size=32)
    assert np.array_equal(loader.dataset.windows(starts, 65),
                          np.stack([whole[s:s + 65] for s in starts]))
    assert np.array_equal(loader.dataset.window(100, 5000), whole[100:5100])
    assert sum(_mapped_kib(f) for f in files) == 0


def test_batches_are_deterministic_and_shifted(byte_dir):
    a = BatchLoader(byte_dir, "train", batch_size=8, seq_len=32, seed=7)
    b = BatchLoader(byte_dir, "train", batch_size=8, seq_len=32, seed=7)
    c = BatchLoader(byte_dir, "train", batch_size=8, seq_len=32, seed=8)
    dataset = TokenDataset(byte_dir, "train")
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        assert xa.shape == ya.shape == (8, 32) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        for row in range(8):  # each row is a real window of the split, target = next token
            start = _find_window(dataset, xa[row].numpy())
            assert start is not None
            assert ya[row, -1].item() == dataset.window(start + 32, 1)[0]
    first = BatchLoader(byte_dir, "train", batch_size=8, seq_len=32, seed=7).next_batch()
    assert not torch.equal(first[0], xa)  # batches differ from one call to the next


def _find_window(dataset: TokenDataset, row: np.ndarray) -> int | None:
    full = dataset.window(0, len(dataset))
    view = np.lib.stride_tricks.sliding_window_view(full, len(row))
    hits = np.flatnonzero((view == row).all(axis=1))
    return int(hits[0]) if len(hits) else None


def test_state_dict_resume_continues_identically(byte_dir):
    reference = BatchLoader(byte_dir, "train", batch_size=4, seq_len=16, seed=3)
    expected = [reference.next_batch() for _ in range(6)]
    first = BatchLoader(byte_dir, "train", batch_size=4, seq_len=16, seed=3)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = BatchLoader(byte_dir, "train", batch_size=4, seq_len=16, seed=999)
    resumed.load_state_dict(state)
    for want in expected[4:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("num_shards", [2, 4])
def test_sharded_rows_concatenate_to_the_global_batch(tmp_path, corpus, num_shards):
    # Many small token shards on disk too, so windows cross file boundaries.
    out = tmp_path / "multi"
    prepare([corpus[0]], out, val_fraction=0.2, progress=False, shard_tokens=300)
    full = BatchLoader(out, "train", batch_size=8, seq_len=24, seed=11)
    ranks = [BatchLoader(out, "train", batch_size=8, seq_len=24, seed=11, shard_index=i,
                         num_shards=num_shards) for i in range(num_shards)]
    for _ in range(3):
        x, y = full.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(p[0].shape == (8 // num_shards, 24) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    full_eval = BatchLoader(out, "val", batch_size=8, seq_len=24, seed=0).eval_batches(3)
    rank_eval = [BatchLoader(out, "val", batch_size=8, seq_len=24, seed=5, shard_index=i,
                             num_shards=num_shards).eval_batches(3) for i in range(num_shards)]
    for k, (x, y) in enumerate(full_eval):
        assert torch.equal(torch.cat([r[k][0] for r in rank_eval]), x)
        assert torch.equal(torch.cat([r[k][1] for r in rank_eval]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_eval_batches_fixed(byte_dir):
    loader = BatchLoader(byte_dir, "val", batch_size=4, seq_len=16, seed=1)
    first = loader.eval_batches(2)
    loader.next_batch()
    second = loader.eval_batches(2)
    assert len(first) == len(second) == 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0][0], first[1][0])
    assert loader.batches_drawn == 1  # eval does not advance the training stream


def test_documents_first_n_in_order(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(12):
        (folder / f"{i:02d}.txt").write_text(f"doc {i} " * (i + 1))
    out = tmp_path / "out"
    prepare([folder], out, val_fraction=0.0, progress=False, shard_tokens=37)
    got = documents(out, "train", 5)
    tok = ByteTokenizer()
    assert [tok.decode(d) for d in got] == [f"doc {i} " * (i + 1) for i in range(5)]
    assert all(d.dtype == np.int64 for d in got)
    assert len(documents(out, "train", 100)) == 12


def test_loader_refuses_ids_outside_the_vocabulary(tmp_path, corpus):
    """A shard id past manifest.json's vocabulary (another tokenizer's shard, or one damaged
    since prepare) stops the loader with one line, not a loss over the wrong rows."""
    out = tmp_path / "data"
    prepare([corpus[0]], out, progress=False)
    manifest = Manifest.load(out)
    shard = out / manifest.splits["train"].shards[0].file
    ids = np.fromfile(shard, dtype=manifest.dtype)
    ids[5] = manifest.vocab_size
    ids.tofile(shard)
    loader = BatchLoader(out, "train", batch_size=2, seq_len=len(ids) - 1, seed=0)
    with pytest.raises(DataError, match=f"token id {manifest.vocab_size} at offset 0 \\+ 5, "
                       f"outside the vocabulary 0..{manifest.vocab_size - 1}"):
        loader.next_batch()
    ids[5] = manifest.vocab_size - 1  # the last id is in range
    ids.tofile(shard)
    inputs, targets = loader.next_batch()
    assert int(inputs[0, 5]) == manifest.vocab_size - 1 == int(targets[0, 4])

def test_loader_user_mistakes(byte_dir, tmp_path):
    with pytest.raises(DataError, match="batch_size = 6 .*4"):
        BatchLoader(byte_dir, "train", batch_size=6, seq_len=8, seed=0, num_shards=4)
    val_tokens = Manifest.load(byte_dir).splits["val"].tokens
    with pytest.raises(DataError, match=f"{val_tokens} tokens.*{val_tokens + 10}"):
        BatchLoader(byte_dir, "val", batch_size=1, seq_len=val_tokens + 9, seed=0)
    with pytest.raises(DataError, match="'test'"):
        TokenDataset(byte_dir, "test")
    with pytest.raises(DataError, match="not a prepared data directory.*fourfold prepare"):
        resolve_data_path(str(tmp_path), "byte")
    with pytest.raises(DataError, match="builtin:nope"):
        resolve_data_path("builtin:nope", "byte")
    assert resolve_data_path(str(byte_dir), "byte") == byte_dir


# --------------------------------------------------------------------------------------------
# Built-in corpus


def _build_builtin(cache: str) -> tuple[str, int]:
    time.sleep(0.2)  # both workers are up before either starts building
    return str(builtin_corpus("byte", cache_dir=Path(cache))), os.getpid()


def test_builtin_corpus_cached_and_safe_under_concurrency(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    # Two processes at once, as when several ranks start: one builds, the other waits and reuses.
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_build_builtin, [str(cache), str(cache)], chunksize=1)
    (path_a, pid_a), (path_b, pid_b) = results
    assert path_a == path_b and pid_a != pid_b
    data_dir = Path(path_a)
    manifest = verify(data_dir)
    assert manifest.splits["train"].tokens > 1_000_000 and manifest.splits["val"].documents >= 1
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [data_dir.name]  # no leftovers
    start = time.perf_counter()
    assert builtin_corpus("byte", cache_dir=cache) == data_dir
    assert time.perf_counter() - start < 0.5  # the second call reuses the cache
    monkeypatch.setenv("FOURFOLD_CACHE", str(cache))  # the default cache location
    assert resolve_data_path("builtin:stdlib", "byte") == data_dir
    x, _ = BatchLoader(data_dir, "train", batch_size=64, seq_len=256, seed=0).next_batch()
    assert "def " in load_tokenizer(data_dir).decode(x)  # it is Python source


def test_big_text_file_is_cut_at_blank_lines(tmp_path, monkeypatch):
    # The package exports the function `prepare`, which shadows the module attribute.
    prepare_module = importlib.import_module("fourfold.data.prepare")

    monkeypatch.setattr(prepare_module, "BIG_TEXT_BYTES", 2000)
    monkeypatch.setattr(prepare_module, "TEXT_PIECE_BYTES", 500)
    paragraphs = [f"paragraph {i}: " + "word " * (i % 40) + "\n" for i in range(200)]
    text = "\n".join(paragraphs)
    (tmp_path / "book.txt").write_text(text)
    out = tmp_path / "out"
    manifest = prepare([tmp_path / "book.txt"], out, val_fraction=0.0, progress=False)
    pieces = [ByteTokenizer().decode(d) for d in documents(out, "train", 10**6)]
    assert manifest.documents == len(pieces) > 3
    assert "".join(pieces) == text
    assert all(p.endswith("\n\n") for p in pieces[:-1])  # cut only after a blank line


def test_output_inside_input_folder_is_not_read_back(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "b.txt").write_text("other text")
    first = prepare([tmp_path], tmp_path / "data", progress=False)
    second = prepare([tmp_path], tmp_path / "data", progress=False, overwrite=True)
    assert first.documents == second.documents == 2
    assert first.splits == second.splits


# --------------------------------------------------------------------------------------------
# Preparing over existing data: refused unless --overwrite, which swaps the new data in whole


def _snapshot(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir())}


def test_prepare_refuses_a_non_empty_directory_unless_overwrite(tmp_path, corpus, capsys):
    from fourfold.cli import main

    out = tmp_path / "data"
    prepare([corpus[0]], out, tokenizer="bpe:300", val_fraction=0.1, progress=False)
    before = _snapshot(out)
    with pytest.raises(DataError, match="already holds a prepared data directory; pass "
                                        "--overwrite"):
        prepare([corpus[0]], out, progress=False)
    assert main(["prepare", str(corpus[0]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err
    assert _snapshot(out) == before  # nothing touched
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(DataError, match="already holds files"):
        prepare([corpus[0]], tmp_path / "notes", progress=False)
    (tmp_path / "empty").mkdir()
    prepare([corpus[0]], tmp_path / "empty", progress=False)  # an empty directory is fine
    # byte data over BPE data: nothing of the BPE data (its tokenizer.json) is left beside it
    assert main(["prepare", str(corpus[0]), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "tokenizer.json").exists()
    assert isinstance(load_tokenizer(out), ByteTokenizer) and Manifest.load(out).vocab_size == 257
    verify(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "empty", "notes"]


def test_an_interrupted_prepare_leaves_the_old_data_whole(tmp_path, corpus, monkeypatch):
    import fourfold.files

    prepare_module = importlib.import_module("fourfold.data.prepare")
    out = tmp_path / "data"
    prepare([corpus[0]], out, tokenizer="byte", val_fraction=0.1, progress=False)
    before = _snapshot(out)
    route = prepare_module._route_documents

    def interrupted(documents, writers, *args):
        def stop(*_):
            raise KeyboardInterrupt

        writers["train"].tokens.write(np.arange(100))  # some new tokens are on disk by then
        monkeypatch.setattr(writers["train"], "write", stop)
        return route(documents, writers, *args)

    monkeypatch.setattr(prepare_module, "_route_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus[0]], out, tokenizer="bpe:300", progress=False, overwrite=True)
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    monkeypatch.setattr(prepare_module, "_route_documents", route)

    # Where the system cannot swap in one step: the second of two renames fails, and the old
    # directory is moved back.
    monkeypatch.setattr(fourfold.files, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def failing_rename(src, dst):
        if ".new-" in str(src):
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(fourfold.files.os, "rename", failing_rename)
    with pytest.raises(KeyboardInterrupt):
        prepare([corpus[0]], out, tokenizer="bpe:300", progress=False, overwrite=True)
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    monkeypatch.setattr(fourfold.files.os, "rename", real_rename)
    prepare([corpus[0]], out, tokenizer="bpe:300", progress=False, overwrite=True)
    assert Manifest.load(out).tokenizer == "bpe:300"
    verify(out)


@pytest.mark.slow
def test_a_killed_prepare_leaves_the_old_data_whole(tmp_path, corpus):
    """A prepare killed outright (SIGKILL) while tokenizing, and one killed between the two
    renames of a swap (its state made by hand): the old data is whole, and the next prepare
    clears what the dead process left."""
    import signal
    import subprocess
    import sys

    from conftest import outside_job_env

    out = tmp_path / "data"
    prepare([corpus[0]], out, tokenizer="byte", val_fraction=0.1, progress=False)
    before = _snapshot(out)
    big = tmp_path / "big.txt"
    big.write_text("".join(_generated_texts(20_000, seed=3)) * 4)
    proc = subprocess.Popen([sys.executable, "-m", "fourfold", "prepare", str(big), "--out",
                             str(out), "--overwrite"], env=outside_job_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = tmp_path / f".data.new-{proc.pid}"
    deadline = time.monotonic() + 120
    while not list(staging.glob("train_*.bin")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _snapshot(out) == before and staging.exists()  # the new data never took its place

    # killed between the renames: the old data under its hidden name, nothing at DATA_DIR
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.rename(tmp_path / f".data.old-{dead.pid}")
    prepare([corpus[0]], tmp_path / "other", progress=False)  # another directory: untouched
    assert not out.exists()
    with pytest.raises(DataError, match="already holds"):  # the old data is back in place
        prepare([corpus[0]], out, progress=False)
    assert _snapshot(out) == before and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "data", "other"]


# --------------------------------------------------------------------------------------------
# Tokenizer fingerprints


def test_the_manifest_records_the_tokenizer_fingerprint(tmp_path, corpus, byte_dir):
    from fourfold.data.manifest import data_tokenizer_fingerprint
    from fourfold.data.tokenizers import spec_fingerprint, tokenizer_fingerprint

    assert Manifest.load(byte_dir).tokenizer_fingerprint == "byte"
    assert data_tokenizer_fingerprint(byte_dir) == "byte" == spec_fingerprint("byte")
    bpe = tmp_path / "bpe"
    prepare([corpus[0]], bpe, tokenizer="bpe:300", progress=False)
    fingerprint = Manifest.load(bpe).tokenizer_fingerprint
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
    assert fingerprint == tokenizer_fingerprint(load_tokenizer(bpe))
    assert fingerprint == spec_fingerprint(bpe / "tokenizer.json") == spec_fingerprint(bpe)
    # the trained tokenizer as a file of its own: data prepared with it has the same one
    again = tmp_path / "again"
    prepare([corpus[0]], again, tokenizer=str(bpe / "tokenizer.json"), progress=False)
    assert Manifest.load(again).tokenizer_fingerprint == fingerprint
    assert (again / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    # a directory prepared before manifests recorded fingerprints: computed from its files
    manifest = json.loads((again / "manifest.json").read_text())
    del manifest["tokenizer_fingerprint"]
    (again / "manifest.json").write_text(json.dumps(manifest))
    assert Manifest.load(again).tokenizer_fingerprint == ""
    assert data_tokenizer_fingerprint(again) == fingerprint
    verify(again)
    assert data_tokenizer_fingerprint(byte_dir) != fingerprint


def test_a_data_tokenizer_that_disagrees_with_the_prepared_data_is_refused(tmp_path, corpus,
                                                                          byte_dir):
    bpe = tmp_path / "bpe"
    prepare([corpus[0]], bpe, tokenizer="bpe:300", progress=False)
    other = tmp_path / "other.json"
    _hf_word_tokenizer({"<unk>": 0, "<|endoftext|>": 1}).save(str(other))
    refused = [(byte_dir, "bpe:4000", "data.tokenizer = 'bpe:4000' is not the tokenizer"),
               (bpe, "byte", "data.tokenizer = 'byte' (byte) is not the tokenizer"),
               (bpe, "bpe:400", "'bpe:400'"), (bpe, str(other), "other.json"),
               (byte_dir, str(bpe), "data.tokenizer = ")]
    for data_dir, spec, fragment in refused:
        with pytest.raises(DataError) as e:
            resolve_data_path(str(data_dir), spec)
        message = str(e.value)
        assert fragment in message and "\n" not in message, message
        theirs = Manifest.load(data_dir)
        assert f"({theirs.tokenizer!r}, {theirs.tokenizer_fingerprint[:19]})" in message
    for data_dir, spec in [(byte_dir, "auto"), (byte_dir, "byte"), (bpe, "auto"),
                           (bpe, "bpe:300"), (bpe, str(bpe / "tokenizer.json")),
                           (bpe, str(bpe))]:
        assert resolve_data_path(str(data_dir), spec) == data_dir


@pytest.mark.slow
def test_train_refuses_a_data_tokenizer_the_data_was_not_prepared_with(tmp_path, byte_dir,
                                                                       capsys):
    from fourfold.cli import main

    code = main(["train", "--set", f"data.path={byte_dir}", "--set", "data.tokenizer=bpe:4000",
                 "--set", "train.steps=1", "--set", "train.device=cpu", "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "data.tokenizer = 'bpe:4000' is not the tokenizer" in err and "('byte', byte)" in err
