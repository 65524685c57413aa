"""Text generation with a KV cache: greedy, temperature and top-k sampling, by a whole local
model (`generate`) or by a model parallelized over a grid (`generate_on_grid`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from fourfold.models.llama import KVCache, Llama
from fourfold.parallel.comm import Comm, CommLedger

if TYPE_CHECKING:
    from fourfold.parallel.parallelize import ParallelModel


@torch.no_grad()
def generate(model: Llama, prompt_ids: Sequence[int], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int = 0, seed: int = 0,
             eos_id: int | None = None, vocab_size: int | None = None) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens and return the new ones only.

    temperature 0 (or top_k 1) is greedy; top_k 0 samples from the whole vocabulary. The same
    seed gives the same tokens. Stops early after `eos_id` (included in the result). With
    `vocab_size` (the tokenizer's, when the model's vocabulary is padded larger) only ids below
    it are produced. When the
    text reaches model.cfg.max_seq_len, the cache restarts from the last half of the window.
    """
    _check(prompt_ids, temperature)
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def forward(ids: list[int], cache: KVCache) -> torch.Tensor:
        return model(torch.tensor([ids], device=device), cache=cache)[0, -1]

    def choose(logits: torch.Tensor) -> int:
        return _pick(logits.float().cpu()[:vocab_size], temperature, top_k, generator)

    return _decode(model, forward, choose, list(prompt_ids), max_new_tokens, eos_id)


@torch.no_grad()
def generate_on_grid(pmodel: ParallelModel, prompt_ids: Sequence[int], max_new_tokens: int,
                     *, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                     eos_id: int | None = None, vocab_size: int | None = None) -> list[int]:
    """`generate` for a fourfold Llama parallelized over a grid, on the grid itself: every rank
    runs each forward on its own shards (no rank holds the whole model), the vocabulary slices
    of the last position's logits are gathered over y, and rank 0 picks each token (with the
    seeded generator of `generate`, so the same logits give the same text) and shares it with
    every rank. Collective: every rank calls it; rank 0's prompt is the one continued."""
    _check(prompt_ids, temperature)
    model = pmodel.module
    if not isinstance(model, Llama):
        raise TypeError(f"generate_on_grid needs a parallelized fourfold Llama, not "
                        f"{type(model).__name__}")
    grid = pmodel.grid
    comm = Comm(grid, CommLedger())  # not training traffic: keep the ledger clean
    device = grid.device
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def from_rank0(ids: list[int]) -> list[int]:
        mine = torch.tensor(ids, dtype=torch.int64, device=device)
        return comm.all_reduce(mine if grid.rank == 0 else torch.zeros_like(mine),
                               "all").wait().tolist()

    def forward(ids: list[int], cache: KVCache) -> torch.Tensor:
        if pmodel.engine is not None:
            pmodel.engine.begin_forward(recompute=False)
        local = model(torch.tensor([ids], device=device), cache=cache)[0, -1]  # (V / Gy,)
        return comm.all_gather(local.float().contiguous(), "y").wait()  # (V,), y in order

    def choose(logits: torch.Tensor) -> int:
        token = (_pick(logits.cpu()[:vocab_size], temperature, top_k, generator)
                 if grid.rank == 0 else 0)
        return from_rank0([token])[0]

    prompt = from_rank0(list(prompt_ids)) if grid.world_size > 1 else list(prompt_ids)
    return _decode(model, forward, choose, prompt, max_new_tokens, eos_id)


def _check(prompt_ids: Sequence[int], temperature: float) -> None:
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: must not be negative")


def _decode(model: Llama, forward: Callable[[list[int], KVCache], torch.Tensor],
            choose: Callable[[torch.Tensor], int], tokens: list[int], max_new_tokens: int,
            eos_id: int | None) -> list[int]:
    """The decoding loop of generate: `forward` gives the logits of the last position of ids
    (appended to the cache), `choose` the next token."""
    max_len = model.cfg.max_seq_len
    was_training = model.training
    model.eval()
    try:
        cache = KVCache.empty(len(model.layers))
        logits = forward(tokens[-max_len:], cache)
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = choose(logits)
            new.append(token)
            tokens.append(token)
            if token == eos_id:
                break
            if cache.length + 1 > max_len:  # no room for one more position: re-prefill
                cache = KVCache.empty(len(model.layers))
                logits = forward(tokens[-(max_len // 2):], cache)
            else:
                logits = forward([token], cache)
        return new
    finally:
        model.train(was_training)


def _pick(logits: torch.Tensor, temperature: float, top_k: int,
          generator: torch.Generator) -> int:
    # logits: (V,) float32 on CPU
    if temperature == 0 or top_k == 1:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
