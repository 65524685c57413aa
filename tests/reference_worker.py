"""fourfold's memory-lean methods beside the implementations their authors publish: lomo-optim
0.1.1 (LOMO, AdaLomo) and galore-torch 1.0 (GaLoreAdamW), on the same tiny model, weights and
batches, step by step. Imported by test_reference_methods.py (one process); run by torchrun
from it for a grid, where each rank's fourfold run is compared with the reference on one
process (made by every rank, from the same seeds). Writes one JSON line per case and rank:
the differences of the weights, and BlockLLM's tensors chosen at each step by both.

A case: {"name": optimizer, "steps": n, "train": {TrainConfig fields}, "method": {its
[train.method] options}, "freeze": [names ending so], "reference": {options of the reference
alone}}.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator
from unittest import mock

import torch

from fourfold.config import ParallelConfig, TrainConfig, model_config
from fourfold.methods import method_options
from fourfold.methods.galore import is_target
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, parallelize
from fourfold.train.methods import StepResult
from fourfold.train.optim import uses_weight_decay

BATCH, SEQ = 4, 16
State = dict[str, torch.Tensor]


def tiny_model_config() -> Any:
    return model_config("debug", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of (inputs, targets), the same in every process."""
    g = torch.Generator().manual_seed(2024)
    vocab = tiny_model_config().vocab_size
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train_config(case: dict) -> TrainConfig:
    return TrainConfig(optimizer=case["name"], seed=3,
                       method=method_options(case["name"], **case.get("method", {})),
                       **case.get("train", {}))


def fresh_model(case: dict) -> torch.nn.Module:
    """The tiny model from its seed, in float64 where the case says "float64": true (a
    comparison of an algorithm free of float32 rounding), with the case's tensors frozen."""
    model = build_model(tiny_model_config(), seed=7)
    if case.get("float64"):
        model.double()
    for name, p in model.named_parameters():
        if name.endswith(tuple(case.get("freeze", ()))):
            p.requires_grad_(False)
    return model


def snapshot(model: torch.nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the references, on one process --------------------------------------------------------


@contextmanager
def without_cuda_moves() -> Iterator[None]:
    """lomo-optim's AdaLomo makes its state with .cuda(): here the tensors stay on the CPU."""
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        yield


def lomo_reference(case: dict) -> list[State]:
    """lomo-optim's Lomo or AdaLomo: fused_backward per step (grad_norm first for the norm's
    clipping); the weights after each step."""
    from lomo_optim import AdaLomo, Lomo

    cfg = train_config(case)
    options = cfg.options()
    model = fresh_model(case)
    clip = dict(clip_grad_norm=cfg.grad_clip if options.clip_mode == "two_pass" else None,
                clip_grad_value=cfg.grad_clip if options.clip_mode == "value" else None)
    if case["name"] == "adalomo":
        with without_cuda_moves():
            opt = AdaLomo(model, lr=cfg.lr, eps=(options.eps_grad_sq, options.eps_param_rms),
                          clip_threshold=options.clip_threshold, decay_rate=options.decay_rate,
                          weight_decay=cfg.effective_weight_decay(), **clip)
    else:
        opt = Lomo(model, lr=cfg.lr, weight_decay=cfg.effective_weight_decay(), **clip)
    states = []
    for inputs, targets in batches(case["steps"]):
        if options.clip_mode == "two_pass":
            # a forward of its own: fourfold's loss frees what its backward used (lomo-optim's
            # grad_norm retains the graph for a second backward)
            opt.grad_norm(model(inputs, targets).mean())
        opt.fused_backward(model(inputs, targets).mean(), cfg.lr)
        states.append(snapshot(model))
    return states


def galore_torch() -> types.ModuleType:
    """galore-torch's galore_torch.adamw. Its package __init__ also imports its 8-bit
    optimizer, which needs bitsandbytes (not installed: the Makefile leaves it out); the
    package is entered without running it."""
    if "galore_torch" not in sys.modules:
        spec = importlib.util.find_spec("galore_torch")
        assert spec is not None and spec.submodule_search_locations, "galore-torch is missing"
        package = types.ModuleType("galore_torch")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["galore_torch"] = package
    return importlib.import_module("galore_torch.adamw")


def float64_aligned_projector(base: type) -> type:
    """galore-torch's GaLoreProjector with its SVD in float64 and each refreshed singular
    vector signed as the one it replaces (fourfold's refresh): the reference the tests hold
    fourfold's to. Stock galore-torch takes the float32 SVD's arbitrary signs."""

    class Float64AlignedProjector(base):  # type: ignore[misc, valid-type]
        def get_orthogonal_matrix(self, weights: torch.Tensor, rank: int, type: str) -> Any:
            u, _, vh = torch.linalg.svd(weights.double(), full_matrices=False)
            left, right = u[:, :rank].float(), vh[:rank].float()
            old = self.ortho_matrix
            if type == "left":
                return left if old is None else left * _signs(left, old, 0)
            if type == "right":
                return right if old is None else right * _signs(right, old, 1)
            if old is None:
                return [left, right]
            return [left * _signs(left, old[0], 0), right * _signs(right, old[1], 1)]

    return Float64AlignedProjector


def _signs(new: torch.Tensor, old: torch.Tensor, dim: int) -> torch.Tensor:
    """+-1 per singular vector (the vectors run along `dim`): the sign that agrees with `old`."""
    return torch.where((new * old).sum(dim, keepdim=True) < 0, -1.0, 1.0)


def galore_reference(case: dict) -> list[State]:
    """galore-torch's GaLoreAdamW (float64 SVD, signs aligned): the target matrices in a group
    of their own with rank, gap, scale and proj_type, the rest in groups with fourfold's
    weight decay exemptions (galore-torch decays by group), the gradient clipped by its global
    norm first (as its training script does); the weights after each step."""
    adamw = galore_torch()
    cfg = train_config(case)
    options = cfg.options()
    model = fresh_model(case)
    targets, decayed, exempt = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and is_target(name, options.targets):
            targets.append(p)
        else:
            (decayed if uses_weight_decay(name) else exempt).append(p)
    rank = options.rank or min(min(p.shape) for p in targets) // 4
    assert all(rank <= min(p.shape) for p in targets), "one rank for every target matrix"
    wd = cfg.effective_weight_decay()
    groups = [{"params": decayed, "weight_decay": wd}, {"params": exempt, "weight_decay": 0.0},
              {"params": targets, "weight_decay": wd, "rank": rank,
               "update_proj_gap": options.gap, "scale": options.scale,
               "proj_type": options.proj_type}]
    projector = float64_aligned_projector(adamw.GaLoreProjector)
    states = []
    with mock.patch.object(adamw, "GaLoreProjector", projector):
        opt = adamw.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                          betas=(cfg.beta1, cfg.beta2), eps=options.eps,
                          no_deprecation_warning=True)
        params = [p for p in model.parameters() if p.requires_grad]
        for inputs, targets_ in batches(case["steps"]):
            model(inputs, targets_).mean().backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            states.append(snapshot(model))
    return states


