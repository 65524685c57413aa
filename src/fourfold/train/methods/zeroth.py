"""Training from forward passes alone: MeZO (zeroth-order SGD) and evolution strategies.

Both perturb the weights in place with seeded noise (fourfold/noise.py) and never hold a
gradient or a second copy of the weights: memory is inference memory. The noise of an element
depends only on (seed, step, parameter name, member, global position), so every grid perturbs the
same global weights identically and the batch axes carry only scalar losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fourfold.config import TrainConfig
from fourfold.methods.zeroth import ESOptions, MeZOOptions
from fourfold.parallel import ParallelModel
from fourfold.train.methods.base import (ParamView, PhaseHooks, StepData, StepGuard, StepResult,
                                         TrainingMethod, check_meta, param_views)
from fourfold.noise import noise_key


@torch.no_grad()
def add_noise(views: list[ParamView], seed: int, step: int, coefs: dict[int, float],
              decay: float = 0.0) -> None:
    """p <- p * (1 - decay) [decayed params only] + sum_m coefs[m] * noise(seed, step, m).

    One pass per tensor; the members are summed in a fixed order, so every rank rounds alike."""
    for v in views:
        p = v.param
        keys = {m: noise_key(seed, step, v.name, m) for m in coefs}
        if decay and v.decay:
            p.mul_(1.0 - decay)
        flat = p.view(p.shape[0], -1) if p.dim() else p.view(1, 1)
        for start, stop in v.noise.chunks():
            delta = None
            for m, c in coefs.items():
                z = v.noise.sample(start, stop, keys[m]).mul_(c)
                delta = z if delta is None else delta.add_(z)
            if delta is not None:
                flat[start:stop].add_(delta.reshape(stop - start, -1).to(p.dtype))


def _forward_loss(data: StepData, before: Callable[[], None]) -> torch.Tensor:
    before()
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64)
        for loss in data.losses():
            total += loss.detach().double().cpu()
    return total


class MeZO(TrainingMethod):
    """MeZO (Malladi et al. 2023): the projected gradient (L(w + eps z) - L(w - eps z)) / 2 eps
    along one seeded direction z per step, and w <- w - lr * g * z. No state but a step count."""

    name = "mezo"

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, MeZOOptions)
        self.views = param_views(pmodel, tied_output)
        self.seed, self.eps = cfg.seed, options.eps
        self.weight_decay = cfg.effective_weight_decay()
        self.steps_done = 0
        self.hooks = hooks or PhaseHooks()

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        step, eps = self.steps_done, self.eps
        add_noise(self.views, self.seed, step, {0: eps})
        plus = _forward_loss(data, self.hooks.before_forward)
        add_noise(self.views, self.seed, step, {0: -2.0 * eps})
        minus = _forward_loss(data, self.hooks.before_forward)
        # two scalars cross the batch axes (data, z); x/y replicas already agree
        both = pmodel.reduce_over_batch(torch.stack([plus, minus]).to(pmodel.grid.device))
        plus_v, minus_v = float(both[0]), float(both[1])
        grad = (plus_v - minus_v) / (2.0 * eps)
        loss = 0.5 * (plus_v + minus_v)
        reason = guard.check(loss, abs(grad)) if guard is not None else None
        if reason is not None or not math.isfinite(grad):
            add_noise(self.views, self.seed, step, {0: eps})  # back to w
            self.steps_done += 1
            return StepResult(loss, abs(grad), True, reason or "non-finite gradient estimate")
        # from w - eps z to (1 - lr wd) w - lr g z in one pass
        decay = lr * self.weight_decay
        for_decayed = eps * (1.0 - decay) - lr * grad
        undecayed = [v for v in self.views if not v.decay]
        decayed = [v for v in self.views if v.decay]
        if decayed:
            # (w - eps z)(1 - d) + (eps (1 - d) - lr g) z = (1 - d) w - lr g z
            add_noise(decayed, self.seed, step, {0: for_decayed}, decay=decay)
        if undecayed:
            add_noise(undecayed, self.seed, step, {0: eps - lr * grad})
        self.steps_done += 1
        return StepResult(loss, abs(grad))

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"kind": self.name, "steps_done": self.steps_done}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        self.steps_done = int(meta["steps_done"])


def baseline(losses: list[float]) -> list[float]:
    """Each loss less the population's mean: plain ES, an unbiased gradient estimate."""
    mean = sum(losses) / len(losses)
    return [v - mean for v in losses]


def centered_ranks(losses: list[float]) -> list[float]:
    """Each loss's rank among `losses` (0 the lowest; ties in member order) mapped evenly onto
    [-0.5, 0.5]: OpenAI-ES's fitness shaping, with the loss as a negative reward."""
    order = sorted(range(len(losses)), key=lambda m: (losses[m], m))
    ranks = [0.0] * len(losses)
    for rank, m in enumerate(order):
        ranks[m] = rank / (len(losses) - 1) - 0.5
    return ranks


