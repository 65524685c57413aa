"""The goldfish loss (Hans et al. 2024, "Be like a Goldfish, Don't Memorize!").

About 1/k of the target tokens are left out of the loss. Which ones is decided by hashing the
h tokens that precede each target, so the choice depends only on the text: a passage repeated
in another document, batch row, offset, rank or epoch drops exactly the same tokens, and the
model never sees those tokens as targets after that context. It cannot reproduce the passage
verbatim, yet it still learns from about (k-1)/k of the tokens.

The trainer applies the mask as `(per_token_loss * mask).sum() / global_mask_count`.
"""

from __future__ import annotations

import torch

from fourfold.config import ConfigError

# A Mersenne prime: products of two residues (< 2**31) stay inside int64.
_PRIME = 2**31 - 1
# Fixed constants, so every process and every run agrees (Python's hash() is salted per process).
_BASE = 1_000_003
_TOKEN_MULTIPLIER = 747_796_405
_TOKEN_OFFSET = 2_891_336_453 % _PRIME
_MIX_MULTIPLIER = 0x45D9F3B
_LOW_32_BITS = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A fixed avalanche on values below 2**32: nearby contexts give unrelated results, so the
    dropped positions of overlapping windows are not correlated. Products stay below 2**59."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * _MIX_MULTIPLIER) & _LOW_32_BITS
    return x ^ (x >> 16)


def context_hash(inputs: torch.Tensor, h: int) -> torch.Tensor:
    """Hash of every window of h consecutive tokens: (b, T) int64 -> (b, T - h + 1) int64 in
    [0, 2**32). Entry j hashes inputs[:, j : j + h]; the same h tokens always give the same value.

    A polynomial hash modulo a prime over the tokens (each first mapped by a fixed affine map so
    that token 0 does not vanish), followed by an integer mixer; all in int64 torch ops.
    """
    tokens = torch.remainder(inputs.long(), _PRIME)
    tokens = (tokens * _TOKEN_MULTIPLIER + _TOKEN_OFFSET) % _PRIME  # < 2**62 before the mod
    powers = torch.ones(h, dtype=torch.int64, device=inputs.device)
    for i in range(h - 2, -1, -1):  # powers[i] = BASE ** (h - 1 - i) mod PRIME
        powers[i] = powers[i + 1] * _BASE % _PRIME
    windows = tokens.unfold(1, h, 1)  # (b, T - h + 1, h)
    # Each term < 2**31 after the mod, so the sum of h terms cannot overflow int64.
    poly = ((windows * powers) % _PRIME).sum(dim=-1) % _PRIME
    return _mix32(poly)


def goldfish_mask(inputs: torch.Tensor, targets: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Which target tokens count in the loss: a bool (b, T) mask, False for the dropped ones.

    inputs and targets are int64 (b, T) with targets[:, t] the token after inputs[:, t]. Target t
    is dropped when hash(inputs[:, t-h+1 .. t]) % k == 0, that is, when the hash of the h tokens
    just before the target is a multiple of k: about 1/k of the targets are dropped.

    The first h-1 targets of a row have fewer than h tokens of context inside the window; like the
    paper's reference code, they are always kept (never dropped). That keeps the mask a function of
    the text alone: a position whose h-token context lies inside the window gets the same verdict
    in any row, at any offset, on any rank, in any epoch.

    k must be at least 2 (k = 1 would drop every token) and h at least 1.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ConfigError(f"train.goldfish_k = {k!r}: must be an integer of at least 2 "
                          "(the loss drops 1 in k tokens; k = 1 would drop them all)")
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise ConfigError(f"train.goldfish_h = {h!r}: must be an integer of at least 1 "
                          "(the number of preceding tokens hashed)")
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(f"goldfish_mask: inputs {tuple(inputs.shape)} and targets "
                         f"{tuple(targets.shape)} must both be (batch, seq_len)")
    b, T = inputs.shape
    mask = torch.ones(b, T, dtype=torch.bool, device=inputs.device)
    if T >= h:
        # window j covers inputs[:, j .. j+h-1], the context of target t = j + h - 1
        mask[:, h - 1:] = context_hash(inputs, h) % k != 0
    return mask
