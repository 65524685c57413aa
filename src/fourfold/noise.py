"""Counter-based Gaussian noise keyed by (seed, step, parameter name, member, global position).

Every element's value is a pure function of its key and its coordinates in the *full* tensor,
so a shard draws exactly its part of the noise a single process draws for the whole tensor:
every grid perturbs the same global weights identically, and nothing but the key is stored. The
generator is MurmurHash3's 32-bit finaliser folded over the coordinates (int32 tensors, whose
products wrap), then Box-Muller in float32; it owns no state and never touches torch's global
generator.

It sits below train/ and plan/: MeZO and ES (train/methods/zeroth.py) perturb weights with it,
and the planner models its cost (plan/perf.py, from its chunk sizes) and the cpu machine's
probe times it.
"""

from __future__ import annotations

import math
import zlib

import torch

from fourfold.methods.zeroth import ACCELERATOR_NOISE_CHUNK_ELEMENTS, NOISE_CHUNK_ELEMENTS

_M32 = 0xFFFFFFFF
# noise is made a row block at a time: CHUNK_ELEMENTS of float32 per temporary on a CPU,
# ACCELERATOR_CHUNK_ELEMENTS on a GPU (fourfold.methods.zeroth says why)
CHUNK_ELEMENTS = NOISE_CHUNK_ELEMENTS
ACCELERATOR_CHUNK_ELEMENTS = ACCELERATOR_NOISE_CHUNK_ELEMENTS


def chunk_elements(device: torch.device) -> int:
    """Elements of noise made per chunk on `device`."""
    return CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


def _s32(v: int) -> int:
    """A uint32 as the int32 with the same bits."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


_C1, _C2, _C3 = _s32(0x85EBCA6B), _s32(0xC2B2AE35), _s32(0x9E3779B9)


def mix32_int(h: int) -> int:
    """MurmurHash3's finaliser on a Python int (the reference for mix32)."""
    h &= _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def mix32(h: torch.Tensor) -> torch.Tensor:
    """mix32_int on an int32 tensor (bits as uint32): shifts are made logical by masking."""
    g = h >> 16
    h = h ^ g.bitwise_and_(0xFFFF)  # a new tensor: the caller's stays as it was
    h.mul_(_C1)
    g = h >> 13
    h.bitwise_xor_(g.bitwise_and_(0x7FFFF))
    h.mul_(_C2)
    g = h >> 16
    return h.bitwise_xor_(g.bitwise_and_(0xFFFF))


def noise_key(seed: int, step: int, name: str, member: int = 0) -> int:
    """A 32-bit key for one tensor's noise at one step (and one ES population member)."""
    h = mix32_int(zlib.crc32(name.encode()))
    for word in (member, step & _M32, step >> 32, seed & _M32, seed >> 32):
        h = mix32_int(h ^ mix32_int(word + 0x9E3779B9))
    return h


def _hash_at(coords: list[torch.Tensor], key: int) -> torch.Tensor:
    """Fold the key over each dim's coordinates (outer first): (len(c0), len(c1), ...) int32."""
    h = torch.full((), _s32(key), dtype=torch.int32, device=coords[0].device)
    for c in coords:
        h = mix32(h.unsqueeze(-1) ^ c) if h.dim() or c.dim() else mix32(h ^ c)
    return h


def gaussian_at(coords: list[torch.Tensor], key: int) -> torch.Tensor:
    """Standard normal values (float32) on the grid of global coordinates `coords` (one int32
    vector per tensor dim)."""
    h1 = _hash_at(coords, key)
    h2 = mix32(h1 ^ _C3)
    # 24 bits each: u1 in (0, 1), so the log is finite (|z| <= 5.9)
    u1 = (((h1 >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / 2**24)
    u2 = ((h2 >> 8) & 0xFFFFFF).float() * (1.0 / 2**24)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


class ShardNoise:
    """The noise of one local shard: where its elements sit in the full tensor."""

    def __init__(self, local_shape: tuple[int, ...], full_shape: tuple[int, ...],
                 offsets: tuple[int, ...], device: torch.device) -> None:
        if any(n >= 1 << 31 for n in full_shape):
            raise ValueError(f"a tensor dim of {max(full_shape)} elements is too long for the "
                             "noise generator's int32 coordinates")
        self.local_shape, self.offsets, self.device = local_shape, offsets, device
        inner = 1
        for n in local_shape[1:]:
            inner *= n
        self.rows_per_chunk = max(1, chunk_elements(torch.device(device)) // max(1, inner))

    def chunks(self) -> list[tuple[int, int]]:
        """Row ranges [start, stop) of dim 0 in which noise is made."""
        rows = self.local_shape[0] if self.local_shape else 1
        return [(r, min(rows, r + self.rows_per_chunk)) for r in range(0, rows, self.rows_per_chunk)]

    def sample(self, start: int, stop: int, key: int) -> torch.Tensor:
        """Noise of local rows [start, stop): shape (stop - start, *local_shape[1:])."""
        if not self.local_shape:  # a scalar parameter
            coords = [torch.zeros(1, dtype=torch.int32, device=self.device)]
        else:
            coords = [torch.arange(lo + off, hi + off, dtype=torch.int32, device=self.device)
                      for lo, hi, off in ((start, stop, self.offsets[0]),
                                          *((0, n, o) for n, o in zip(self.local_shape[1:],
                                                                      self.offsets[1:])))]
        return gaussian_at(coords, key)
