"""`fourfold probe`: 2 gloo ranks measure, rank 0 writes a MACHINE.toml that plan reads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from fourfold.plan import PlanError, load_machine
from fourfold.plan.cli import plan_main
from fourfold.plan.probe import group_specs, probe_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_group_specs_are_the_axes_a_grid_can_have():
    assert group_specs(2, 2) == [(1, 2)]
    assert group_specs(8, 8) == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)]
    assert group_specs(8, 2) == [(1, 2), (2, 2), (4, 2)]
    assert group_specs(6, 6) == [(1, 2), (1, 3), (1, 6), (2, 3), (3, 2)]


def test_probe_outside_a_job_is_one_clear_line(monkeypatch):
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PlanError, match="torchrun or srun"):
        probe_main(["--machine-out", "x.toml"])
    with pytest.raises(PlanError, match="gemm-sizes"):
        probe_main(["--machine-out", "x.toml", "--gemm-sizes", "a,b"])


@pytest.mark.ranks
def test_probe_on_two_gloo_ranks_writes_a_machine_plan_reads(tmp_path, capsys, monkeypatch):
    out = tmp_path / "here.toml"
    port = _free_port()
    env_base = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), FOURFOLD_CACHE=str(tmp_path / "cache"),
                    OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "fourfold", "probe", "--machine-out", str(out),
         "--gemm-sizes", "32,64,128", "--buffer-bytes", "4096,65536"],
        env=dict(env_base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert f"wrote {out}" in outputs[0]
    machine = load_machine(str(out))
    assert machine.name == "here" and machine.probed_host  # based on the cpu machine
    (stride, table), = machine.network.stride_tables
    assert stride == 1 and table[0][0] == 2 and table[0][1] > 0
    assert machine.network.latency_us > 0
    assert 0 < machine.device.gemm_efficiency <= 1 and machine.device.gemm_half_dim >= 0
    assert machine.bandwidth_gbps(2, 1) == table[0][1]
    # plan reads it as it reads any MACHINE.toml
    monkeypatch.setenv("FOURFOLD_CACHE", env_base["FOURFOLD_CACHE"])
    capsys.readouterr()
    assert plan_main(["--model", "debug", "--gpus", "1", "--machine", str(out), "--json",
                      "--global-batch", "2", "--seq", "64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["machine"]["name"] == "here"
    assert result["configurations"][0]["grid"] == {"data": 1, "z": 1, "y": 1, "x": 1}


def test_a_noisy_probe_still_fits_a_positive_latency() -> None:
    """A busy host that slows the larger calls tilts the fitted line below the origin; the
    latency is then the smallest call's time (it is bound by latency), never zero."""
    from fourfold.plan.host_probe import fit_latency_bandwidth

    latency, per_byte = fit_latency_bandwidth([(4096, 10e-6), (65536, 500e-6)])
    assert latency == 10e-6 and per_byte > 0
    latency, per_byte = fit_latency_bandwidth([(4096, 100e-6), (65536, 130e-6)])
    assert abs(latency - 98e-6) < 1e-9 and abs(per_byte - 30e-6 / 61440) < 1e-15
