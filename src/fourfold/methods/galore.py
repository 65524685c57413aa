"""GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection"): AdamW whose moments live in a rank-r projection of the gradient of each of the
attention and MLP matrices; the other parameters get the same AdamW, unprojected.

The defaults are the paper's and galore-torch's (its GaLoreAdamW, the authors' code): the
attention and MLP matrices projected, a quarter of each one's smaller side as the rank (the
paper's 128 for 60M, 256 for 350M, 1024 for 7B), a refresh every 200 steps, the projected
update scaled by 0.25, galore-torch's "std" projection (the smaller side), Adam's eps 1e-6
added to sqrt(v) before the bias correction, the weight decay (none by default, as in the
paper's runs) after the step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, at_least, positive

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

# A projection refresh gathers a matrix's shard a chunk of columns (rows) at a time, this many
# bytes of float32 of the full small side, and a step works a block of this many bytes of the
# gradient at a time (train/methods/galore.py; the planner: plan/methods/galore.py)
CHUNK_BYTES = 4 * 2**20

# train.method.targets: the matrices GaLore projects, named as adapter.targets names layers,
# and each one's leaf module name; "embed" and "output" are the embedding and output layer
TARGET_LEAVES = {**{t: f"{t}_proj" for t in ("q", "k", "v", "o", "gate", "up", "down")},
                 "output": "output", "embed": "embed"}
# train.method.proj_type, as galore-torch names them: which side of an m x n gradient G is
# projected. "std": the smaller (left, P^T G, when m < n; else right, G Q); "reverse_std":
# the larger; "left", "right": that side whatever the shape; "full": both, P^T G Q
PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


@dataclass
class GaLoreOptions(MethodOptions):
    # the projection's rank; 0: a quarter of each matrix's smaller side
    rank: int = 0
    # steps between refreshes of the projection
    gap: int = 200
    # the projected update is multiplied by this (the paper's alpha; galore-torch's scale)
    scale: float = 0.25
    # the matrices projected (names as adapter.targets, and "embed"); the rest get AdamW
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up",
                                                        "down"])
    # which side of each gradient is projected (PROJ_TYPES)
    proj_type: str = "std"
    # Adam's epsilon, added to sqrt(v) before the bias correction (galore-torch's AdamW)
    eps: float = 1e-6

    def check(self, train: TrainConfig) -> None:
        if self.rank < 0:
            raise ConfigError(f"train.method.rank = {self.rank}: must be a positive rank, or 0 "
                              "for a quarter of each matrix's smaller side")
        at_least("gap", self.gap, 1)
        positive("scale", self.scale)
        positive("eps", self.eps)
        unknown = [t for t in self.targets if t not in TARGET_LEAVES]
        if unknown:
            raise ConfigError(f"train.method.targets: {unknown[0]!r} is not a matrix of the "
                              f"model; choose from {', '.join(TARGET_LEAVES)}")
        if self.proj_type not in PROJ_TYPES:
            raise ConfigError(f"train.method.proj_type = {self.proj_type!r}: choose one of "
                              f"{', '.join(PROJ_TYPES)}")


def projection_rank(full_shape: tuple[int, ...], rank: int) -> int:
    """The projection rank of a matrix: `rank` (0: a quarter of the smaller side), at most the
    smaller side, at least 1."""
    small = min(full_shape)
    return max(1, min(small, rank if rank > 0 else small // 4))


def is_target(name: str, targets: list[str]) -> bool:
    """Whether the weight matrix named `name` (fourfold's parameter name, such as
    layers.0.attn.q_proj.weight) is one of `targets`."""
    parts = name.split(".")
    leaves = {TARGET_LEAVES[t] for t in targets}
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in leaves


def projected_sides(full_shape: tuple[int, ...], proj_type: str) -> tuple[str, ...]:
    """The sides of an m x n gradient that `proj_type` projects: ("left",) for P^T G (P: m x
    r), ("right",) for G Q (Q: n x r), both for "full" (galore-torch's choice: "std" takes the
    right side when m >= n)."""
    m, n = full_shape
    if proj_type == "std":
        return ("left",) if m < n else ("right",)
    if proj_type == "reverse_std":
        return ("right",) if m < n else ("left",)
    if proj_type == "full":
        return ("left", "right")
    return (proj_type,)


# at a batch worth a GPU its peak holds the logits, which the blocked loss keeps to a block of
# the vocabulary; at a few hundred tokens it comes later, with R
METHODS = (MethodSpec("galore", GaLoreOptions, "fourfold.train.methods.galore:GaLore",
                      "fourfold.plan.methods.galore:GALORE", weight_decay=0.0,
                      blocked_loss=True, renamed={"galore_rank": "rank", "galore_gap": "gap"}),)
