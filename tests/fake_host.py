"""This host's probes stood in for by known laws, so that planner tests never time this CPU
(the real probes have their own tests, marked `ranks`): what `host_probe._probe_cpu` and
`host_probe._run_comm_probe` return, made up."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from fourfold.plan import host_probe

CPU_PROBE = {"peak_flops": 4e10, "gemm_half_dim": 64.0, "copy_bytes_per_s": 1e10, "rates": {}}


def comm_probe(latency_s: float = 1e-3, per_byte_s: float = 2e-9,
               flops: float = 1e10) -> Callable[[int], dict[str, Any]]:
    """A comm probe of `world` ranks whose every collective over p ranks takes
    p x latency_s + ring volume x per_byte_s, with every compute rate given."""
    def probe(world: int) -> dict[str, Any]:
        comm = {}
        for p in range(2, world + 1):
            if world % p == 0:
                for op in ("all_reduce", "all_gather", "reduce_scatter"):
                    share = (p - 1) / p * (2 if op == "all_reduce" else 1)
                    comm[f"{op}/{p}"] = [(n, p * latency_s + per_byte_s * share * n)
                                         for n in (4096, 262144, 2097152)]
        return {"comm": comm, "matmul_flops": flops, "copy_bytes_per_s": 1e9,
                "small_op_s": 5e-5, "elementwise_bytes_per_s": 5e8, "loss_s_per_logit": 1e-8,
                "attention_forward_s_per_unit": 1e-10, "attention_s_per_unit": 3e-10,
                "noise_s_per_element": 1e-8}
    return probe


def use_fake_probes(monkeypatch: pytest.MonkeyPatch, latency_s: float = 1e-3,
                    per_byte_s: float = 2e-9) -> None:
    """The `cpu` machine reads CPU_PROBE and `comm_probe(latency_s, per_byte_s)`."""
    monkeypatch.setattr(host_probe, "_probe_cpu", lambda: dict(CPU_PROBE))
    monkeypatch.setattr(host_probe, "_run_comm_probe", comm_probe(latency_s, per_byte_s))
