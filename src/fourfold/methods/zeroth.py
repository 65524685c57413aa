"""Training from forward passes alone: MeZO (Malladi et al. 2023, "Fine-Tuning Language Models
with Just Forward Passes") and evolution strategies (after OpenAI-ES and EA4LLM). Neither
decays the weights by default (nor do their papers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, at_least, positive

if TYPE_CHECKING:
    from fourfold.config import TrainConfig

# Seeded noise (fourfold/noise.py) is made a row block at a time: this many float32
# elements per temporary on a CPU (1 MiB: the generator's ~30 element-wise passes then run in
# a core's L2 cache), and on an accelerator, where those passes cost their launches more
# than their bytes, this many (16 MiB). The values do not depend on the chunking. Other
# blockwise work of the methods (row norms, AdaLomo's statistics) uses the same sizes.
NOISE_CHUNK_ELEMENTS = 1 << 18
ACCELERATOR_NOISE_CHUNK_ELEMENTS = 1 << 22


@dataclass
class MeZOOptions(MethodOptions):
    """MeZO: the projected gradient along one seeded direction per step."""

    eps: float = 1e-3  # the size of the two-sided perturbation

    def check(self, train: TrainConfig) -> None:
        positive("eps", self.eps)


# how a member's loss becomes its weight in the update (ESOptions.fitness)
FITNESS_SHAPINGS = ("baseline", "centered_rank", "zscore")


@dataclass
class ESOptions(MethodOptions):
    """Evolution strategies: `population` seeded members a step, spread over data replicas.
    The defaults are plain ES with the population's mean loss as baseline; `antithetic = true`
    with `fitness = "centered_rank"` is OpenAI-ES (Salimans et al. 2017); `fitness = "zscore"`
    is EA4LLM's normalization."""

    population: int = 8  # perturbed members per step
    sigma: float = 1e-3  # the size of each member's perturbation
    # members in mirrored pairs w + sigma z, w - sigma z (population / 2 directions a step)
    antithetic: bool = False
    # "baseline": a member's weight is its loss less the population's mean; "centered_rank":
    # its rank among the population's losses mapped evenly onto [-0.5, 0.5]; "zscore": its
    # loss less the mean over the population's standard deviation
    fitness: str = "baseline"

    def check(self, train: TrainConfig) -> None:
        at_least("population", self.population, 2,
                 " (a member's fitness is relative to the population's)")
        positive("sigma", self.sigma)
        if self.antithetic and self.population % 2:
            raise ConfigError(f"train.method.population = {self.population}: must be even with "
                              "train.method.antithetic = true (members come in mirrored pairs)")
        if self.fitness not in FITNESS_SHAPINGS:
            raise ConfigError(f"train.method.fitness = {self.fitness!r}: choose one of "
                              f"{', '.join(FITNESS_SHAPINGS)}")

    @property
    def directions(self) -> int:
        """The seeded directions a step draws: one per member, one per pair if antithetic."""
        return self.population // 2 if self.antithetic else self.population


METHODS = (
    MethodSpec("mezo", MeZOOptions, "fourfold.train.methods.zeroth:MeZO",
               "fourfold.plan.methods.zeroth:MEZO", weight_decay=0.0,
               update_time="forward_only", blocked_loss=True, renamed={"mezo_eps": "eps"}),
    # each data replica evaluates its members on the whole batch: split over z only
    MethodSpec("es", ESOptions, "fourfold.train.methods.zeroth:EvolutionStrategies",
               "fourfold.plan.methods.zeroth:ES", weight_decay=0.0,
               update_time="forward_only", batch_axes=("z",), blocked_loss=True,
               renamed={"es_population": "population", "es_sigma": "sigma"}),
)
