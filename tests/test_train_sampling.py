"""Generation with the KV cache against plain full-sequence forwards."""

from __future__ import annotations

import pytest
import torch

from fourfold.config import model_config
from fourfold.models.llama import build_model
from fourfold.train.sampling import generate


def _greedy_without_cache(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


pytestmark = pytest.mark.usefixtures("one_thread")  # token-by-token decoding of a tiny model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # A larger init makes the logits peaked enough that ties in argmax cannot occur.
    return build_model(model_config("debug", max_seq_len=64, init_std=0.5), seed=3).eval()


def test_greedy_with_cache_equals_full_forwards(model: torch.nn.Module) -> None:
    prompt = [5, 17, 99, 3, 250]
    assert generate(model, prompt, 20, temperature=0) == _greedy_without_cache(model, prompt, 20)


def test_sampling_is_seeded_and_top_k_limited(model: torch.nn.Module) -> None:
    prompt = [1, 2, 3]
    a = generate(model, prompt, 30, temperature=1.0, top_k=5, seed=11)
    b = generate(model, prompt, 30, temperature=1.0, top_k=5, seed=11)
    c = generate(model, prompt, 30, temperature=1.0, top_k=5, seed=12)
    assert a == b and a != c
    assert generate(model, prompt, 10, top_k=1) == generate(model, prompt, 10, temperature=0)


def test_vocab_limit_eos_and_long_generation(model: torch.nn.Module) -> None:
    out = generate(model, [7] * 60, 100, temperature=1.5, seed=0, vocab_size=40)
    assert len(out) == 100  # past max_seq_len = 64: the cache restarts from a window
    assert max(out) < 40
    first = generate(model, [7, 8], 5, temperature=0)
    stopped = generate(model, [7, 8], 5, temperature=0, eos_id=first[1])
    assert stopped == first[:2]
    assert model.training is False


def test_generate_restores_training_mode() -> None:
    model = build_model(model_config("debug"), seed=0)
    model.train()
    generate(model, [1], 2)
    assert model.training


def test_generate_on_a_grid_of_one_equals_generate(model: torch.nn.Module) -> None:
    """generate_on_grid's decoding (engine passes, logits gathered over y, rank 0's pick
    shared) on one process; tests/test_train_multirank.py runs it on two ranks."""
    from fourfold.parallel import Grid, parallelize
    from fourfold.train.sampling import generate_on_grid

    pmodel = parallelize(build_model(model.cfg, seed=3), Grid.single())
    prompt = [4, 9, 60]
    for temperature in (0.0, 1.0):
        assert generate_on_grid(pmodel, prompt, 12, temperature=temperature, top_k=5, seed=2) \
            == generate(model, prompt, 12, temperature=temperature, top_k=5, seed=2)
    with pytest.raises(TypeError, match="fourfold Llama"):
        generate_on_grid(parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                     Grid.single()), prompt, 1)
