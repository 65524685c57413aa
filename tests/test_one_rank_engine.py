"""parallel.engine = "always": one process runs the whole engine as a one-rank grid (a one-rank
process group, fourfold's layers and collectives, the data-parallel buckets, the DTensor
checkpoint) and trains the same model as the default one-process path."""

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
from fourfold.parallel import Grid, parallelize
from fourfold.parallel.linear import Linear3D

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
        parallelize(build_model(cfg, seed=0), Grid.single(), ParallelConfig(engine="sometimes"))


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
