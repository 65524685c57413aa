"""GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection"): AdamW whose moments live in a rank-r projection of each matrix's gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, at_least

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

# A projection refresh gathers a matrix's shard a chunk of columns (rows) at a time, this many
# bytes of float32 of the full small side, and a step works a block of this many bytes of the
# gradient at a time (train/methods/galore.py; the planner: plan/methods/galore.py)
CHUNK_BYTES = 4 * 2**20


@dataclass
class GaLoreOptions(MethodOptions):
    # the projection's rank; 0: a quarter of each matrix's smaller side
    rank: int = 0
    # steps between refreshes of the projection
    gap: int = 200

    def check(self, train: TrainConfig) -> None:
        if self.rank < 0:
            raise ConfigError(f"train.method.rank = {self.rank}: must be a positive rank, or 0 "
                              "for a quarter of each matrix's smaller side")
        at_least("gap", self.gap, 1)


def projection_rank(full_shape: tuple[int, ...], rank: int) -> int:
    """The projection rank of a matrix: `rank` (0: a quarter of the smaller side), at most the
    smaller side, at least 1."""
    small = min(full_shape)
    return max(1, min(small, rank if rank > 0 else small // 4))


# at a batch worth a GPU its peak holds the logits, which the blocked loss keeps to a block of
# the vocabulary; at a few hundred tokens it comes later, with R
METHODS = (MethodSpec("galore", GaLoreOptions, "fourfold.train.methods.galore:GaLore",
                      "fourfold.plan.methods.galore:GALORE", weight_decay=0.1,
                      blocked_loss=True, renamed={"galore_rank": "rank", "galore_gap": "gap"}),)
