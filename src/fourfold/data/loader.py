"""Reading a prepared DATA_DIR: memory-mapped splits, a resumable rank-aware batch loader.

Sharding rule (what makes data parallelism exact): every rank draws the whole global batch from
the same generator, seeded by (seed, batch number), and keeps only its own rows. Shard i of n
therefore returns rows [i*b, (i+1)*b) of the batch an unsharded loader returns at the same call
count (in the order the balancer gives them, below), whatever the grid, and a run resumed on a
different number of ranks still sees the same global batches.

Two ways to draw a row (data.packing):
- "none": a window of seq_len + 1 tokens at a random offset; attention runs across the
  documents inside it (how pretraining on raw text is usually done).
- "documents": whole documents packed into the row with their boundaries kept (data/packing.py);
  the batch says which document each position is in, so that attention never crosses one and
  positions restart at each (models/attention.py). The default for chat and instruction data.
Packed rows cost different amounts of work (attention grows with the square of a document's
length), so the loader spreads each global batch's rows over the shards and micro-batches by
cost (data/balance.py) before each rank takes its own.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from fourfold.data.balance import SequenceCost, balanced_order
from fourfold.data.errors import DataError
from fourfold.data.manifest import Manifest, ShardInfo, sha256_file
from fourfold.data.packing import Pieces, RowStream, document_pieces, eval_rows
from fourfold.data.tokenizers import load_tokenizer

DOC_SCAN_TOKENS = 1 << 22
PACKING = ("auto", "documents", "none")  # data.packing
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None


class _MappedArray:
    """Files of one dtype, memory-mapped, read as one sequence."""

    def __init__(self, data_dir: Path, files: tuple[ShardInfo, ...], dtype: np.dtype) -> None:
        self.shards: list[np.ndarray] = []  # read-only views of self._maps
        self._maps: list[mmap.mmap] = []
        self._touched: set[int] = set()  # shards read since the last release
        for shard in files:
            if shard.tokens == 0:
                continue
            path = data_dir / shard.file
            if not path.is_file():
                raise DataError(f"{path}: file listed in {data_dir}/manifest.json is missing")
            expected = shard.tokens * dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise DataError(f"{path}: {actual} bytes, manifest.json says {expected}; "
                                "prepare the data again")
            with open(path, "rb") as f:
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            self.shards.append(np.frombuffer(self._maps[-1], dtype=dtype, count=shard.tokens))
        # starts[k] = index of the first element of shard k in the whole sequence
        self.starts = np.cumsum([0] + [len(s) for s in self.shards], dtype=np.int64)
        self.size = int(self.starts[-1])

    def release(self) -> None:
        """Unmap the shards' pages that reads touched. They stay in the kernel's page cache
        (the next read of them is a minor fault), but mapped they count in this process's
        resident memory: a run that draws random windows otherwise grows by the pages around
        each window (the kernel maps up to 64 KiB around a fault), toward the whole corpus
        (the 15m preset, 8 x 128 tokens a step: about 0.4 MiB a step)."""
        if _DONTNEED is not None:
            for k in self._touched:
                self._maps[k].madvise(_DONTNEED)
        self._touched.clear()

    def read(self, out: np.ndarray, start: int) -> None:
        length = len(out)
        if start < 0 or start + length > self.size:
            raise IndexError(f"window [{start}, {start + length}) outside 0..{self.size}")
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            local = start + filled - int(self.starts[shard])
            take = min(length - filled, len(self.shards[shard]) - local)
            out[filled:filled + take] = self.shards[shard][local:local + take]
            self._touched.add(shard)
            filled += take
            shard += 1

    def windows(self, starts: np.ndarray, length: int, dtype: type) -> np.ndarray:
        if len(self.shards) == 1:  # the common case: one gather, no Python loop per row
            index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)
            out = self.shards[0][index].astype(dtype)
            self._touched.add(0)
        else:
            out = np.empty((len(starts), length), dtype=dtype)
            for row, start in enumerate(starts):
                self.read(out[row], int(start))
        self.release()
        return out


class TokenDataset:
    """One split of a DATA_DIR as a single token sequence over its memory-mapped shards, with
    its trained-token masks (chat and instruction data) and where its documents begin.

    Shard presence and sizes are checked against the manifest; checksums are `verify`'s job
    (hashing every shard on each start would be slow for big corpora).
    """

    def __init__(self, data_dir: str | Path, split: str) -> None:
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = Manifest.load(self.data_dir)
        info = self.manifest.split(split)
        self._tokens = _MappedArray(self.data_dir, info.shards, np.dtype(self.manifest.dtype))
        self._trained = (_MappedArray(self.data_dir, info.trained, np.dtype(np.uint8))
                         if info.trained else None)
        self.shards = self._tokens.shards
        self.num_tokens = self._tokens.size
        if self._trained is not None and self._trained.size != self.num_tokens:
            raise DataError(f"{self.data_dir}: split '{split}' has {self._trained.size} trained "
                            f"flags for {self.num_tokens} tokens; prepare the data again")
        # each document's first token; None in a directory prepared before the index existed
        self.document_starts: np.ndarray | None = None
        if info.document_index is not None:
            index = _MappedArray(self.data_dir, (info.document_index,), np.dtype(np.int64))
            self.document_starts = (np.array(index.shards[0]) if index.shards
                                    else np.zeros(0, dtype=np.int64))

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def has_masks(self) -> bool:
        return self._trained is not None

    def __len__(self) -> int:
        return self.num_tokens

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries if needed."""
        out = np.empty(length, dtype=np.int64)
        self._tokens.read(out, start)
        self._tokens.release()
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A (len(starts), length) int64 array of windows."""
        return self._tokens.windows(starts, length, np.int64)

    def trained_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Whether each token of the windows is trained, (len(starts), length) bool (all True
        for data without masks)."""
        if self._trained is None:
            return np.ones((len(starts), length), dtype=bool)
        return self._trained.windows(starts, length, np.bool_)

    def ranges(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens (int64) and trained flags (bool) of ranges [starts[i], starts[i] +
        lengths[i]), one after the other."""
        total = int(np.sum(lengths))
        tokens = np.empty(total, dtype=np.int64)
        trained = np.ones(total, dtype=bool)
        at = 0
        for start, length in zip(starts.tolist(), lengths.tolist()):
            self._tokens.read(tokens[at:at + length], start)
            if self._trained is not None:
                flags = np.empty(length, dtype=np.uint8)
                self._trained.read(flags, start)
                trained[at:at + length] = flags.astype(bool)
            at += length
        self._tokens.release()
        if self._trained is not None:
            self._trained.release()
        return tokens, trained

    def document_boundaries(self) -> np.ndarray:
        """Each document's first token: the document index, or, in a directory prepared before
        it existed (raw text), the token after each EOS."""
        if self.document_starts is not None:
            return self.document_starts
        after_eos = [np.zeros(1, dtype=np.int64)]
        for k, shard in enumerate(self.shards):
            for begin in range(0, len(shard), DOC_SCAN_TOKENS):
                chunk = np.asarray(shard[begin:begin + DOC_SCAN_TOKENS])
                after_eos.append(np.flatnonzero(chunk == self.eos_id).astype(np.int64)
                                 + self._tokens.starts[k] + begin + 1)
        starts = np.concatenate(after_eos)
        return starts[starts < self.num_tokens]


@dataclass(frozen=True)
class Batch:
    """One rank's rows of a global batch.

    `trained` says which targets count in the loss (None: all of them); `documents` which
    document each position belongs to, numbered from 0 in each row (None: each row is one
    causal sequence). `documents` stays on the host when the batch moves to a device: the
    model reads the boundaries there, without waiting for the device. A batch without either
    unpacks and indexes as the pair (inputs, targets)."""

    inputs: torch.Tensor  # (b, T) int64
    targets: torch.Tensor  # (b, T) int64
    trained: torch.Tensor | None = None  # (b, T) bool
    documents: torch.Tensor | None = None  # (b, T) int32, on the host

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.trained is not None or self.documents is not None:
            raise TypeError("this batch has a trained-token mask or document boundaries, which "
                            "(inputs, targets) would drop; read batch.inputs, batch.targets, "
                            "batch.trained and batch.documents")
        return iter((self.inputs, self.targets))

    def __getitem__(self, index: int) -> torch.Tensor:
        return tuple(self)[index]

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device` (to a GPU through pinned memory, without blocking the host);
        `documents` stays on the host."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device == torch.device(device):
                return t
            if torch.device(device).type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return replace(self, inputs=move(self.inputs), targets=move(self.targets),
                       trained=move(self.trained))

    def split(self, n: int) -> list[Batch]:
        """n micro-batches of consecutive rows (as torch.chunk splits them)."""
        def parts(t: torch.Tensor | None) -> list[torch.Tensor | None]:
            return [None] * n if t is None else list(t.chunk(n))

        return [Batch(*fields) for fields in zip(parts(self.inputs), parts(self.targets),
                                                 parts(self.trained), parts(self.documents))]

    def loss_weights(self) -> torch.Tensor:
        """1.0 for each trained target and 0.0 for the others, float32 (b, T)."""
        if self.trained is None:
            return torch.ones(self.targets.shape, dtype=torch.float32,
                              device=self.targets.device)
        return self.trained.float()


class BatchLoader:
    """Rows of seq_len positions, batch by batch, identical on any number of ranks.

    `batch_size` is the global number of rows per call; this rank gets batch_size //
    num_shards of them. Batch k depends only on (seed, k). `packing` (PACKING): random windows
    or packed documents ("auto": documents for chat and instruction data). Packed rows are
    spread over the shards and the `micro_batches` the trainer cuts each rank's rows into by
    `cost` (unless `balance` is off).
    """

    def __init__(self, data_dir: str | Path, split: str, batch_size: int, seq_len: int,
                 seed: int, shard_index: int = 0, num_shards: int = 1, *,
                 packing: str = "auto", micro_batches: int = 1,
                 cost: SequenceCost = SequenceCost(), balance: bool = True) -> None:
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
        if packing not in PACKING:
            raise DataError(f"data.packing = {packing!r}: expected one of {', '.join(PACKING)}")
        if micro_batches < 1 or batch_size % (num_shards * micro_batches):
            raise DataError(f"batch_size = {batch_size} does not split into {micro_batches} "
                            f"micro-batches on each of {num_shards} data shards")
        self.dataset = TokenDataset(data_dir, split)
        if packing == "auto":
            packing = "documents" if self.dataset.manifest.data_format != "text" else "none"
        self.packing = packing
        self.split = split
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.micro_batches = micro_batches
        self.cost = cost
        self.balance = balance
        self.batches_drawn = 0
        self._pieces: Pieces | None = None
        self._stream: RowStream | None = None
        if packing == "documents":
            self._pieces = document_pieces(self.dataset.document_boundaries(),
                                           len(self.dataset), seq_len)
            if len(self._pieces) == 0:
                raise DataError(f"split '{split}' of {data_dir} has no document of two or more "
                                "tokens to train on")
            self._stream = RowStream(self._pieces, seq_len, seed)
        elif len(self.dataset) < seq_len + 1:
            raise DataError(f"split '{split}' of {data_dir} has {len(self.dataset)} tokens, fewer "
                            f"than seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.num_shards

    # ---- windows (packing = "none") ---------------------------------------------------------

    def _global_offsets(self, batch_number: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, batch_number])
        return rng.integers(0, len(self.dataset) - self.seq_len, size=self.batch_size)

    def _local_windows(self, global_offsets: np.ndarray) -> Batch:
        b = self.local_batch_size
        mine = global_offsets[self.shard_index * b:(self.shard_index + 1) * b]
        rows = self.dataset.windows(mine, self.seq_len + 1)  # (b, T + 1)
        self._check_ids(rows, lambda row: f"offset {int(mine[row])}")
        windows = torch.from_numpy(rows)
        trained = None
        if self.dataset.has_masks:  # the mask of each target: tokens 1..T of the window
            flags = self.dataset.trained_windows(mine + 1, self.seq_len)
            trained = torch.from_numpy(flags)
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), trained)

    def _check_ids(self, rows: np.ndarray, where: Any) -> None:
        # ids are unsigned; one past the vocabulary would index past the embedding and the
        # loss's logits (a shard written by another tokenizer, or damaged since `verify`)
        if rows.size and int(rows.max()) >= self.dataset.vocab_size:
            row = int(np.argmax(rows.max(axis=1)))
            raise DataError(f"{self.dataset.data_dir}: split '{self.split}' has token id "
                            f"{int(rows[row].max())} at {where(row)} + "
                            f"{int(np.argmax(rows[row]))}, outside the vocabulary 0.."
                            f"{self.dataset.vocab_size - 1} of its manifest.json; prepare "
                            "the data again")

    # ---- packed documents -------------------------------------------------------------------

    def row_costs(self, rows: list[np.ndarray]) -> np.ndarray:
        """The cost of each packed row (its pieces and its padding, by `cost`)."""
        assert self._pieces is not None
        costs = np.empty(len(rows))
        for i, row in enumerate(rows):
            lengths = self._pieces.lengths[row]
            padding = self.seq_len - int(lengths.sum())
            costs[i] = self.cost.row(np.append(lengths, padding) if padding else lengths)
        return costs

    def order(self, rows: list[np.ndarray]) -> np.ndarray:
        """The order in which a global batch's rows are dealt to shards and micro-batches."""
        if not self.balance:
            return np.arange(len(rows))
        return balanced_order(self.row_costs(rows), self.num_shards, self.micro_batches)

    def _local_packed(self, rows: list[np.ndarray]) -> Batch:
        b = self.local_batch_size
        order = self.order(rows)
        mine = [rows[i] for i in order[self.shard_index * b:(self.shard_index + 1) * b]]
        assert self._pieces is not None
        T = self.seq_len
        inputs = np.full((b, T), self.dataset.eos_id, dtype=np.int64)
        targets = np.full((b, T), self.dataset.eos_id, dtype=np.int64)
        trained = np.zeros((b, T), dtype=bool)
        documents = np.zeros((b, T), dtype=np.int32)
        for r, row in enumerate(mine):
            starts, lengths = self._pieces.starts[row], self._pieces.lengths[row]
            tokens, flags = self.dataset.ranges(starts, lengths + 1)
            at = src = 0
            for d, length in enumerate(lengths.tolist()):
                inputs[r, at:at + length] = tokens[src:src + length]
                targets[r, at:at + length] = tokens[src + 1:src + length + 1]
                trained[r, at:at + length] = flags[src + 1:src + length + 1]
                documents[r, at:at + length] = d
                at += length
                src += length + 1
            documents[r, at:] = len(lengths)  # the padding: a document of its own, untrained
        self._check_ids(inputs, lambda row: f"row {row}")
        self._check_ids(targets, lambda row: f"row {row}")
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets),
                     torch.from_numpy(trained), torch.from_numpy(documents))

    # ---- batches ----------------------------------------------------------------------------

    def next_batch(self) -> Batch:
        """This rank's rows of the next global batch: (batch_size // num_shards, seq_len) each."""
        number = self.batches_drawn
        self.batches_drawn += 1
        if self._stream is not None:
            return self._local_packed(self._stream.rows(number * self.batch_size,
                                                        self.batch_size))
        return self._local_windows(self._global_offsets(number))

    def eval_batches(self, n: int) -> list[Batch]:
        """n fixed batches, the same on every call: windows (or packed rows) evenly spaced over
        the split."""
        if n < 0:
            raise DataError(f"eval batches = {n}: expected a non-negative integer")
        if n == 0:
            return []
        if self._pieces is not None:
            rows = eval_rows(self._pieces, self.seq_len, n * self.batch_size)
            return [self._local_packed(rows[i * self.batch_size:(i + 1) * self.batch_size])
                    for i in range(n)]
        last_start = len(self.dataset) - self.seq_len - 1
        starts = np.linspace(0, last_start, n * self.batch_size).round().astype(np.int64)
        return [self._local_windows(starts[i * self.batch_size:(i + 1) * self.batch_size])
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
            "packing": self.packing,
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
        if seed != self.seed and self._pieces is not None:
            self._stream = RowStream(self._pieces, self.seq_len, seed)
        self.seed = seed
        self.batches_drawn = drawn


def documents(data_dir: str | Path, split: str, n: int) -> list[np.ndarray]:
    """The token ids (int64) of the first n documents of a split: text without the EOS that
    ends it, a chat or an instruction as its template renders it."""
    dataset = TokenDataset(data_dir, split)
    if n <= 0:
        return []
    if dataset.document_starts is not None:
        ends = np.append(dataset.document_starts[1:], dataset.num_tokens)
        drop = 1 if dataset.manifest.data_format == "text" else 0  # the EOS after a text
        return [dataset.window(int(a), int(b - a - drop))
                for a, b in zip(dataset.document_starts[:n], ends[:n])]
    eos = dataset.eos_id
    docs: list[np.ndarray] = []
    carry: list[np.ndarray] = []  # the start of a document that continues in the next chunk
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
    """Check every file's size and sha256 (token shards, trained masks, document indexes) and
    the stored tokenizer; DataError on a mismatch."""
    data_dir = Path(data_dir)
    manifest = Manifest.load(data_dir)
    token_bytes = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        index = (split.document_index,) if split.document_index is not None else ()
        sized = ([(f, token_bytes) for f in split.shards] + [(f, 1) for f in split.trained]
                 + [(f, 8) for f in index])
        for shard, itemsize in sized:
            path = data_dir / shard.file
            if not path.is_file():
                raise DataError(f"{path}: file listed in manifest.json is missing")
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
