"""Run by torchrun from test_lora.py: for every grid of this world size and a set of adapter
variants, fine-tune the `debug` model (or a tiny Hugging Face Llama) with LoRA or norm tuning
for STEPS steps on the grid and on this process alone, and compare losses, the trained adapter
and the (frozen) base. Writes one JSON line per case."""

from __future__ import annotations


import torch
import torch.distributed as dist

from fourfold.config import AdapterConfig, ParallelConfig, model_config
from fourfold.models.adapter import apply_adapter
from fourfold.parallel import Grid, GridShape, parallelize
from dist_count import DistCount  # what torch.distributed is handed, counted apart
from grid_cases import one_process_reference, run_counted_variants
from parallel_worker import build  # the same tiny models as the engine's exactness test

STEPS = 20
BATCH = 8  # sequences per step, whole job (test_lora.py uses the same numbers)
SEQ = 16
ADAPTER_KEYS = ("kind", "r", "alpha", "dropout", "targets", "train_norms", "train_output")


def batches(vocab: int, accum: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(4321)
    # two batches, seen in turn: an adapter can learn them, so the loss falls
    pool = [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(2)]
    out = []
    for step in range(STEPS):
        tokens = pool[step % 2]
        micro = BATCH // accum
        out.append([(tokens[i * micro:(i + 1) * micro, :-1], tokens[i * micro:(i + 1) * micro, 1:])
                    for i in range(accum)])
    return out


def train(pmodel, steps_data, shard: tuple[int, int], optimizer: str) -> list[float]:
    """A plain loop: AdamW (or SGD) over the trainable parameters only."""
    index, count = shard
    params = [p for p in pmodel.parameters() if p.requires_grad]
    if optimizer == "sgd":  # no division by tiny second moments: the tightest comparison
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        # eps = 1e-4 (sqrt(v) is ~5e-4 here): an element whose gradient is ~0 gets an update of
        # lr * g / (|g| + eps), so GEMM-order noise d in g moves it by up to lr * d / eps; at
        # eps = 1e-8 that turns 1e-11 noise into 1.25e-4 over 20 steps (measured on x = 2:
        # 2.7e-5 at eps = 1e-6, 5.8e-7 at 1e-4; losses within 4e-6 at every eps)
        opt = torch.optim.AdamW(params, lr=5e-3, weight_decay=0.01, eps=1e-4, foreach=False)
    n_tokens = BATCH * SEQ
    losses = []
    for micro_batches in steps_data:
        total = torch.zeros(())
        for i, (inputs, targets) in enumerate(micro_batches):
            b = inputs.shape[0] // count
            x, y = inputs[index * b:(index + 1) * b], targets[index * b:(index + 1) * b]
            pmodel.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss = pmodel(x, y).sum() / n_tokens
            loss.backward()
            pmodel.finish_backward()
            total += loss.detach()
        pmodel.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(pmodel.reduce_over_batch(total)))
    return losses


def replica_spread(pmodel, grid: Grid) -> float:
    """Largest difference between the copies of a trainable parameter that ranks replicate:
    every copy must take the same steps."""
    layouts = pmodel.layouts()
    worst = 0.0
    for name, p in pmodel.named_parameters():
        if not p.requires_grad:
            continue
        for axis in layouts[name].replicated_axes():
            group = grid.group(axis)
            if group is None:
                continue
            copies = [torch.empty_like(p.detach()) for _ in range(grid.size(axis))]
            dist.all_gather(copies, p.detach().contiguous(), group=group)
            worst = max(worst, max(float((c - copies[0]).abs().max()) for c in copies))
    return worst


def adapter_cfg(variant: dict) -> AdapterConfig:
    return AdapterConfig(**{k: v for k, v in variant.items() if k in ADAPTER_KEYS})


def run_variant(shape: GridShape, grid: Grid, variant: dict, counter: DistCount) -> dict:
    """One adapter variant on one grid against the same run on one process."""
    cfg = model_config("debug", bias=variant.get("bias", False),
                       tie_embeddings=variant.get("tie", False))
    data = batches(cfg.vocab_size, variant.get("accum", 1))
    acfg = adapter_cfg(variant)

    def reference() -> dict:
        ref_model = build(cfg, variant)
        base_state = {k: v.clone() for k, v in ref_model.state_dict().items()}
        ref = parallelize(ref_model, Grid.single())
        trainable = apply_adapter(ref, acfg, seed=11)
        init = {k: v.clone() for k, v in ref_model.state_dict().items()}
        losses = train(ref, data, (0, 1), variant.get("opt", "adamw"))
        with_vars = ref_model.state_dict(keep_vars=True)  # tied names share a tensor
        return dict(base_state=base_state, trainable=trainable, init=init, losses=losses,
                    state=ref_model.state_dict(),
                    tuned=[k for k in with_vars if with_vars[k].requires_grad],
                    frozen=[k for k in with_vars if not with_vars[k].requires_grad])

    one = one_process_reference(variant, reference)
    base_state, ref_trainable, ref_init = one["base_state"], one["trainable"], one["init"]
    ref_losses, ref_state, tuned, frozen = one["losses"], one["state"], one["tuned"], one["frozen"]

    model = build(cfg, variant)
    pcfg = ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data,
                          bucket_mb=0.05)
    pmodel = parallelize(model, grid, pcfg)
    trainable = apply_adapter(pmodel, acfg, seed=11)
    init_state = pmodel.full_state_dict()
    init_diff = max(float((init_state[k] - v).abs().max())
                    for k, v in ref_init.items() if "lora_A" in k) \
        if acfg.kind == "lora" else 0.0
    pmodel.ledger.reset()
    counter.reset()
    losses = train(pmodel, data, grid.batch_shard, variant.get("opt", "adamw"))
    ledger = pmodel.ledger.snapshot()
    handed = counter.by_axis(grid)
    spread = replica_spread(pmodel, grid)
    state = pmodel.full_state_dict()
    return dict(
        ok=True, losses=losses, ref_losses=ref_losses,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        loss_drop=ref_losses[0] - ref_losses[-1],
        max_adapter_diff=max(float((state[k] - ref_state[k]).abs().max())
                             for k in tuned),
        worst_adapter=max(tuned, key=lambda k: float((state[k] - ref_state[k])
                                                     .abs().max())),
        adapter_moved=max(float((ref_state[k] - ref_init[k]).abs().max())
                          for k in tuned),
        max_frozen_change=max(float((state[k] - base_state[k]).abs().max())
                              for k in frozen if k in base_state),
        init_diff=init_diff, replica_spread=spread, ledger=ledger, handed=handed,
        same_trainable=sorted(trainable) == sorted(ref_trainable),
        n_trainable=len(trainable))


def main() -> None:
    run_counted_variants(run_variant)


if __name__ == "__main__":
    main()
