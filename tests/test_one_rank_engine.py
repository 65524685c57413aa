"""parallel.engine = "always": one process runs the whole engine as a one-rank grid (a one-rank
process group, fourfold's layers and collectives, the data-parallel buckets, the DTensor
checkpoint) and trains the same model as the default one-process path; and, on that engine,
what a block keeps for backward under bfloat16 autocast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fourfold.config import ConfigError, ParallelConfig, model_config
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, parallelize
from fourfold.parallel.linear import Linear3D
from fourfold.plan.memory import Precision, activation_bytes_per_token

sys.path.insert(0, str(Path(__file__).parent))
from memory_worker import SavedTensorCounter  # noqa: E402

WORKER = Path(__file__).with_name("one_rank_engine_worker.py")
BF16_LOSS_DRIFT = 2e-2  # bfloat16 autocast against one process (test_parallel.py's bound)


def test_always_puts_the_engine_on_one_process_and_other_values_are_errors() -> None:
    cfg = model_config("debug")
    plain = parallelize(build_model(cfg, seed=0), Grid.single())
    assert plain.engine is None
    forced = parallelize(build_model(cfg, seed=0), Grid.single(), ParallelConfig(engine="always"))
    assert forced.engine is not None
    assert sum(isinstance(m, Linear3D) for m in forced.module.modules()) == 7 * cfg.n_layers + 1
    with pytest.raises(ConfigError, match="parallel.engine = 'sometimes': choose one of auto, "
                                          "always"):
        parallelize(build_model(cfg, seed=0, device="meta"), Grid.single(),
                    ParallelConfig(engine="sometimes"))


def test_a_block_under_bfloat16_autocast_keeps_its_gemm_inputs_in_bfloat16() -> None:
    """The parallel linears keep the compute-dtype input they multiply, not the float32 norm
    output they were given: of a block's saved activations only the residual stream (the two
    norms' inputs) and the per-token statistics are float32, and the block keeps exactly the
    bytes the planner gives a rank of this engine (a data = 2 grid's rank runs the same
    layers)."""
    cfg = model_config("debug")
    pmodel = parallelize(build_model(cfg, seed=1), Grid.single(), ParallelConfig(engine="always"))
    module = pmodel.module
    exclude = {t.untyped_storage().data_ptr()
               for t in [*module.parameters(), *module.buffers()]}
    counter = SavedTensorCounter(exclude)
    kept: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in exclude:
            kept.append((counter.phase, t.dtype, tuple(t.shape)))
        return counter.pack(t)

    def enter(name: str):
        def hook(_module, _inputs) -> None:
            counter.phase = name
        return hook

    for i, layer in enumerate(module.layers):
        layer.register_forward_pre_hook(enter(f"layer{i}"))
    module.norm.register_forward_pre_hook(enter("head"))
    batch, seq = 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                           generator=torch.Generator().manual_seed(0))
    counter.phase = "embed"
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pmodel(tokens[:, :-1], tokens[:, 1:]).mean()
    residual_shape = (batch, seq, cfg.dim)
    block = [(dtype, shape) for phase, dtype, shape in kept if phase == "layer0"]
    wide_float32 = [shape for dtype, shape in block
                    if dtype == torch.float32 and shape == residual_shape]
    assert len(wide_float32) == 2, block  # the two norms' inputs; no GEMM input
    assert (torch.bfloat16, residual_shape) in block  # q/k/v's and gate/up's input, cast once
    per_token = activation_bytes_per_token(cfg, GridShape(data=2), Precision.of("bfloat16"))
    assert counter.phases()["layer0"] == per_token["block"] * batch * seq
    loss.backward()  # what was kept is what backward needs
    pmodel.finish_backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in module.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_rank_engine_trains_like_one_process_and_resumes(dtype: str,
                                                                  tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", FOURFOLD_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(WORKER.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), dtype], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    made = result["made"]
    assert made["process_group"] and made["engine"] and made["checkpoint_mesh"]
    assert made["axis_groups"] == ["data", "x", "y", "z"]
    assert made["parallel_linears"] == 15 and made["buckets"] >= 1
    assert made["collectives"] == ["all_gather", "all_reduce"]  # handed to gloo
    assert set(made["ledger"].values()) == {0}  # one-rank groups move nothing
    auto, always = result["auto"], result["always"]
    tolerance = 1e-5 if dtype == "float32" else BF16_LOSS_DRIFT
    for key in ("loss", "grad_norm"):
        assert len(always[key]) == len(auto[key]) == 4
        for a, b in zip(always[key], auto[key]):
            assert abs(a - b) <= tolerance * abs(b), f"{key}: {always[key]} vs {auto[key]}"
    # resumed from the step-2 checkpoint (the DTensor path), the run goes on as the whole one
    assert result["resumed"] == always
