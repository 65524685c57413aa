"""Run by torchrun from test_parallel.py: for every grid of this world size and a set of model
and overlap variants, train the `debug` model for three steps in parallel and on this process
alone, and compare losses and the gathered updated weights. Also counts, independently of the
ledger, the bytes torch.distributed is handed per axis (dist_count.py). Variants may train
under bfloat16 autocast ("bf16") and reduce gradients in bfloat16 ("reduce"); the reference
then runs the same autocast on one process. Every rank reports its own results (grid_cases.py):
its ledger, its bytes of parameters, gradients and optimizer state, the parameters it got no
gradient for."""

from __future__ import annotations


import torch

from fourfold.config import ModelConfig, ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, parallelize
from fourfold.train.goldfish import goldfish_mask

from dist_count import DistCount  # noqa: E402  (tests/ is this script's directory)
from grid_cases import one_process_reference, run_counted_variants  # noqa: E402

STEPS = 3
BATCH = 8  # sequences per step, whole job (test_parallel.py uses the same numbers)
SEQ = 16


def model_cfg(variant: dict) -> ModelConfig:
    """The variant's model: `debug` with its bias and tie switches and any "model" overrides
    (the tests' planner checks build the same config)."""
    return model_config("debug", bias=variant.get("bias", False),
                        tie_embeddings=variant.get("tie", False), **variant.get("model", {}))