def blockllm_transcription(case: dict, chosen: list[list[str]] | None = None
                           ) -> list[State]:
    """BlockLLM's selection as its paper and its authors' code (blockllm_torch/blockllm.py)
    make it, written out on one process with whole tensors: the embedding and output layer
    frozen; a first choice in a random order (fourfold's seeded order: one uniform draw per
    candidate, in name order); each choice takes the tensors by score, gradient norm over
    exp(visit share / t), and stops at the first that brings the elements to (1 - sparsity) of
    the candidates'; after a step the choice is made again (from every candidate's gradient at
    the next step) when the average loss since the last choice is below the last `patience`
    losses'; a new choice starts a fresh Adam (torch's AdamW, fourfold's decay exemptions), the
    chosen gradients clipped by their norm. The weights after each step; each step's choice
    appended to `chosen`."""
    cfg = train_config(case)
    options = cfg.options()
    model = fresh_model(case)
    named = dict(model.named_parameters())
    cands = sorted(n for n, p in named.items() if p.requires_grad
                   and n not in ("embed.weight", "output.weight"))
    for n in ("embed.weight", "output.weight"):
        named[n].requires_grad_(False)
    budget = (1 - options.sparsity) * sum(named[n].numel() for n in cands)
    visits = {n: 1.0 for n in cands}

    def take(scores: dict[str, float]) -> list[str]:
        order = sorted(cands, key=lambda n: -scores[n])  # stable: ties in name order
        out, total = [], 0
        for n in order:
            total += named[n].numel()
            if total >= budget and out:
                break
            out.append(n)
        return out

    g = torch.Generator().manual_seed(cfg.seed)
    current = take({n: float(torch.rand(1, generator=g, dtype=torch.float64)) for n in cands})
    selecting, t, history, opt = False, 0, [], None
    wd = cfg.effective_weight_decay()
    states = []
    for inputs, targets in batches(case["steps"]):
        for n in cands:
            named[n].requires_grad_(selecting or n in current)
        loss = model(inputs, targets).mean()
        loss.backward()
        if selecting or opt is None:
            if selecting:
                total = sum(visits.values())
                current = take({n: float(named[n].grad.double().norm())
                                / math.exp(visits[n] / total / (t + 1)) for n in cands})
                for n in current:
                    visits[n] += 1
            groups = [{"params": [named[n] for n in current if uses_weight_decay(n)],
                       "weight_decay": wd},
                      {"params": [named[n] for n in current if not uses_weight_decay(n)],
                       "weight_decay": 0.0}]
            opt = torch.optim.AdamW([gr for gr in groups if gr["params"]], lr=cfg.lr,
                                    betas=(cfg.beta1, cfg.beta2), eps=1e-8)
        params = [named[n] for n in current]
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        model.zero_grad(set_to_none=True)
        t += 1
        history.append(float(loss.detach()))
        if chosen is not None:
            chosen.append(sorted(current))
        p = options.patience
        selecting = len(history) > p and sum(history) / len(history) < sum(history[-p:]) / p
        if selecting:
            history = []
        states.append(snapshot(model))
    return states


