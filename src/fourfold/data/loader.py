"""Reading a prepared DATA_DIR: memory-mapped splits, a resumable rank-aware batch loader.

Sharding rule (what makes data parallelism exact): every rank draws the offsets of the whole
global batch from the same generator, seeded by (seed, batch number), and keeps only its own
rows. Shard i of n therefore returns rows [i*b, (i+1)*b) of the batch an unsharded loader returns
at the same call count, whatever the grid, and a run resumed on a different number of ranks still
sees the same global batches.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fourfold.data.errors import DataError
from fourfold.data.manifest import Manifest, sha256_file
from fourfold.data.tokenizers import load_tokenizer

DOC_SCAN_TOKENS = 1 << 22
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None


class TokenDataset:
    """One split of a DATA_DIR as a single token sequence over its memory-mapped shards.

    Shard presence and sizes are checked against the manifest; checksums are `verify`'s job
    (hashing every shard on each start would be slow for big corpora).
    """

    def __init__(self, data_dir: str | Path, split: str) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = Manifest.load(self.data_dir)
        info = self.manifest.split(split)
        dtype = np.dtype(self.manifest.dtype)
        self.shards: list[np.ndarray] = []  # read-only views of self._maps
        self._maps: list[mmap.mmap] = []
        self._touched: set[int] = set()  # shards read since the last _release
        for shard in info.shards:
            if shard.tokens == 0:
                continue
            path = self.data_dir / shard.file
            if not path.is_file():
                raise DataError(f"{path}: shard listed in {self.data_dir}/manifest.json is missing")
            expected = shard.tokens * dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise DataError(f"{path}: {actual} bytes, manifest.json says {expected}; "
                                "prepare the data again")
            with open(path, "rb") as f:
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            self.shards.append(np.frombuffer(self._maps[-1], dtype=dtype, count=shard.tokens))
        # starts[k] = index of the first token of shard k in the split's token sequence
        self.starts = np.cumsum([0] + [len(s) for s in self.shards], dtype=np.int64)
        self.num_tokens = int(self.starts[-1])

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def __len__(self) -> int:
        return self.num_tokens

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        self._read(out, start)
        self._release()
        return out

    def _release(self) -> None:
        """Unmap the shards' pages that reads touched. They stay in the kernel's page cache
        (the next read of them is a minor fault), but mapped they count in this process's
        resident memory: a run that draws random windows otherwise grows by the pages around
        each window (the kernel maps up to 64 KiB around a fault), toward the whole corpus
        (the 15m preset, 8 x 128 tokens a step: about 0.4 MiB a step)."""
        if _DONTNEED is not None:
            for k in self._touched:
                self._maps[k].madvise(_DONTNEED)
        self._touched.clear()

    def _read(self, out: np.ndarray, start: int) -> None:
        length = len(out)
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside 0..{self.num_tokens}")
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            local = start + filled - int(self.starts[shard])
            take = min(length - filled, len(self.shards[shard]) - local)
            out[filled:filled + take] = self.shards[shard][local:local + take]
            self._touched.add(shard)
            filled += take
            shard += 1

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A (len(starts), length) int64 array of windows."""
        if len(self.shards) == 1:  # the common case: one gather, no Python loop per row
            index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)
            out = self.shards[0][index].astype(np.int64)
            self._touched.add(0)
        else:
            out = np.empty((len(starts), length), dtype=np.int64)
            for row, start in enumerate(starts):
                self._read(out[row], int(start))
        self._release()
        return out


