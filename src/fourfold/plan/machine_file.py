"""Which machine a plan is for: a catalog name, this host (`cpu`), or a MACHINE.toml.

`load_machine(spec)` takes a name as `catalog.match_machine_name` reads it (a preset, a device,
`cpu`), or the path of a MACHINE.toml, which describes a cluster the catalog does not know, or
corrects one it does (measured bandwidths, GEMM efficiency). `fourfold probe` writes one.

MACHINE.toml (every key optional except where noted; unknown keys are an error):

    name = "mycluster"          # shown in the plan
    base = "perlmutter"         # start from a preset (or catalog device) and override below
    gpus_per_node = 4           # ranks that share a node (required without `base`)
    reserved_gib = 2.0          # memory per device the job cannot use (context, fragmentation)

    [device]
    base = "a100-40gb"          # start from a catalog device
    name = "A100-40GB"
    peak_bf16_tflops = 312.0    # dense tensor-core peak
    peak_fp32_tflops = 19.5     # what float32 training runs at (no TF32)
    peak_tf32_tflops = 156.0    # float32 GEMMs with TF32 on (omit where there is no TF32)
    memory_gib = 40.0
    hbm_gbps = 1555.0           # memory bandwidth, for memory-bound work (norms, optimizer)
    gemm_efficiency = 0.8       # fraction of peak a large, square GEMM reaches (calibrate!)
    gemm_half_dim = 96.0        # a GEMM dimension this small halves the efficiency
    op_overhead_us = 5.0        # launch / framework cost per kernel (matters for small models)
    shared_host = false         # true when all ranks of a node share one device (CPU)
    sm_count = 108              # SMs (CUs) per device
    comm_sms = 16               # SMs a running collective holds (NCCL's "N coll channels")

    [network]
    latency_us = 10.0           # per step of a ring (or level of a tree) across the network
    intra_node_gbps = 200.0     # used when no stride tables are given: a group inside a node
    inter_node_gbps = 20.0      # ... and a group that spans nodes

    # Measured tables (override intra/inter): effective GB/s by group size, one table per
    # stride between the ranks of the group. A stride uses the table of the largest listed
    # stride <= it; a group size uses the entry of the largest listed size <= it among the
    # entries on its side of the node boundary (size * stride > gpus_per_node: measured
    # across nodes; see Network.gbps).
    [network.stride_1]
    2 = 76.0
    4 = 225.0
    8 = 80.0
    [network.stride_2]
    2 = 76.0
    4 = 40.0

"Effective GB/s" means: the time of a collective is its ring volume per rank (all-reduce
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from fourfold.files import tomllib
from fourfold.plan.catalog import (DEVICES, MACHINE_NAMES, Device, Machine, Network,
                                   catalog_key_for_gpu, catalog_machine, match_device_name,
                                   match_machine_name)
from fourfold.plan.errors import PlanError
from fourfold.plan.host_probe import cpu_machine

_TOP_KEYS = {"name", "base", "gpus_per_node", "reserved_gib", "device", "network", "note"}
_DEVICE_KEYS = {f.name for f in dataclasses.fields(Device)} | {"base"}
_NETWORK_KEYS = {"latency_us", "intra_node_gbps", "inter_node_gbps"}


def named_machine(spec: str) -> Machine | None:
    """The machine a name stands for (`catalog.match_machine_name`: a preset, a catalog
    device's generic node, or `cpu`, probed), else None; ambiguous names are refused."""
    key = match_machine_name(spec)
    if key is None:
        return None
    return cpu_machine() if key == "cpu" else catalog_machine(key)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise PlanError(f"{where} = {value!r}: expected a non-negative number")
    return float(value)


def _device_from(table: dict[str, Any], base: Device | None, where: str) -> Device:
    unknown = set(table) - _DEVICE_KEYS
    if unknown:
        raise PlanError(f"{where}: unknown key [device].{sorted(unknown)[0]}; allowed: "
                        f"{', '.join(sorted(_DEVICE_KEYS))}")
    if "base" in table:
        key = match_device_name(str(table["base"]))
        if key is None:
            raise PlanError(f"{where}: [device].base = {table['base']!r}: choose one of "
                            f"{', '.join(DEVICES)}")
        base = DEVICES[key]
    values: dict[str, Any] = dataclasses.asdict(base) if base else {}
    for key, value in table.items():
        if key == "base":
            continue
        if key in ("name", "note"):
            values[key] = str(value)
        elif key == "shared_host":
            values[key] = bool(value)
        elif key == "sm_count":
            values[key] = int(_number(f"{where}: [device].{key}", value))
        else:
            values[key] = _number(f"{where}: [device].{key}", value)
    required = {"name", "peak_bf16_tflops", "peak_fp32_tflops", "memory_gib", "hbm_gbps"}
    missing = sorted(required - set(values))
    if missing:
        raise PlanError(f"{where}: [device] needs {', '.join(missing)} (or a `base` device)")
    return Device(**values)


def _network_from(table: dict[str, Any], base: Network | None, where: str) -> Network:
    values: dict[str, Any] = dataclasses.asdict(base) if base else {}
    tables: list[tuple[int, tuple[tuple[int, float], ...]]] = []
    for key, value in table.items():
        if key.startswith("stride_") and isinstance(value, dict):
            try:
                stride = int(key[len("stride_"):])
                entries = tuple(sorted((int(size), _number(f"{where}: [network.{key}].{size}", bw))
                                       for size, bw in value.items()))
            except ValueError:
                raise PlanError(f"{where}: [network.{key}]: expected `stride_N` with integer "
                                "group sizes as keys, e.g. `2 = 76.0`") from None
            if stride < 1 or not entries:
                raise PlanError(f"{where}: [network.{key}]: needs a stride >= 1 and at least "
                                "one `group_size = GB/s` entry")
            tables.append((stride, entries))
        elif key in _NETWORK_KEYS:
            values[key] = _number(f"{where}: [network].{key}", value)
        else:
            raise PlanError(f"{where}: unknown key [network].{key}; allowed: "
                            f"{', '.join(sorted(_NETWORK_KEYS))}, stride_N tables")
    if tables:
        values["stride_tables"] = tuple(sorted(tables))
    elif "intra_node_gbps" in table or "inter_node_gbps" in table:
        values["stride_tables"] = ()  # explicit intra/inter replace a base's tables
    return Network(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()})


