"""fourfold's memory-lean methods against the implementations their authors publish, step by
step on the same tiny model, weights and batches (reference_worker.py): lomo-optim 0.1.1's
Lomo and AdaLomo, galore-torch 1.0's GaLoreAdamW (its SVD in float64, each refreshed singular
vector signed as the one it replaces, as fourfold's refresh does); on one process and on 2 x 2
grids, each against the reference on one process.

After every step each tensor's weights are within 1e-6 of the reference's, relative as norms,
and no single weight is off by 1e-5 of the tensor's largest. Measured on one process: LOMO
bit-identical but with two_pass clipping (4.5e-8), AdaLomo 4e-8, GaLore 5e-8 to 3e-7 by
projection type: float32 rounding in another order. Adam turns such rounding into more where an
entry of R is near its eps (a step of R / (|R| + eps) there moves with it): on a grid, whose
sums run in another order, one weight of a 32 x 64 matrix was 1.2e-6 off (2e-4 of its step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grid_cases import launch_grid_cases

WORKER = Path(__file__).with_name("reference_worker.py")
TOLERANCE = 1e-6  # of the tensor's largest weight, after every step

pytestmark = pytest.mark.usefixtures("one_thread")

# lomo-optim decays every parameter it trains, fourfold by default never the norm gains, biases
# or embeddings: those are frozen in the cases with weight decay, but where
# decay_every_parameter makes fourfold decay as lomo-optim does
EXEMPT = ["norm.weight", "embed.weight"]
LOMO = [{"name": "lomo", "steps": 4, "train": {"lr": 0.1, "grad_clip": 0.0}},
        {"name": "lomo", "steps": 4, "train": {"lr": 0.1, "grad_clip": 0.002},
         "method": {"clip_mode": "value"}},
        {"name": "lomo", "steps": 4, "train": {"lr": 0.1, "grad_clip": 0.5},
         "method": {"clip_mode": "two_pass"}},
        {"name": "lomo", "steps": 4, "train": {"lr": 0.1, "grad_clip": 0.0, "weight_decay": 0.1},
         "freeze": EXEMPT},
        {"name": "lomo", "steps": 4, "train": {"lr": 0.1, "grad_clip": 0.0, "weight_decay": 0.1},
         "method": {"decay_every_parameter": True}}]
ADALOMO = [{"name": "adalomo", "steps": 4, "train": {"lr": 1e-2, "grad_clip": 0.0}},
           {"name": "adalomo", "steps": 4, "train": {"lr": 1e-2, "grad_clip": 0.002},
            "method": {"clip_mode": "value", "decay_rate": -0.5, "clip_threshold": 0.5,
                       "eps_grad_sq": 1e-20, "eps_param_rms": 0.05}},
           {"name": "adalomo", "steps": 4, "train": {"lr": 1e-2, "grad_clip": 0.3,
                                                     "weight_decay": 0.1},
            "method": {"clip_mode": "two_pass"}, "freeze": EXEMPT},
           {"name": "adalomo", "steps": 4, "train": {"lr": 1e-2, "grad_clip": 0.0,
                                                     "weight_decay": 0.1},
            "method": {"decay_every_parameter": True}}]
# gap 2 over 6 steps: refreshes at steps 1, 3 and 5, the later ones with moments to carry.
# The embedding (not a target: AdamW unprojected) is frozen: AdamW's per-element
# normalisation turns the rounding of a rare token's small gradient into weight noise
# (measured 4e-6 of the largest weight after 6 steps, the targets' 3e-7)
GALORE = [{"name": "galore", "steps": 6, "freeze": ["embed.weight"],
           "train": {"lr": 1e-3, "grad_clip": 0.5, "weight_decay": 0.1},
           "method": {"gap": 2, "rank": 8, **extra}}
          for extra in ({}, {"proj_type": "reverse_std"}, {"proj_type": "left"},
                        {"proj_type": "right"}, {"proj_type": "full"},
                        {"scale": 1.0, "eps": 1e-4, "targets": ["q", "k", "v", "o", "gate",
                                                                "up", "down", "output"]})]
# Both sides: at a refresh R = P^T G Q is diag(sigma) but for rounding, and Adam's first step
# normalises those rounding-sized off-diagonal entries against eps into steps of their own
# (in either implementation, each with its own rounding): measured 1.4e-6 as norms
GALORE[4]["tolerance"] = 1e-5


def label(case: dict) -> str:
    return json.dumps({k: case[k] for k in ("name", "train", "method") if k in case})


def check(result: dict, case: dict, where: str) -> None:
    assert len(result["relative"]) == case["steps"], where
    tolerance = case.get("tolerance", TOLERANCE)
    assert max(result["relative"]) < tolerance, \
        f"{where}: {result['relative']} in {result['worst']} (of a step: {result['of_step']})"
    # and no weight on its own far off (Adam's steps from entries of R near eps: below)
    assert max(result["element"]) < 10 * tolerance, f"{where}: {result['element']}"
    # every trainable tensor moved (the comparison covers them all)
    assert len(result["moved"]) > 10, f"{where}: {result['moved']}"


@pytest.mark.slow
@pytest.mark.parametrize("case", LOMO + ADALOMO + GALORE, ids=label)
def test_method_steps_as_the_reference_on_one_process(case: dict) -> None:
    from reference_worker import compare

    from fourfold.parallel import Grid

    check(compare(case, Grid.single()), case, "one process")


# patience 2 at a rate that makes the loss stall twice in 12 steps: the random first choice,
# then choices by gradient at steps 3 and 11 (0-based) with the visit penalty and Adam reset
BLOCKLLM = {"name": "blockllm", "steps": 12, "train": {"lr": 0.02},
            "method": {"sparsity": 0.5, "patience": 2}}
# A fresh Adam's first step is lr g / (|g| + eps) per element, so an element whose gradient
# is near eps steps by its rounding noise, and the next forwards carry that difference into
# every tensor trained after it (measured on one process: a few elements per matrix by the
# sixth step, at most 1.8e-3 of a tensor's norm by the last); a wrong step (one Adam step is
# lr = 0.02 per element, weights of about 0.05) would be hundreds of times that
BLOCKLLM_TOLERANCE = 5e-3


def check_blockllm(ours_chosen: list, ref_chosen: list, offsets: list[float],
                   where: str) -> None:
    """The same tensors chosen at every step as the transcription, choices by gradient among
    them, never the embedding or output layer; every tensor as close as BLOCKLLM_TOLERANCE
    after every step (`offsets`: reference_worker.tensor_offsets)."""
    assert ours_chosen == ref_chosen, where
    changes = [i for i in range(1, len(ref_chosen)) if ref_chosen[i] != ref_chosen[i - 1]]
    assert len(changes) >= 2, f"{where}: {ref_chosen}"
    assert not any(n.startswith(("embed", "output")) for c in ref_chosen for n in c), where
    assert len(offsets) == BLOCKLLM["steps"], where
    assert max(offsets) < BLOCKLLM_TOLERANCE, f"{where}: {offsets} of a tensor's norm"


@pytest.mark.ranks
def test_method_on_a_grid_steps_as_the_reference_on_one_process(tmp_path: Path) -> None:
    """2 x 2 grids, tensor (y x) and batch (data z) axes, against the reference on one
    process: a grid's statistics (AdaLomo's row and column means, GaLore's Gram, its larger
    side's basis, R's reduce-scatter, BlockLLM's gradient norms) are those of the full
    tensors. BlockLLM is held to the transcription of its paper's selection, as on one
    process (test_blockllm_chooses_as_the_papers_rule)."""
    cases = [LOMO[2], LOMO[1], ADALOMO[0], ADALOMO[2], GALORE[0], GALORE[1], GALORE[4],
             BLOCKLLM]
    grids = [[1, 1, 2, 2], [2, 2, 1, 1]]
    results = launch_grid_cases(WORKER, 4, grids, "FOURFOLD_TEST_CASES", "case", cases,
                                tmp_path / "reference.jsonl", timeout=900)
    failed = []
    for r in results:
        where = f"grid {r['shape']} rank {r['rank']} {label(r['case'])}"
        try:
            if r["case"]["name"] == "blockllm":
                check_blockllm(r["chosen"], r["ref_chosen"], r["tensor_offsets"], where)
            else:
                check(r, r["case"], where)
        except AssertionError as e:
            failed.append(str(e).splitlines()[0])
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_blockllm_chooses_as_the_papers_rule() -> None:
    """BlockLLM at its paper's defaults against a transcription of the paper's selection (its
    authors' code's rules: reference_worker.blockllm_transcription) on one process: the same
    tensors chosen at every step, choices by gradient among them, the weights close (see
    BLOCKLLM_TOLERANCE)."""
    from reference_worker import blockllm_transcription, fourfold_run, tensor_offsets

    from fourfold.parallel import Grid

    ref_chosen: list = []
    ours_chosen: list = []
    ref = blockllm_transcription(BLOCKLLM, ref_chosen)
    ours = fourfold_run(BLOCKLLM, Grid.single(), chosen=ours_chosen)
    check_blockllm(ours_chosen, ref_chosen, tensor_offsets(ours, ref), "one process")


# ---- MeZO and ES against their papers' algorithms, written out --------------------------------


def seeded_direction(seed: int, step: int, name: str, shape: torch.Size,
                     member: int = 0) -> torch.Tensor:
    """The direction z of one tensor at one step. MeZO's Algorithm 1 redraws z from torch's
    generator reset to the step's seed; fourfold's z is a counter-based hash of (seed, step,
    tensor name, member, position) (fourfold.noise) that no torch generator reproduces, so the
    transcriptions take that same z, drawn here for the whole tensor at once."""
    from fourfold.noise import ShardNoise, noise_key

    noise = ShardNoise(tuple(shape), tuple(shape), (0,) * len(shape), torch.device("cpu"))
    return noise.sample(0, shape[0], noise_key(seed, step, name, member)).reshape(shape)


def mezo_transcription(case: dict, projected: list[float]) -> list[dict]:
    """MeZO, Malladi et al. 2023, Algorithm 1 (MeZO-SGD): per step, perturb by +eps z, take
    L+, by -2 eps z, take L-, back by +eps z; projected gradient g = (L+ - L-) / (2 eps); each
    weight steps by -lr g z with the same z. The weights after each step; g to `projected`."""
    from reference_worker import batches, fresh_model, snapshot, train_config

    cfg = train_config(case)
    eps, model = cfg.options().eps, fresh_model(case)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def perturb(step: int, scale: float) -> None:
        for name, p in params:
            p.data.add_(scale * seeded_direction(cfg.seed, step, name, p.shape))

    states = []
    with torch.no_grad():
        for t, (inputs, targets) in enumerate(batches(case["steps"])):
            perturb(t, eps)
            plus = float(model(inputs, targets).mean())
            perturb(t, -2 * eps)
            minus = float(model(inputs, targets).mean())
            perturb(t, eps)
            g = (plus - minus) / (2 * eps)
            perturb(t, -cfg.lr * g)
            projected.append(g)
            states.append(snapshot(model))
    return states


def es_transcription(case: dict) -> list[dict]:
    """Evolution strategies as OpenAI-ES (Salimans et al. 2017, Algorithm 2 with mirrored
    sampling and fitness shaping) writes them, the loss as negative reward: member m is
    w + s_m sigma z_m (antithetic: z_(m // 2), s_m = -1 for odd m), its fitness f_m the centered
    rank of its loss in [-0.5, 0.5], its loss's z-score over the population (EA4LLM's
    normalization) or its loss less the mean; then w <- w - lr / (n sigma)
    sum_m f_m s_m z_m. The weights after each step."""
    from reference_worker import batches, fresh_model, snapshot, train_config

    cfg = train_config(case)
    options, model = cfg.options(), fresh_model(case)
    n, sigma = options.population, options.sigma
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

    def direction(m: int) -> tuple[int, float]:
        return (m // 2, -1.0 if m % 2 else 1.0) if options.antithetic else (m, 1.0)

    def perturb(step: int, m: int, scale: float) -> None:
        d, s = direction(m)
        for name, p in params:
            p.data.add_(s * scale * seeded_direction(cfg.seed, step, name, p.shape, d))

    states = []
    with torch.no_grad():
        for t, (inputs, targets) in enumerate(batches(case["steps"])):
            losses = []
            for m in range(n):
                perturb(t, m, sigma)
                losses.append(float(model(inputs, targets).mean()))
                perturb(t, m, -sigma)
            if options.fitness == "centered_rank":
                fitness = [0.0] * n
                for rank, m in enumerate(sorted(range(n), key=lambda m: losses[m])):
                    fitness[m] = rank / (n - 1) - 0.5
            elif options.fitness == "zscore":
                mean = sum(losses) / n
                std = (sum((v - mean) ** 2 for v in losses) / n) ** 0.5
                fitness = [(v - mean) / std for v in losses]
            else:
                fitness = [v - sum(losses) / n for v in losses]
            for m in range(n):
                perturb(t, m, -cfg.lr * fitness[m] / (n * sigma))
            states.append(snapshot(model))
    return states


# float64 weights: MeZO's projected gradient divides a difference of two losses by 2 eps (ES's
# fitness by sigma), so in float32 the rounding of one update made in another order (MeZO goes
# from w - eps z to w - lr g z in one pass, the algorithm in two) comes back at the next step
# hundreds of times larger (measured: 5e-5 of the weights by MeZO's fifth step, 1.2e-5 by ES's
# third); in float64 the weights agree to 2e-8, the largest difference 4e-7 of a step
MEZO = {"name": "mezo", "steps": 5, "train": {"lr": 1e-3}, "method": {"eps": 1e-3},
        "float64": True}
ES = [{"name": "es", "steps": 3, "train": {"lr": lr}, "float64": True,
       "method": {"population": 4, "sigma": 1e-3, **extra}}
      for lr, extra in ((1e-3, {}), (1e-5, {"antithetic": True, "fitness": "centered_rank"}),
                        (1e-5, {"fitness": "zscore"}))]
# The loss is float32 whatever the weights (the fused cross-entropy's), and z-scores divide by
# the losses' spread (~1e-3 at this sigma): a loss that rounds one float32 ulp (5e-7 at 6.2)
# the other way in either run moves a fitness by ~5e-4 of itself (measured 1.9e-4 of a step
# by the third). A wrong normalization is off by far more (the sample's std: 15%).
ES[2]["tolerance"] = 1e-3


def moved_by(states: list[dict], start: dict) -> float:
    """The largest change of a tensor over the run, relative to its norm."""
    return max(float((states[-1][k] - w).norm() / w.norm()) for k, w in start.items())


def test_mezo_steps_as_its_papers_algorithm() -> None:
    """fourfold's MeZO against Algorithm 1 written out above, from the same weights, batches
    and z: after every step the weights within 1e-6 of the transcription's, relative as norms
    and to the step, and the projected gradients the same."""
    from reference_worker import differences, fourfold_run, fresh_model, snapshot

    from fourfold.parallel import Grid

    projected: list[float] = []
    results: list = []
    ref = mezo_transcription(MEZO, projected)
    ours = fourfold_run(MEZO, Grid.single(), results=results)
    start = snapshot(fresh_model(MEZO))
    result = differences(ours, ref, start)
    check(result, MEZO, "mezo")
    assert max(result["of_step"]) < 1e-6, result["of_step"]
    assert moved_by(ref, start) > 1e-3  # steps far larger than the tolerance
    # fourfold reports |g| (its gradient norm); the weights carry the sign
    for step, (step_result, g) in enumerate(zip(results, projected)):
        assert abs(step_result.grad_norm - abs(g)) <= 1e-6 * abs(g), (step, step_result, g)


@pytest.mark.parametrize("case", ES, ids=label)
def test_es_steps_as_the_papers_algorithm(case: dict) -> None:
    """fourfold's ES against OpenAI-ES written out above (mirrored pairs and centered ranks,
    z-scores, or plain members with the mean as baseline): after every step the weights within
    1e-6 (z-scores: 1e-3, above), relative as norms and to the step."""
    from reference_worker import differences, fourfold_run, fresh_model, snapshot

    from fourfold.parallel import Grid

    ref = es_transcription(case)
    ours = fourfold_run(case, Grid.single())
    start = snapshot(fresh_model(case))
    result = differences(ours, ref, start)
    check(result, case, "es")
    assert max(result["of_step"]) < case.get("tolerance", 1e-6), result["of_step"]
    assert moved_by(ref, start) > 1e-4
