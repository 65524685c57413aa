"""Causal attention over packed documents: a position attends to the earlier positions of its
own document only, and positions (RoPE's) restart at 0 in each document, so that a document's
logits inside a packed row are its logits alone.

The batch's rows are laid end to end, (B * T, heads, head_dim), and cut into documents. Which
kernel runs:
- on a GPU, variable-length flash attention (torch.nn.attention.varlen) for half-precision
  inputs, else flex attention (compiled) with a block mask of document x causal: both skip the
  work between documents;
- elsewhere (and as the reference) each document runs its own causal SDPA, and runs of short
  documents (SMALL_GROUP_TOKENS together) one SDPA with a block-diagonal causal mask: its
  attention costs the sum of its documents' squared lengths, less than a row's causal
  attention over all of them (bench/packing.py measures the step).
`attention_kernel` says which one a tensor gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# Consecutive documents shorter than this run as one SDPA call with a block-diagonal mask (one
# call's overhead against their masked-out products).
SMALL_GROUP_TOKENS = 128


@dataclass
class PackedDocuments:
    """Where the documents of a batch of packed rows are: read once per forward on the host,
    used by every layer."""

    rows: int
    seq_len: int
    lengths: list[int]  # each document's length, row after row
    positions: torch.Tensor  # (B, T) int64 on the device: each position's index in its document
    groups: list[list[int]] = field(default_factory=list)  # the CPU kernel's SDPA calls
    _masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _cumulative: torch.Tensor | None = field(default=None, repr=False)
    _flex_mask: object = field(default=None, repr=False)

    @classmethod
    def from_ids(cls, documents: torch.Tensor, device: torch.device) -> PackedDocuments:
        """From each position's document number in its row, (B, T) (a loader's batch.documents,
        best on the host: read there without a device sync)."""
        ids = documents.detach().cpu().numpy()
        B, T = ids.shape
        starts = np.ones((B, T), dtype=bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        index = np.broadcast_to(np.arange(T), (B, T))
        first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        positions = torch.from_numpy(np.ascontiguousarray(index - first))
        bounds = np.append(np.flatnonzero(starts.reshape(-1)), B * T)
        lengths = np.diff(bounds).tolist()
        if device.type == "cuda":
            positions = positions.pin_memory().to(device, non_blocking=True)
        else:
            positions = positions.to(device)
        return cls(B, T, lengths, positions, _group(lengths))

    @property
    def one_per_row(self) -> bool:
        """Whether every row is a single document (plain causal attention is the same)."""
        return len(self.lengths) == self.rows

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's tables (max_seq_len, head_dim) at each position of the rows laid end to end:
        (B * T, 1, head_dim) each, to broadcast over the heads."""
        flat = self.positions.reshape(-1)
        return cos[flat].unsqueeze(1), sin[flat].unsqueeze(1)

    def block_mask(self, members: list[int]) -> torch.Tensor:
        """Causal within each of `members` (consecutive document lengths), False across."""
        key = tuple(members)
        if key not in self._masks:
            ids = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(members))
            size = len(ids)
            causal = torch.ones(size, size, dtype=torch.bool).tril()
            self._masks[key] = (ids[:, None] == ids[None, :]) & causal
        return self._masks[key]

    def cumulative(self, device: torch.device) -> torch.Tensor:
        """Document offsets in the laid-out rows, (documents + 1,) int32 (varlen's cu_seqlens)."""
        if self._cumulative is None:
            offsets = torch.tensor(np.cumsum([0] + self.lengths), dtype=torch.int32)
            self._cumulative = offsets.to(device, non_blocking=True)
        return self._cumulative


def _group(lengths: list[int]) -> list[list[int]]:
    """Documents in SDPA calls: a long one alone, runs of short ones together."""
    groups: list[list[int]] = []
    open_tokens = 0  # tokens in the last group while it takes more short documents, else 0
    for length in lengths:
        short = length < SMALL_GROUP_TOKENS
        if short and open_tokens and open_tokens + length <= SMALL_GROUP_TOKENS:
            groups[-1].append(length)
            open_tokens += length
        else:
            groups.append([length])
            open_tokens = length if short else 0
    return groups


def attention_kernel(q: torch.Tensor) -> str:
    """The kernel packed attention runs for `q`: "varlen", "flex" or "split" (the reference,
    every device)."""
    if q.device.type != "cuda":
        return "split"
    if q.dtype in (torch.float16, torch.bfloat16) and _varlen_available():
        return "varlen"
    if _flex_available():
        return "flex"
    return "split"


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: PackedDocuments) -> torch.Tensor:
    """Causal attention inside each document. q (B * T, n_head, head_dim), k and v
    (B * T, n_kv, head_dim), RoPE applied -> (B * T, n_head, head_dim)."""
    kernel = attention_kernel(q)
    if kernel == "varlen":
        return _varlen(q, k, v, documents)
    if kernel == "flex":
        return _flex(q, k, v, documents)
    return split_attention(q, k, v, documents)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    documents: PackedDocuments) -> torch.Tensor:
    """The reference kernel: one SDPA per document (per group of short ones)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    sizes = [sum(g) for g in documents.groups]
    outputs = []
    for group, qg, kg, vg in zip(documents.groups, q.split(sizes), k.split(sizes),
                                 v.split(sizes)):
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (qg, kg, vg))  # (1, h, L, hd)
        if len(group) == 1:
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        else:
            mask = documents.block_mask(group).to(q.device)
            y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        outputs.append(y[0].transpose(0, 1))
    return torch.cat(outputs)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            documents: PackedDocuments) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cumulative = documents.cumulative(q.device)
    longest = max(documents.lengths)
    return varlen_attn(q, k, v, cumulative, cumulative, longest, longest,
                       window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          documents: PackedDocuments) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if documents._flex_mask is None:  # one mask for every layer of the forward
        ids = torch.repeat_interleave(torch.arange(len(documents.lengths), device=q.device),
                                      torch.tensor(documents.lengths, device=q.device))

        def document_causal(b, h, q_index, kv_index):  # noqa: ANN001, ANN202 (flex's API)
            return (ids[q_index] == ids[kv_index]) & (q_index >= kv_index)

        size = len(ids)
        documents._flex_mask = create_block_mask(document_causal, None, None, size, size,
                                                 device=q.device)
    attend = torch.compile(flex_attention, dynamic=False)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, h, B * T, hd)
    y = attend(qh, kh, vh, block_mask=documents._flex_mask,
               enable_gqa=q.shape[1] != k.shape[1])
    return y[0].transpose(0, 1)


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.backends.cuda.is_flash_attention_available()


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["PackedDocuments", "SMALL_GROUP_TOKENS", "attention_kernel", "packed_attention",
           "split_attention"]