def batches(vocab: int, accum: int, steps: int = STEPS
            ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`steps` optimizer steps of data; a longer run starts with the same batches."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        micro = BATCH // accum
        out.append([(tokens[i * micro:(i + 1) * micro, :-1], tokens[i * micro:(i + 1) * micro, 1:])
                    for i in range(accum)])
    return out


def loss_mask(inputs: torch.Tensor, targets: torch.Tensor, goldfish: bool) -> torch.Tensor:
    if goldfish:  # the trainer's rule: drop ~1/k of the tokens, chosen by hashing h tokens
        return goldfish_mask(inputs, targets, k=4, h=3).float()
    return torch.ones(targets.shape)


def make_optimizer(pmodel, name: str) -> torch.optim.Optimizer:
    params = [p for _, p in pmodel.named_parameters()]
    # SGD keeps the weights' comparison tight: Adam divides tiny gradients by their own
    # magnitude, which turns float rounding noise into visible weight differences.
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def train(pmodel, opt: torch.optim.Optimizer, steps_data, shard: tuple[int, int],
          goldfish: bool = False, bf16: bool = False) -> tuple[list[float], dict, list[str]]:
    """Losses per step; this rank's bytes of parameters, gradients and optimizer state at the
    last step (before zero_grad frees the gradients); the parameters that had no gradient
    then."""
    index, count = shard
    losses = []
    for micro_batches in steps_data:
        local = []
        for inputs, targets in micro_batches:
            b = inputs.shape[0] // count
            local.append((inputs[index * b:(index + 1) * b], targets[index * b:(index + 1) * b]))
        masks = [loss_mask(x, y, goldfish) for x, y in local]
        count_tokens = pmodel.reduce_over_batch(torch.stack([m.sum() for m in masks]).sum())
        total = torch.zeros(())
        for i, ((inputs, targets), mask) in enumerate(zip(local, masks)):
            pmodel.set_requires_gradient_sync(i == len(local) - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = (pmodel(inputs, targets) * mask).sum() / count_tokens
            loss.backward()
            pmodel.finish_backward()
            total += loss.detach()
        pmodel.clip_grad_norm_(0.5)
        without_grad = [n for n, p in pmodel.named_parameters() if p.grad is None]
        opt.step()
        memory = pmodel.memory_bytes(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(float(pmodel.reduce_over_batch(total)))
    return losses, memory, without_grad


class TinyGeneric(torch.nn.Module):
    """Not a Llama: parallelize converts its Linear layers generically."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 64)
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 64, bias=False)
        self.head = torch.nn.Linear(64, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        return self.head(h)


def build(cfg, variant: dict) -> torch.nn.Module:
    """The fourfold Llama, with {"hf": true} a tiny Hugging Face LlamaForCausalLM, with
    {"generic": true} a small non-Llama module."""
    if variant.get("generic"):
        torch.manual_seed(7)
        return TinyGeneric(cfg.vocab_size)
    if variant.get("hf"):
        from transformers import LlamaConfig, LlamaForCausalLM

        from fourfold.models.hf import config_to_hf
        hf_cfg = {k: v for k, v in config_to_hf(cfg).items() if k != "architectures"}
        torch.manual_seed(7)
        return LlamaForCausalLM(LlamaConfig(**hf_cfg))
    model = build_model(cfg, seed=7)
    model.activation_checkpointing = variant.get("ckpt", False)
    return model


def one_process_run(variant: dict, steps: int = STEPS) -> tuple[list[float], dict]:
    """The variant trained for `steps` steps by this process alone: losses and final weights
    (made once per variant and step count: see one_process_reference)."""
    def reference() -> tuple[list[float], dict]:
        cfg = model_cfg(variant)
        ref_model = build(cfg, variant)
        ref = parallelize(ref_model, Grid.single())
        ref_losses, _, _ = train(ref, make_optimizer(ref, variant.get("opt", "sgd")),
                                 batches(cfg.vocab_size, variant.get("accum", 1), steps), (0, 1),
                                 variant.get("goldfish", False), variant.get("bf16", False))
        return ref_losses, ref_model.state_dict()

    return one_process_reference({**variant, "steps": steps}, reference)


def parallel_config(shape: GridShape, variant: dict) -> ParallelConfig:
    overlap = variant.get("overlap", True)
    return ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data,
                          overlap_input_grad=overlap, overlap_weight_grad=overlap,
                          prefetch_weights=overlap, overlap_data_grad=overlap,
                          bucket_mb=0.05,
                          reduce_dtype=variant.get("reduce", "float32"),
                          overlap_forward=variant.get("split", False),
                          output_loss=variant.get("loss", "auto"))


def compare(pmodel, grid: Grid, counter: DistCount, losses: list[float],
            ref: tuple[list[float], dict]) -> dict:
    """What the test holds this rank's run to: its losses and gathered weights beside the
    one-process run `ref`'s, its ledger beside the count of what torch.distributed was handed."""
    ref_losses, ref_state = ref
    ledger, handed = pmodel.ledger.snapshot(), counter.by_axis(grid)  # before the gathers below
    state = pmodel.full_state_dict()
    return dict(losses=losses, ref_losses=ref_losses,
                max_weight_diff=max(float((state[k] - ref_state[k]).abs().max())
                                    for k in ref_state),
                max_rel_loss=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                ledger=ledger, handed=handed, emulated=pmodel.ledger.emulated,
                keys_equal=sorted(state) == sorted(ref_state))


def train_on_grid(shape: GridShape, grid: Grid, variant: dict, counter: DistCount
                  ) -> tuple[dict, object, torch.optim.Optimizer]:
    """One variant on one grid against the same model trained by one process: the result,
    and the trained model and optimizer."""
    cfg = model_cfg(variant)
    ref = one_process_run(variant)
    pmodel = parallelize(build(cfg, variant), grid, parallel_config(shape, variant))
    opt = make_optimizer(pmodel, variant.get("opt", "sgd"))
    pmodel.ledger.reset()
    counter.reset()
    losses, memory, without_grad = train(
        pmodel, opt, batches(cfg.vocab_size, variant.get("accum", 1)), grid.batch_shard,
        variant.get("goldfish", False), variant.get("bf16", False))
    result = dict(ok=True, memory=memory, without_grad=without_grad,
                  **compare(pmodel, grid, counter, losses, ref))
    return result, pmodel, opt


def run_variant(shape: GridShape, grid: Grid, variant: dict, counter: DistCount) -> dict:
    return train_on_grid(shape, grid, variant, counter)[0]


def main() -> None:
    run_counted_variants(run_variant)


if __name__ == "__main__":
    main()
