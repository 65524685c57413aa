"""BlockLLM (Ramesh et al. 2024, "BlockLLM: Memory-Efficient Adaptation of LLMs by Selecting
and Optimizing the Right Coordinate Blocks"): AdamW on a selected share of the parameters.

The defaults are the paper's and its authors' code's: a block is a whole tensor; the blocks
are ranked by gradient norm over a visit-frequency penalty, exp(f / t) with f the block's share
of the visits (one each at the start, one more at each selection by gradient) and t the step;
they are taken in that order while their elements stay under (1 - sparsity) of the
candidates'; the first choice is random; the choice is made again when the average loss since
the last one is below the average of the last `patience` (100) losses (the loss has stopped
falling), with Adam's moments reset; the embedding and output layer are never trained; no
weight decay (the authors' code gives its Adam none).
fourfold's earlier variant is a set of options: block_unit = "row", reselect = "best",
keep_moments, first_choice = "gradient", train_embed_output, visit_penalty = false."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, at_least

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

# A selection's backward keeps each handed-off gradient whole (no copy) until the rows it
# holds exceed the budget by this share of all elements, then ranks them and keeps the
# budget's worth (train/methods/blockllm.py): a few rankings a selection whatever the number
# of tensors, for up to this share of the gradients' bytes more at its peak (the planner
# counts it: plan/methods/blockllm.py)
HOLD_SLACK = 0.05

BLOCK_UNITS = ("tensor", "row")
RESELECT_RULES = ("average", "best")
FIRST_CHOICES = ("random", "gradient")
# the parameters train_embed_output = false leaves frozen: the embedding and the output layer
EMBED_OUTPUT = ("embed.weight", "output.weight")


@dataclass
class BlockLLMOptions(MethodOptions):
    # the share of the parameters frozen at a time
    sparsity: float = 0.9
    # "average": the blocks are chosen again once the average loss since the last choice is
    # below the average of the last `patience` losses (the paper's); "best": once the loss has
    # not beaten its best for `patience` steps
    reselect: str = "average"
    patience: int = 100
    # a block: a whole tensor (the paper's) or one row of it (a vector: the whole of it)
    block_unit: str = "tensor"
    # the first choice: random blocks (the paper's, seeded by train.seed) or by gradient norm
    first_choice: str = "random"
    # divide each tensor's gradient norm by exp(f / t) (f: its share of the visits, t: the step)
    visit_penalty: bool = True
    # keep the Adam moments of rows chosen again (the paper resets Adam at every choice)
    keep_moments: bool = False
    # the embedding and output layer among the candidates (the paper freezes them)
    train_embed_output: bool = False

    def check(self, train: TrainConfig) -> None:
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"train.method.sparsity = {self.sparsity}: the share of the "
                              "parameters frozen must be in [0, 1)")
        at_least("patience", self.patience, 1)
        for key, allowed in (("reselect", RESELECT_RULES), ("block_unit", BLOCK_UNITS),
                             ("first_choice", FIRST_CHOICES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"train.method.{key} = {getattr(self, key)!r}: choose one of "
                                  f"{', '.join(allowed)}")


METHODS = (MethodSpec("blockllm", BlockLLMOptions, "fourfold.train.methods.blockllm:BlockLLM",
                      "fourfold.plan.methods.blockllm:BLOCKLLM", weight_decay=0.0,
                      blocked_loss=True,
                      renamed={"block_sparsity": "sparsity", "block_patience": "patience"}),)
