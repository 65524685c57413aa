"""BlockLLM (Ramesh et al. 2024, "BlockLLM: Memory-Efficient Adaptation of LLMs by Selecting
and Optimizing the Right Coordinate Blocks"): AdamW on a selected share of the rows."""

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


@dataclass
class BlockLLMOptions(MethodOptions):
    # the share of the parameters frozen at a time
    sparsity: float = 0.9
    # steps without a better loss before the blocks are chosen again (1: a batch loss is
    # noisy, so after most steps; bench/lean_quality.py compares settings)
    patience: int = 1

    def check(self, train: TrainConfig) -> None:
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"train.method.sparsity = {self.sparsity}: the share of the "
                              "parameters frozen must be in [0, 1)")
        at_least("patience", self.patience, 1)


METHODS = (MethodSpec("blockllm", BlockLLMOptions, "fourfold.train.methods.blockllm:BlockLLM",
                      "fourfold.plan.methods.blockllm:BLOCKLLM", weight_decay=0.1,
                      blocked_loss=True,
                      renamed={"block_sparsity": "sparsity", "block_patience": "patience"}),)