def zscores(losses: list[float]) -> list[float]:
    """Each loss less the mean over the standard deviation (of the population, not a sample of
    it): EA4LLM's normalization. All zero when every member's loss is the same."""
    mean = sum(losses) / len(losses)
    std = math.sqrt(sum((v - mean) ** 2 for v in losses) / len(losses))
    return [(v - mean) / std if std > 0 else 0.0 for v in losses]


# ESOptions.fitness: a member's weight in the update from the population's losses
FITNESS: dict[str, Callable[[list[float]], list[float]]] = {
    "baseline": baseline, "centered_rank": centered_ranks, "zscore": zscores}


class EvolutionStrategies(TrainingMethod):
    """Evolution strategies (after OpenAI-ES and EA4LLM): train.method.population members
    w + sigma s_m z_m, each evaluated on the same batch; w <- w - lr / (N sigma) *
    sum_m f_m s_m z_m, rebuilt from the seeds on every rank. The fitness f_m is the member's
    loss less the population's mean (fitness = "baseline"), its centered rank
    ("centered_rank") or its z-score ("zscore"); with antithetic pairs member m takes direction
    z_(m // 2) with sign s_m = +1 for even m, -1 for odd, else its own z_m with s_m = +1.

    Members are spread over the data-parallel replicas (member m on replica m % data), so the
    batch is split over z only and each replica evaluates its members on the whole batch; the
    ranks exchange one float per member. Every rank walks all members' perturb/restore (noise
    is cheap next to a forward), so the rounding of w is the same on every rank and replicas
    never drift apart."""

    name = "es"

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, ESOptions)
        self.views = param_views(pmodel, tied_output)
        self.seed, self.sigma, self.population = cfg.seed, options.sigma, options.population
        self.antithetic, self.fitness = options.antithetic, options.fitness
        self.weight_decay = cfg.effective_weight_decay()
        self.steps_done = 0
        self.hooks = hooks or PhaseHooks()

    def direction(self, member: int) -> tuple[int, float]:
        """(the index of the seeded direction member `member` steps along, its sign)."""
        if self.antithetic:
            return member // 2, -1.0 if member % 2 else 1.0
        return member, 1.0

    def walk(self) -> list[tuple[int, list[tuple[int, float]]]]:
        """Each seeded direction with its members (member, sign) in member order."""
        directions: dict[int, list[tuple[int, float]]] = {}
        for m in range(self.population):
            d, sign = self.direction(m)
            directions.setdefault(d, []).append((m, sign))
        return list(directions.items())

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        grid, step, n = pmodel.grid, self.steps_done, self.population
        replica, replicas = grid.coord("data"), grid.size("data")
        losses = torch.zeros(n, dtype=torch.float64)
        for d, members in self.walk():
            # the members stepping along z_d, each visited by one pass from the previous
            # point: (d, +1) alone takes +sigma z_d and back; a mirrored pair goes +sigma z_d,
            # -2 sigma z_d, +sigma z_d back, as MeZO does (three passes for two members)
            offset = 0.0
            for m, sign in members:
                add_noise(self.views, self.seed, step, {d: (sign - offset) * self.sigma})
                offset = sign
                if m % replicas == replica:
                    losses[m] = _forward_loss(data, self.hooks.before_forward)
            add_noise(self.views, self.seed, step, {d: -offset * self.sigma})
        # n floats over the whole grid: z sums the batch shards, data gathers the members;
        # x and y hold copies
        if grid.world_size > 1:
            summed = pmodel.comm.all_reduce(losses.to(grid.device), "all").wait().cpu()
            losses = summed / (grid.size("x") * grid.size("y"))
        loss = float(losses.mean())
        values = [float(v) for v in losses]
        fitness = FITNESS[self.fitness](values)
        # the gradient estimate sum_m f_m s_m z_m / (n sigma): with the mean as baseline
        # unbiased and on the same scale as a gradient (lr means what it means for SGD); each
        # direction's coefficient sums its members' (a mirrored pair: f_+ - f_-)
        coefs: dict[int, float] = {}
        for m, f in enumerate(fitness):
            d, sign = self.direction(m)
            coefs[d] = coefs.get(d, 0.0) + sign * f / (n * self.sigma)
        size = math.sqrt(sum(c * c for c in coefs.values()))
        reason = guard.check(loss, size) if guard is not None else None
        self.steps_done += 1
        if reason is not None or not math.isfinite(loss):
            return StepResult(loss, size, True, reason or "non-finite loss")
        add_noise(self.views, self.seed, step, {d: -lr * c for d, c in coefs.items()},
                  decay=lr * self.weight_decay)
        return StepResult(loss, size)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"kind": self.name, "steps_done": self.steps_done}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        self.steps_done = int(meta["steps_done"])