def reference(case: dict, chosen: list[list[str]] | None = None) -> list[State]:
    """The reference's weights after each step; BlockLLM's choices appended to `chosen`."""
    if case["name"] in ("lomo", "adalomo"):
        return lomo_reference(case)
    if case["name"] == "galore":
        return galore_reference(case)
    if case["name"] == "blockllm":
        return blockllm_transcription(case, chosen)
    raise ValueError(f"no reference for {case['name']!r}")


# ---- fourfold's method, on one process or a grid ---------------------------------------------


def fourfold_run(case: dict, grid: Grid, shape: GridShape | None = None,
                 chosen: list[list[str]] | None = None,
                 results: list[StepResult] | None = None) -> list[State]:
    """fourfold's method on `grid` from the same weights and batches (each rank its slice of
    the batch); the full weights after each step (gathered on a grid); BlockLLM's tensors
    chosen at each step appended to `chosen`, each step's StepResult to `results`."""
    from fourfold.train.methods import StepData, batch_shard, build_method

    cfg = train_config(case)
    model = fresh_model(case)
    pcfg = None if shape is None else ParallelConfig(x=shape.x, y=shape.y, z=shape.z,
                                                      data=shape.data, bucket_mb=0.05)
    pmodel = parallelize(model, grid, pcfg) if pcfg else parallelize(model, grid)
    method = build_method(pmodel, cfg)
    index, count = batch_shard(pmodel.grid, method.batch_axes)
    states = []
    for inputs, targets in batches(case["steps"]):
        b = BATCH // count
        local = inputs[index * b:(index + 1) * b], targets[index * b:(index + 1) * b]

        def losses() -> Iterator[torch.Tensor]:
            yield pmodel(*local).sum() / (BATCH * SEQ)

        result = method.step(pmodel, StepData(1, losses), cfg.lr)
        assert not result.skipped, result.reason
        if results is not None:
            results.append(result)
        if chosen is not None:
            chosen.append(sorted(method.selected))
        # copies: a full state dict holds the parameters themselves where no rank splits them
        full = pmodel.full_state_dict() if shape is not None else model.state_dict()
        states.append({k: v.detach().clone() for k, v in full.items()})
    return states


def differences(ours: list[State], ref: list[State], start: State) -> dict:
    """Per step, over every tensor the reference moved: the difference of the weights from
    the reference's relative to them, as norms (`relative`, and the tensor where it is
    largest, `worst`); the largest difference of one weight relative to the tensor's largest
    weight (`element`) and to the largest change of the reference's step (`of_step`)."""
    relative, element, of_step, moved, worst = [], [], [], [], []
    before = start
    for a, b in zip(ours, ref):
        rel, elem, step, name = 0.0, 0.0, 0.0, ""
        for k, w in b.items():
            change = float((w - before[k]).abs().max())
            if change == 0.0:
                continue
            moved.append(k)
            diff = (a[k] - w).double()
            if float(diff.norm() / w.double().norm()) >= rel:
                rel, name = float(diff.norm() / w.double().norm()), k
            elem = max(elem, float(diff.abs().max()) / float(w.abs().max()))
            step = max(step, float(diff.abs().max()) / change)
        relative.append(rel)
        element.append(elem)
        of_step.append(step)
        worst.append(name)
        before = b
    return {"relative": relative, "worst": worst, "element": element, "of_step": of_step,
            "moved": sorted(set(moved))}


def tensor_offsets(ours: list[State], ref: list[State]) -> list[float]:
    """Per step, the largest difference of a tensor's weights from the reference's relative
    to its norm, over every tensor (moved at that step or not)."""
    return [max(float((a[k] - w).double().norm() / w.double().norm()) for k, w in b.items())
            for a, b in zip(ours, ref)]


def compare(case: dict, grid: Grid, shape: GridShape | None = None) -> dict:
    ref = reference(case)
    ours = fourfold_run(case, grid, shape)
    return differences(ours, ref, snapshot(fresh_model(case)))


def main() -> None:
    from grid_cases import one_process_reference, run_grid_cases

    def reference_and_choices(case: dict) -> tuple[list[State], list[list[str]]]:
        chosen: list[list[str]] = []
        return reference(case, chosen), chosen

    def run_case(shape: GridShape, grid: Grid, case: dict) -> dict:
        ref, ref_chosen = one_process_reference(case, lambda: reference_and_choices(case))
        chosen: list[list[str]] = []
        ours = fourfold_run(case, grid, shape, chosen if case["name"] == "blockllm" else None)
        return {"ok": True, **differences(ours, ref, snapshot(fresh_model(case))),
                "chosen": chosen, "ref_chosen": ref_chosen,
                "tensor_offsets": tensor_offsets(ours, ref)}

    run_grid_cases("FOURFOLD_TEST_CASES", "case", run_case)


if __name__ == "__main__":
    main()

