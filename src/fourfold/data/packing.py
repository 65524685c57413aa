"""Packing documents into sequences that keep their boundaries (data.packing = "documents").

A document of L tokens gives L - 1 (input, target) positions: its tokens predict the next one
inside it, never the first of another document. A document with more positions than seq_len is
cut into pieces of at most seq_len positions, each its own document for attention (its
positions restart at 0). Pieces are packed into rows of seq_len positions; a row's unused tail
is padding, a document of its own whose targets are not trained.

Which pieces share a row: each epoch the pieces are shuffled by a generator seeded by (seed,
epoch), then taken PACK_CHUNK at a time and packed best-fit decreasing (each piece, longest
first, into the fullest row it still fits), and the chunk's rows are shuffled. The row stream
is the epochs' rows one after the other; the global batch k is rows [k * B, (k + 1) * B) of it,
a function of (seed, k) alone, like the windows of unpacked data.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

PACK_CHUNK = 8192  # pieces packed together; larger packs tighter and costs more per epoch


@dataclass(frozen=True)
class Pieces:
    """Documents cut into pieces of at most seq_len positions. Piece i reads the tokens
    [starts[i], starts[i] + lengths[i] + 1) of the split: inputs all but the last, targets
    all but the first."""

    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64, positions (tokens - 1)

    def __len__(self) -> int:
        return len(self.starts)


def document_pieces(document_starts: np.ndarray, num_tokens: int, seq_len: int) -> Pieces:
    """The pieces of a split whose documents begin at `document_starts` (sorted) and whose
    last document ends at `num_tokens`."""
    starts = np.asarray(document_starts, dtype=np.int64)
    positions = np.diff(np.append(starts, num_tokens)) - 1
    keep = positions > 0  # a one-token document predicts nothing
    starts, positions = starts[keep], positions[keep]
    count = -(-positions // seq_len)  # pieces per document
    first = np.repeat(starts, count)
    index = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count,
                                                                    count)
    piece_starts = first + index * seq_len
    remaining = np.repeat(positions, count) - index * seq_len
    return Pieces(piece_starts, np.minimum(remaining, seq_len))


def pack_rows(lengths: np.ndarray, seq_len: int,
              rng: np.random.Generator | None) -> list[np.ndarray]:
    """Rows of piece indices (into `lengths`), each summing to at most seq_len positions: the
    pieces in order (shuffled first when `rng` is given), PACK_CHUNK at a time, best-fit
    decreasing; with `rng` each chunk's rows are shuffled too."""
    order = rng.permutation(len(lengths)) if rng is not None else np.arange(len(lengths))
    rows: list[np.ndarray] = []
    for begin in range(0, len(order), PACK_CHUNK):
        chunk = order[begin:begin + PACK_CHUNK]
        chunk_rows = _best_fit_decreasing(chunk, lengths[chunk], seq_len)
        if rng is not None:
            chunk_rows = [chunk_rows[i] for i in rng.permutation(len(chunk_rows))]
        rows.extend(chunk_rows)
    return rows


def _best_fit_decreasing(pieces: np.ndarray, lengths: np.ndarray,
                         seq_len: int) -> list[np.ndarray]:
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(int(pieces[i]))
        if room - need > 0:
            bisect.insort(free, (room - need, row))
    return [np.asarray(r, dtype=np.int64) for r in rows]


class RowStream:
    """The packed rows of a split, epoch after epoch, each a function of (seed, epoch); epochs
    are packed when first reached and kept."""

    def __init__(self, pieces: Pieces, seq_len: int, seed: int) -> None:
        self.pieces = pieces
        self.seq_len = seq_len
        self.seed = seed
        self._epochs: list[list[np.ndarray]] = []
        self._first_row: list[int] = [0]  # the stream index of each epoch's first row

    def rows(self, first: int, count: int) -> list[np.ndarray]:
        """Rows [first, first + count) of the stream (piece indices each)."""
        out: list[np.ndarray] = []
        index = first
        while len(out) < count:
            epoch = self._epoch_of(index)
            local = index - self._first_row[epoch]
            rows = self._epochs[epoch]
            take = rows[local:local + count - len(out)]
            out.extend(take)
            index += len(take)
        return out

    def _epoch_of(self, index: int) -> int:
        while index >= self._first_row[-1]:
            epoch = len(self._epochs)
            rng = np.random.default_rng([self.seed, epoch, 0x9AC4])
            self._epochs.append(pack_rows(self.pieces.lengths, self.seq_len, rng))
            self._first_row.append(self._first_row[-1] + len(self._epochs[-1]))
        return bisect.bisect_right(self._first_row, index) - 1


def eval_rows(pieces: Pieces, seq_len: int, count: int) -> list[np.ndarray]:
    """`count` rows evenly spaced over the split's rows packed in document order: the same
    rows every time, spread over the whole validation split."""
    rows = pack_rows(pieces.lengths, seq_len, rng=None)
    picks = np.linspace(0, len(rows) - 1, count).round().astype(np.int64)
    return [rows[i] for i in picks]


__all__ = ["PACK_CHUNK", "Pieces", "RowStream", "document_pieces", "eval_rows", "pack_rows"]
