"""Text generation with a KV cache: greedy, temperature and top-k sampling."""

from __future__ import annotations

from typing import Sequence

import torch

from fourfold.models.llama import KVCache, Llama


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
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: must not be negative")
    max_len = model.cfg.max_seq_len
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        tokens = list(prompt_ids)
        window = tokens[-max_len:]
        cache = KVCache.empty(len(model.layers))
        logits = model(torch.tensor([window], device=device), cache=cache)[0, -1]
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = _pick(logits.float().cpu()[:vocab_size], temperature, top_k, generator)
            new.append(token)
            tokens.append(token)
            if token == eos_id:
                break
            if cache.length + 1 > max_len:  # no room for one more position: re-prefill
                window = tokens[-(max_len // 2):]
                cache = KVCache.empty(len(model.layers))
                logits = model(torch.tensor([window], device=device), cache=cache)[0, -1]
            else:
                logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
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