def machine_from_toml(path: str | Path) -> Machine:
    """Read a MACHINE.toml (keys in this module's docstring)."""
    p = Path(path)
    where = str(p)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise PlanError(f"machine file {where!r}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"machine file {where!r}: not valid TOML: {e}") from None
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise PlanError(f"{where}: unknown key {sorted(unknown)[0]!r}; allowed: "
                        f"{', '.join(sorted(_TOP_KEYS))}")
    base: Machine | None = None
    if "base" in data:
        base = named_machine(str(data["base"]))
        if base is None:
            raise PlanError(f"{where}: base = {data['base']!r}: choose one of "
                            f"{', '.join(MACHINE_NAMES + tuple(DEVICES))}")
    device_table = data.get("device", {})
    network_table = data.get("network", {})
    if not isinstance(device_table, dict) or not isinstance(network_table, dict):
        raise PlanError(f"{where}: `device` and `network` must be [tables]")
    device = _device_from(device_table, base.device if base else None, where)
    network = _network_from(network_table, base.network if base else Network(), where)
    if "gpus_per_node" in data:
        per_node = data["gpus_per_node"]
        if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1:
            raise PlanError(f"{where}: gpus_per_node = {per_node!r}: expected a positive integer")
    elif base is not None:
        per_node = base.gpus_per_node
    else:
        raise PlanError(f"{where}: gpus_per_node is required (or give a `base` machine)")
    reserved = _number(f"{where}: reserved_gib",
                       data.get("reserved_gib", base.reserved_gib if base else 2.0))
    # a file based on the cpu machine keeps its host calibration (the same probe's timings)
    return Machine(name=str(data.get("name", p.stem)), device=device, gpus_per_node=per_node,
                   network=network, reserved_gib=reserved,
                   note=str(data.get("note", f"from {where}")),
                   probe_host=base.probe_host if base is not None else None)


def load_machine(spec: str | Machine) -> Machine:
    """A machine from a preset name, a catalog device name, or a MACHINE.toml path."""
    if isinstance(spec, Machine):
        return spec
    path_like = spec.endswith(".toml") or os.path.sep in spec
    machine = None if path_like else named_machine(spec)
    if machine is not None:
        return machine
    if path_like or Path(spec).is_file():
        if not Path(spec).is_file():
            raise PlanError(f"machine file {spec!r} does not exist")
        return machine_from_toml(spec)
    raise PlanError(f"unknown machine {spec!r}: choose a preset ({', '.join(MACHINE_NAMES)}), "
                    f"a device ({', '.join(DEVICES)}) or a MACHINE.toml path")



def machine_for_torch_device(device: Any, refresh: bool = False) -> Machine | None:
    """The catalog machine a torch.device runs on: this host for a CPU (probed; `refresh`
    probes again), a generic node of its catalog entry for a known GPU, else None."""
    if device.type == "cpu":
        return cpu_machine(refresh)
    if device.type == "cuda":
        import torch

        key = catalog_key_for_gpu(torch.cuda.get_device_name(device))
        return catalog_machine(key) if key is not None else None
    return None
