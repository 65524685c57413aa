"""Scaling laws: compute-optimal model and data size, also for a dataset that will be repeated.

Chinchilla (Hoffmann et al. 2022, approach 3): L(N, D) = E + A/N^alpha + B/D^beta, trained with
C = 6ND FLOPs. Minimizing L at fixed C gives N_opt = G (C/6)^a, D_opt = (C/6)^b / G with
G = (alpha A / (beta B))^(1/(alpha+beta)), a = beta/(alpha+beta), b = alpha/(alpha+beta).

The paper's published approach-3 constants put the optimum for Chinchilla's own budget
(5.76e23 FLOPs) at about 32B parameters and 3T tokens, not the 70B / 1.4T of its approaches 1-2;
Besiroglu et al. 2024 ("Chinchilla scaling: a replication attempt") refit the same data and get
constants that reproduce 70B / 1.4T. Both are here: law "chinchilla" (the published constants,
the default) and "epoch" (the refit).

Data-constrained (Muennighoff et al. 2023): with U_D unique tokens seen D/U_D times, the data
is worth D' = U_D + U_D R_D* (1 - exp(-R_D / R_D*)), R_D = D/U_D - 1 repetitions, R_D* ~= 15.4;
parameters beyond U_N (the compute-optimal size for U_D tokens) are worth
N' = U_N + U_N R_N* (1 - exp(-R_N / R_N*)), R_N = N/U_N - 1, R_N* ~= 5.3; the loss is L(N', D').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fourfold.config import Config, ConfigError, ModelConfig, validate
from fourfold.parallel.grid import GridShape
from fourfold.plan.errors import PlanError
from fourfold.plan.schedule import local_param_numel

R_D_STAR = 15.4
R_N_STAR = 5.3


@dataclass(frozen=True)
class ScalingLaw:
    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n_params: float, n_tokens: float) -> float:
        return self.E + self.A / n_params**self.alpha + self.B / n_tokens**self.beta

    @property
    def _g(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def compute_optimal(self, compute: float) -> tuple[float, float]:
        """(N, D) minimizing the loss with 6ND = compute."""
        s = self.alpha + self.beta
        n = self._g * (compute / 6.0) ** (self.beta / s)
        return n, compute / (6.0 * n)

    def optimal_for_tokens(self, n_tokens: float) -> tuple[float, float]:
        """(N, C): the model size for which `n_tokens` is the compute-optimal data, and its
        compute."""
        s = self.alpha + self.beta
        c_over_6 = (n_tokens * self._g) ** (s / self.alpha)
        n = self._g * c_over_6 ** (self.beta / s)
        return n, 6.0 * n * n_tokens


LAWS: dict[str, ScalingLaw] = {
    "chinchilla": ScalingLaw("chinchilla", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28),
    "epoch": ScalingLaw("epoch", E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658),
}


def get_law(name: str) -> ScalingLaw:
    if name not in LAWS:
        raise PlanError(f"--law {name!r}: choose one of {', '.join(LAWS)}")
    return LAWS[name]


def effective_tokens(n_tokens: float, unique_tokens: float) -> float:
    """D': what D tokens drawn from U_D unique ones are worth (Muennighoff et al. 2023)."""
    if n_tokens <= unique_tokens:
        return n_tokens
    repeats = n_tokens / unique_tokens - 1.0
    return unique_tokens + unique_tokens * R_D_STAR * (1.0 - math.exp(-repeats / R_D_STAR))


def effective_params(n_params: float, base_params: float) -> float:
    """N': what N parameters are worth when U_N = base_params would suffice for the data."""
    if n_params <= base_params:
        return n_params
    excess = n_params / base_params - 1.0
    return base_params + base_params * R_N_STAR * (1.0 - math.exp(-excess / R_N_STAR))


@dataclass(frozen=True)
class DataConstrained:
    n_params: float
    n_tokens: float  # tokens trained on (repeats included)
    unique_tokens: float
    epochs: float
    loss: float
    effective_tokens: float
    effective_params: float
    unconstrained_params: float  # the optimum if data were unlimited
    unconstrained_tokens: float
    unconstrained_loss: float


def data_constrained_optimum(law: ScalingLaw, compute: float,
                             unique_tokens: float) -> DataConstrained:
    """The model size minimizing the data-constrained loss at fixed compute (C = 6ND)."""
    if compute <= 0 or unique_tokens <= 0:
        raise PlanError(f"compute = {compute:g}, unique tokens = {unique_tokens:g}: both must be "
                        "positive")
    base_params, _ = law.optimal_for_tokens(unique_tokens)

    def loss_at(log_n: float) -> float:
        n = math.exp(log_n)
        d = compute / (6.0 * n)
        return law.loss(effective_params(n, base_params), effective_tokens(d, unique_tokens))

    # the loss is unimodal in log N: a coarse scan, then golden-section refinement
    lo, hi = math.log(1e3), math.log(max(compute / 6.0 / 1.0, 1e4))
    grid = [lo + (hi - lo) * i / 400 for i in range(401)]
    best = min(range(len(grid)), key=lambda i: loss_at(grid[i]))
    a, b = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c1, c2 = b - ratio * (b - a), a + ratio * (b - a)
        if loss_at(c1) < loss_at(c2):
            b = c2
        else:
            a = c1
    n = math.exp((a + b) / 2)
    d = compute / (6.0 * n)
    n_free, d_free = law.compute_optimal(compute)
    return DataConstrained(n_params=n, n_tokens=d, unique_tokens=unique_tokens,
                           epochs=d / unique_tokens,
                           loss=law.loss(effective_params(n, base_params),
                                         effective_tokens(d, unique_tokens)),
                           effective_tokens=effective_tokens(d, unique_tokens),
                           effective_params=effective_params(n, base_params),
                           unconstrained_params=n_free, unconstrained_tokens=d_free,
                           unconstrained_loss=law.loss(n_free, d_free))


