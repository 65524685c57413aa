"""Initial values defined tile by tile, so that any block of a tensor can be computed alone.

A normal-distributed tensor is cut into fixed tiles of TILE_ROWS x TILE_COLS elements (of its
last two dims; the edge tiles are smaller). Each tile is drawn from its own generator, seeded
by (seed, tensor name, tile index). The tiling depends on the tensor's shape only, never on the
grid, so a rank that holds a shard draws just the tiles its shard covers, and the gathered
shards of any grid equal the whole tensor drawn on one process, bit for bit. Tiles are drawn on
the CPU for the same reason: CPU and CUDA generators give different numbers.
"""

from __future__ import annotations

import hashlib

import torch

TILE_ROWS = 1024
TILE_COLS = 1024

Index = tuple[slice, ...]


def tile_seed(seed: int, name: str, tile: tuple[int, int]) -> int:
    """A 63-bit generator seed for one tile of the tensor `name` (stable across processes)."""
    key = f"{seed}/{name}/{tile[0]}/{tile[1]}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _as_2d(full_shape: tuple[int, ...], index: Index) -> tuple[tuple[int, int], slice, slice]:
    """(rows, cols) of the tensor seen as a matrix (leading dims folded into rows; a vector is
    one row), and the rows/cols that `index` selects."""
    if len(full_shape) == 1:
        return (1, full_shape[0]), slice(0, 1), index[0]
    if len(full_shape) == 2:
        return (full_shape[0], full_shape[1]), index[0], index[1]
    raise ValueError(f"tiled initialisation covers 1-d and 2-d tensors, not shape {full_shape}")


def normal_block(seed: int, name: str, full_shape: tuple[int, ...], index: Index,
                 std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block `index` (one slice per dim, steps of 1) of the tensor `name` of shape `full_shape`
    whose elements are N(0, std^2), on the CPU."""
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, full_shape))
    (rows, cols), rs, cs = _as_2d(full_shape, index)
    out = torch.empty(rs.stop - rs.start, cs.stop - cs.start, dtype=torch.float32)
    generator = torch.Generator()
    for tr in range(rs.start // TILE_ROWS, -(-rs.stop // TILE_ROWS) if rs.stop > rs.start else 0):
        r0, r1 = tr * TILE_ROWS, min((tr + 1) * TILE_ROWS, rows)
        for tc in range(cs.start // TILE_COLS,
                        -(-cs.stop // TILE_COLS) if cs.stop > cs.start else 0):
            c0, c1 = tc * TILE_COLS, min((tc + 1) * TILE_COLS, cols)
            generator.manual_seed(tile_seed(seed, name, (tr, tc)))
            tile = torch.randn(r1 - r0, c1 - c0, generator=generator)
            # the part of this tile inside the block
            a0, a1 = max(r0, rs.start), min(r1, rs.stop)
            b0, b1 = max(c0, cs.start), min(c1, cs.stop)
            out[a0 - rs.start:a1 - rs.start, b0 - cs.start:b1 - cs.start] = \
                tile[a0 - r0:a1 - r0, b0 - c0:b1 - c0]
    out.mul_(std)
    shape = tuple(s.stop - s.start for s in index)
    return out.reshape(shape).to(dtype)