class BatchLoader:
    """Random windows of seq_len + 1 tokens, batch by batch, identical on any number of ranks.

    `batch_size` is the global number of sequences per call; this rank gets
    batch_size // num_shards of them. Batch k depends only on (seed, k).
    """

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, seq_len: int,
                 seed: int, shard_index: int = 0, num_shards: int = 1) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size = {batch_size}: expected a positive integer")
        if seq_len < 1:
            raise DataError(f"seq_len = {seq_len}: expected a positive integer")
        if num_shards < 1:
            raise DataError(f"num_shards = {num_shards}: expected a positive integer")
        if batch_size % num_shards:
            raise DataError(f"batch_size = {batch_size} is not divisible by the {num_shards} "
                            "data shards (data-parallel ranks x z); choose a multiple")
        if not 0 <= shard_index < num_shards:
            raise DataError(f"shard_index = {shard_index}: expected 0..{num_shards - 1}")
        if seed < 0:
            raise DataError(f"seed = {seed}: expected a non-negative integer")
        self.dataset = TokenDataset(data_dir, split)
        if len(self.dataset) < seq_len + 1:
            raise DataError(f"split '{split}' of {data_dir} has {len(self.dataset)} tokens, fewer "
                            f"than seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")
        self.split = split
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.batches_drawn = 0

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.num_shards

    def _global_offsets(self, batch_number: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, batch_number])
        return rng.integers(0, len(self.dataset) - self.seq_len, size=self.batch_size)

    def _local_batch(self, global_offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.local_batch_size
        mine = global_offsets[self.shard_index * b:(self.shard_index + 1) * b]
        rows = self.dataset.windows(mine, self.seq_len + 1)  # (b, T + 1)
        # ids are unsigned; one past the vocabulary would index past the embedding and the
        # loss's logits (a shard written by another tokenizer, or damaged since `verify`)
        if rows.size and int(rows.max()) >= self.dataset.vocab_size:
            row = int(np.argmax(rows.max(axis=1)))
            raise DataError(f"{self.dataset.data_dir}: split '{self.split}' has token id "
                            f"{int(rows[row].max())} at offset {int(mine[row])} + "
                            f"{int(np.argmax(rows[row]))}, outside the vocabulary 0.."
                            f"{self.dataset.vocab_size - 1} of its manifest.json; prepare "
                            "the data again")
        windows = torch.from_numpy(rows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64, each (batch_size // num_shards, seq_len)."""
        offsets = self._global_offsets(self.batches_drawn)
        self.batches_drawn += 1
        return self._local_batch(offsets)

    def eval_batches(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """n fixed batches, the same on every call: windows evenly spaced over the split."""
        if n < 0:
            raise DataError(f"eval batches = {n}: expected a non-negative integer")
        if n == 0:
            return []
        last_start = len(self.dataset) - self.seq_len - 1
        starts = np.linspace(0, last_start, n * self.batch_size).round().astype(np.int64)
        return [self._local_batch(starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue with exactly the batches it would have drawn."""
        return {
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "split": self.split,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "split_tokens": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the shard layout may differ (batches do not depend on it)."""
        try:
            seed, drawn = int(state["seed"]), int(state["batches_drawn"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"data loader state: missing or bad field ({exc})") from None
        if seed < 0 or drawn < 0:
            raise DataError(f"data loader state: seed = {seed}, batches_drawn = {drawn}: expected "
                            "non-negative integers")
        self.seed = seed
        self.batches_drawn = drawn


def documents(data_dir: str | Path, split: str, n: int) -> list[np.ndarray]:
    """The token ids (int64, EOS removed) of the first n documents of a split."""
    dataset = TokenDataset(data_dir, split)
    eos = dataset.eos_id
    docs: list[np.ndarray] = []
    carry: list[np.ndarray] = []  # the start of a document that continues in the next chunk
    if n <= 0:
        return docs
    for shard in dataset.shards:
        for begin in range(0, len(shard), DOC_SCAN_TOKENS):
            chunk = np.asarray(shard[begin:begin + DOC_SCAN_TOKENS], dtype=np.int64)
            prev = 0
            for end in np.flatnonzero(chunk == eos):
                piece = chunk[prev:end]
                if carry:
                    piece = np.concatenate(carry + [piece])
                    carry = []
                docs.append(piece.copy())
                if len(docs) == n:
                    return docs
                prev = int(end) + 1
            if prev < len(chunk):
                carry.append(chunk[prev:])
    return docs


def verify(data_dir: str | Path) -> Manifest:
    """Check every shard's size and sha256 and the stored tokenizer; DataError on a mismatch."""
    data_dir = Path(data_dir)
    manifest = Manifest.load(data_dir)
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for shard in split.shards:
            path = data_dir / shard.file
            if not path.is_file():
                raise DataError(f"{path}: shard listed in manifest.json is missing")
            if path.stat().st_size != shard.tokens * itemsize:
                raise DataError(f"{path}: {path.stat().st_size} bytes, manifest.json says "
                                f"{shard.tokens * itemsize}")
            digest = sha256_file(path)
            if digest != shard.sha256:
                raise DataError(f"{path}: sha256 {digest[:16]}... does not match "
                                f"manifest.json ({shard.sha256[:16]}...); the file changed or is "
                                "corrupt, prepare the data again")
    tok = load_tokenizer(data_dir)
    if (tok.vocab_size, tok.eos_id) != (manifest.vocab_size, manifest.eos_id):
        raise DataError(f"{data_dir}: stored tokenizer has vocab {tok.vocab_size}, eos "
                        f"{tok.eos_id}; manifest.json says {manifest.vocab_size}, "
                        f"{manifest.eos_id}")
    return manifest