# --------------------------------------------------------------------------------------------
# A model of a given size, and a config to train it


def count_params(model: ModelConfig) -> int:
    """All parameters of the Llama model built from `model` (tied weights once): the memory
    model's count on a one-rank grid."""
    return sum(local_param_numel(model, GridShape()).values())


def model_for_params(n_params: float, vocab_size: int, seq_len: int) -> ModelConfig:
    """A Llama-style shape with about `n_params` parameters (embeddings included), a width
    about 100x its depth, head size 64 (128 from width 2048), grouped-query attention from 16
    heads (8 kv heads, or the head count's largest divisor below 8), SwiGLU width ~8/3 of the
    width."""
    if n_params <= 0:
        raise PlanError(f"parameter count {n_params:g}: must be positive")
    best: tuple[float, ModelConfig] | None = None
    # widths: steps of 64 (head 64) below 1024, 128 below 2048, then 1024 (head 128, a
    # multiple of 8 heads so that 8 kv heads serve them); the depth fine-tunes the size
    widths = list(range(64, 1024, 64)) + list(range(1024, 2048, 128)) + \
        list(range(2048, 65537, 1024))
    for dim in widths:
        head_dim = 128 if dim >= 2048 else 64
        n_heads = dim // head_dim
        n_kv = n_heads if n_heads < 16 else max(k for k in range(1, 9) if n_heads % k == 0)
        ffn = max(64, round(8 * dim / 3 / 64) * 64)
        probe = ModelConfig(preset="custom", n_layers=1, dim=dim, n_heads=n_heads,
                            n_kv_heads=n_kv, ffn_dim=ffn, vocab_size=vocab_size,
                            max_seq_len=seq_len)
        one, two = count_params(probe), count_params(_with_layers(probe, 2))
        layers = max(1, round((n_params - one) / (two - one)) + 1)
        cfg = _with_layers(probe, layers)
        aspect = dim / layers
        score = abs(math.log(count_params(cfg) / n_params)) + 0.05 * abs(math.log(aspect / 100))
        if best is None or score < best[0]:
            best = (score, cfg)
        if count_params(probe) > 3 * n_params:
            break
    assert best is not None
    return best[1]


def _with_layers(model: ModelConfig, layers: int) -> ModelConfig:
    from dataclasses import replace

    return replace(model, n_layers=layers)


def training_config(model: ModelConfig, n_tokens: float, data_path: str,
                    seq_len: int) -> Config:
    """A ready run config: the model, the data, and a step count that reaches `n_tokens`."""
    tokens_per_step = min(2**21, max(8 * seq_len, n_tokens / 2000))
    batch = max(1, 2 ** round(math.log2(max(1.0, tokens_per_step / seq_len))))
    steps = max(1, math.ceil(n_tokens / (batch * seq_len)))
    params = count_params(model)
    lr = 3e-3 if params < 5e7 else 1e-3 if params < 5e8 else 3e-4
    cfg = Config()
    cfg.model = model
    cfg.data.path = data_path
    cfg.train.batch_size = batch
    cfg.train.seq_len = seq_len
    cfg.train.steps = steps
    cfg.train.lr = lr
    cfg.train.warmup_steps = min(2000, max(1, steps // 50))
    cfg.train.eval_every = max(1, min(1000, steps // 20))
    cfg.train.dtype = "bfloat16" if params >= 5e8 else "float32"
    try:
        validate(cfg)
    except ConfigError as e:
        raise PlanError(f"could not make a config for this size: {e}") from None
    return cfg


def dataset_tokens(data_dir: str | Path) -> int:
    """Training tokens of a prepared DATA_DIR (its manifest's `train` split)."""
    from fourfold.data.errors import DataError
    from fourfold.data.manifest import Manifest

    try:
        manifest = Manifest.load(data_dir)
        split = manifest.splits.get("train")
        if split is None:
            return sum(s.tokens for s in manifest.splits.values())
        return split.tokens
    except DataError as e:
        raise PlanError(str(e)) from None


def dataset_vocab_size(data_dir: str | Path) -> int | None:
    from fourfold.data.errors import DataError
    from fourfold.data.manifest import Manifest

    try:
        return Manifest.load(data_dir).vocab_size
    except DataError:
        return None


def format_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"
