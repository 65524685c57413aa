"""Hardware catalog: devices, clusters, and the bandwidth a collective sees.

A `Machine` is a device (peak FLOP/s, memory, memory bandwidth, how well it runs GEMMs of a
given shape) times a cluster (devices per node and a network). `load_machine(spec)` takes a
preset name (`perlmutter`, `frontier`, `alps`, `dgx-h100`, `cpu`), a device name from the
catalog (a generic node of such devices; its network numbers are estimates), or the path of a
MACHINE.toml.

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
2(p-1)/p of the buffer, all-gather / reduce-scatter (p-1)/p of the full buffer) divided by it.

The `cpu` machine (this host) is measured, not looked up. N training ranks share its cores, so
what a rank pays depends on N, and two probes fit the model (cached under
$FOURFOLD_CACHE/plan/, keyed by host, torch version, and for the second rank and core count):
- `measure_cpu` (~1 s, once): single-thread float32 matmuls at 128/256/512 give the GEMM shape
  law rate(d) = peak * (d / (d + gemm_half_dim))^3 (and a copy gives memory bandwidth).
- `measure_cpu_comm(N)` (~2-4 s, once per N, run the first time a grid of N ranks is
  predicted): a fresh interpreter forks N gloo ranks (FileStore rendezvous) that, all at once,
  as a job's axis groups do, time all-reduce, all-gather and reduce-scatter at 4 KiB, 512 KiB
  and 8 MiB for every group size p dividing N (median call, slowest rank); then, still all
  busy, a 256^3 matmul, an 8 MiB copy and a small autograd op loop, each looped by every rank
  for 0.4 s by its own clock (`_calls_per_second`).
From these (`host_calibration(N, ...)` -> `HostCalibration`):
- a collective over p ranks costs latency_p + ring volume x seconds_per_byte_p, both fitted by
  least squares over the three ops and three sizes of group size p. On an oversubscribed host
  the latency (ms, not us: every ring step waits for a descheduled rank) dominates small
  buffers, so per-call counts from the schedule matter as much as bytes.
- compute runs at the per-rank matmul rate with all N ranks busy (shape law above), the blocks'
  element-wise work at the rate of silu(gate) * up, the loss at cross-entropy's forward +
  backward time per logit (both with exps, on a CPU several times slower than a copy: a
  2048 x 4096 cross-entropy took 0.78 s on 2 ranks where 6 copy passes take 0.24 s), other
  memory-bound work (optimizer) at the per-rank copy rate, all with all N busy; every framework
  op costs the measured small-op time (N ranks' Python and autograd overhead queue on the
  same cores).
- overlap hides communication only where a core is spare: gloo moves bytes with CPU threads
  that compete with the GEMMs, so the engine's overlap is scaled by (cores - N) / N, clipped
  to [0, 1] (nothing hides when N >= cores).
Above 16 ranks the probe runs 16 and every cost is scaled by N / max(16, cores).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fourfold.config import cache_root, write_cache_json
from fourfold.files import tomllib
from fourfold.host import cores_available
from fourfold.intmath import GIB, divisors
from fourfold.plan.errors import PlanError


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16_tflops: float
    peak_fp32_tflops: float
    memory_gib: float
    hbm_gbps: float
    gemm_efficiency: float = 0.75
    gemm_half_dim: float = 96.0
    op_overhead_us: float = 5.0  # launch / framework cost of each kernel
    shared_host: bool = False
    peak_tf32_tflops: float | None = None  # float32 GEMMs with TF32 on; None: no such mode
    note: str = "vendor datasheet (dense); efficiencies are estimates"
    # SM contention (see `comm_sm_fraction`): the device's SMs (CUs), and how many of them a
    # running collective occupies (one CTA per NCCL/RCCL channel); 0: not modelled
    sm_count: int = 0
    comm_sms: float = 0.0

    @property
    def comm_sm_fraction(self) -> float:
        """The share of compute a collective takes while it runs under compute.

        NCCL (and RCCL, its port) runs each collective as a kernel of one CTA per channel, and
        a channel's CTA holds its SM exclusively: it does not share the SM with compute
        kernels (NCCL's maintainer, NVIDIA/nccl issue #689). So while a hidden collective runs,
        the GEMMs have (sm_count - comm_sms) SMs, and compute that overlaps it for t seconds
        takes comm_sms / sm_count x t longer (perf.py charges that). NCCL picks the fewest
        channels that reach a platform's bandwidth: "on DGX with 8 NICs and a top speed of
        190 GB/s, then it would use 16 SMs" (same issue); NCCL_MIN/MAX_NCHANNELS override it,
        and NCCL_DEBUG=INFO prints the count ("N coll channels") for a user's cluster to put
        in a MACHINE.toml. Memory-bandwidth contention (the kernels' reads and writes) is not
        modelled."""
        return self.comm_sms / self.sm_count if self.sm_count > 0 else 0.0

    def peak_flops(self, dtype: str, tf32: bool = False) -> float:
        """Peak FLOP/s of one device for GEMMs in `dtype` (float32 or bfloat16); `tf32`: float32
        GEMMs run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)."""
        if dtype == "bfloat16":
            return self.peak_bf16_tflops * 1e12
        if tf32 and self.peak_tf32_tflops is not None:
            return self.peak_tf32_tflops * 1e12
        return self.peak_fp32_tflops * 1e12


@dataclass(frozen=True)
class Network:
    latency_us: float = 10.0
    intra_node_gbps: float = 100.0
    inter_node_gbps: float = 20.0
    # ((stride, ((group_size, GB/s), ...)), ...), both sorted ascending; empty: use intra/inter
    stride_tables: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()

    def gbps(self, group_size: int, stride: int, gpus_per_node: int) -> float:
        """Effective GB/s of a collective over `group_size` ranks `stride` apart.

        Whether the group leaves a node is computed from the rank order (`spans_nodes`), and a
        table entry only answers for groups on the same side of that line as the one it was
        measured on (a `size = GB/s` entry of table `stride_S` was measured across nodes when
        size * S > gpus_per_node). So x = 6 on 4-GPU nodes gets the inter-node entry, not the
        NVLink one that the largest listed size <= 6 (4) would give.

        Across nodes, a node's egress is shared by the rings leaving it, one per group with a
        member in the node: min(stride, gpus_per_node) of them. The paper's tables show this
        law: the inter-node entries times that count are one number per machine (Perlmutter
        stride 1/2/4: 80 x 1 = 40 x 2 = 20 x 4 = 80 GB/s per node; Frontier: 40 x 1 = 20 x 2 =
        10 x 4 = 40). So an inter-node entry measured at stride S serves a larger stride scaled
        by min(S, n) / min(stride, n) (Frontier at stride >= 8: 10 x 4 / 8 = 5 GB/s).
        Tables with no inter-node entry at all serve every group as they are."""
        spans = spans_nodes(group_size, stride, gpus_per_node)
        if not self.stride_tables:
            # A group whose ranks all sit in one node uses the node's links; else the network.
            return self.inter_node_gbps if spans else self.intra_node_gbps
        chosen = 0
        for i, (listed_stride, _) in enumerate(self.stride_tables):
            if listed_stride <= stride:
                chosen = i

        def same_side(i: int) -> list[tuple[int, float]]:
            listed_stride, table = self.stride_tables[i]
            return [(size, bw) for size, bw in table
                    if (size * listed_stride > gpus_per_node) == spans]

        source = chosen
        entries = same_side(chosen)
        if not entries and spans:  # the nearest smaller, then larger, stride measured across
            order = list(range(chosen - 1, -1, -1)) + list(range(chosen + 1,
                                                                 len(self.stride_tables)))
            source = next((i for i in order if same_side(i)), chosen)
            entries = same_side(source)
        if not entries:
            return _entry(self.stride_tables[chosen][1], group_size)
        value = _entry(entries, group_size)
        if spans:
            measured_stride = self.stride_tables[source][0]
            value *= min(measured_stride, gpus_per_node) / min(stride, gpus_per_node)
        return value


def _entry(entries: "list[tuple[int, float]] | tuple[tuple[int, float], ...]",
           group_size: int) -> float:
    """The entry of the largest listed group size <= group_size (else the smallest listed)."""
    value = entries[0][1]
    for size, bw in entries:
        if size <= group_size:
            value = bw
    return value


def spans_nodes(group_size: int, stride: int, gpus_per_node: int) -> bool:
    """Whether some group of `group_size` ranks `stride` apart (the groups of one grid axis: x
    innermost, so stride = the product of the inner axes' sizes) holds ranks of two nodes, when
    ranks fill nodes in order. The groups of an axis run in lockstep, so one spanning group
    makes the collective an inter-node one."""
    if group_size <= 1:
        return False
    if stride >= gpus_per_node:
        return True
    block = stride * group_size  # consecutive ranks holding `stride` whole groups
    period = block * gpus_per_node // math.gcd(block, gpus_per_node)
    for base in range(0, period, block):
        for offset in range(stride):
            first = base + offset
            if first // gpus_per_node != (first + (group_size - 1) * stride) // gpus_per_node:
                return True
    return False


@dataclass(frozen=True)
class Machine:
    name: str
    device: Device
    gpus_per_node: int
    network: Network
    reserved_gib: float = 2.0
    note: str = ""
    # True only for the `cpu` machine: ranks share this host's cores, costs come from probes.
    probed_host: bool = False
    # world size -> HostCalibration: a search asks once per grid; the probe is read, fitted once
    _calibrations: dict[int, "HostCalibration"] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    def bandwidth_gbps(self, group_size: int, stride: int) -> float:
        return self.network.gbps(group_size, stride, self.gpus_per_node)

    def ranks_per_device(self, world_size: int) -> int:
        """How many ranks share one device's compute and memory (>1 only on a shared host)."""
        return min(world_size, self.gpus_per_node) if self.device.shared_host else 1

    def ranks_per_host(self, world_size: int) -> int:
        """How many ranks share one memory: on the probed `cpu` machine every rank of the job
        runs on this host (its gpus_per_node is the core count, which says nothing about
        where ranks live); on another shared-host machine a node's ranks share it; on GPUs,
        one device per rank."""
        return world_size if self.probed_host else self.ranks_per_device(world_size)

    def usable_memory_bytes(self, world_size: int) -> float:
        """What one rank may hold: its share of the memory it shares with the other ranks
        there, less `reserved_gib` per rank (the CUDA context, or on the cpu machine the
        interpreter and its libraries: a process with torch and fourfold imported measured
        0.29 GiB resident here)."""
        per_rank = self.device.memory_gib / self.ranks_per_host(world_size)
        return (per_rank - self.reserved_gib) * GIB

    def peak_flops_per_rank(self, dtype: str, world_size: int, tf32: bool = False) -> float:
        return self.device.peak_flops(dtype, tf32) / self.ranks_per_device(world_size)

    def job_peak_flops(self, dtype: str, world_size: int, tf32: bool = False) -> float:
        """Peak FLOP/s of a whole job of `world_size` ranks: the denominator of MFU, for the
        planner's prediction and the trainer's log alike."""
        return self.peak_flops_per_rank(dtype, world_size, tf32) * world_size

    def calibration(self, world_size: int) -> "HostCalibration | None":
        """The probed costs of `world_size` ranks on this host (cpu machine only, else None)."""
        if not self.probed_host:
            return None
        if world_size not in self._calibrations:
            self._calibrations[world_size] = host_calibration(
                world_size, cores=self.gpus_per_node, gemm_half_dim=self.device.gemm_half_dim)
        return self._calibrations[world_size]

    def calibrated(self, calibration: "HostCalibration") -> "Machine":
        """This machine with `calibration` for its rank count instead of the cached probe's
        (bench/plan_check.py: a probe taken inside the job it checks, under the same load)."""
        if not self.probed_host:
            raise PlanError(f"machine {self.name!r} is not probed: it takes no host calibration")
        machine = dataclasses.replace(self)
        machine._calibrations[calibration.world] = calibration
        return machine

    def hbm_bytes_per_s_per_rank(self, world_size: int) -> float:
        return self.device.hbm_gbps * 1e9 / self.ranks_per_device(world_size)


# --------------------------------------------------------------------------------------------
# Catalog: the one table of device peaks (the trainer's logged MFU reads it too, through
# `machine_for_torch_device`). Peaks are dense (no sparsity) vendor numbers per device as torch
# sees it; float32 is the rate of float32 GEMMs with TF32 off (PyTorch's default), TF32 the
# tensor-core rate with it on. gemm_efficiency values are estimates of what a large bf16 GEMM
# reaches; calibrate them with a MACHINE.toml for serious planning.
#
# Figures that need care:
# - MI250X: torch sees each of its two GCDs as a device, so the entry is one GCD (half of AMD's
#   per-package figures). AMD lists per package 47.9 TFLOP/s FP32 *vector* and 95.7 FP32
#   *matrix* (MFMA); float32 GEMMs (rocBLAS/hipBLASLt on gfx90a) run on the matrix cores, so a
#   GCD's float32 GEMM peak is 95.7 / 2 = 47.9 (its vector rate, 23.9, is what element-wise
#   work gets). bfloat16: 383 per package, 191.5 per GCD. CDNA2 has no TF32.
# - B200: NVIDIA's HGX B200 datasheet (1000 W, 8 GPUs per board) gives 600 TFLOP/s FP32 for the
#   board, 75 per GPU (the earlier Blackwell brief said 80; GB200's B200 at 1200 W is faster):
#   the entry is the HGX part, 180 GB as DGX B200 ships it.
# - MI300X: 1307.4 bfloat16, 653.7 TF32, 163.4 FP32 matrix (AMD datasheet, dense).
# - sm_count / comm_sms (Device.comm_sm_fraction): SMs per device from the vendors' architecture
#   papers (A100 108, H100 SXM/H200/GH200 132, H100 PCIe 114, B200 148); CUs per MI250X GCD 110,
#   MI300X 304. comm_sms = 16: the channel count NCCL's maintainer states for a node of 8 NICs
#   at 190 GB/s (NVIDIA/nccl #689), the one documented figure at this scale; Perlmutter's and
#   Alps's nodes (4 NICs) need no more. RCCL (NCCL's port, same channel logic) on MI250X: no
#   documented default was found, 16 is assumed; on MI300-class parts RCCL runs more (MI350X
#   multi-node: 64 channels, 48 since RCCL 2.30.4, ROCm/rocm-systems PR #9764), so MI300X's
#   figure is optimistic. Neither constant is fitted to any result; a MACHINE.toml sets them
#   from its own NCCL_DEBUG=INFO log ("N coll channels").

DEVICES: dict[str, Device] = {
    "a100-40gb": Device("A100-40GB", 312.0, 19.5, 40.0, 1555.0, gemm_efficiency=0.80,
                        peak_tf32_tflops=156.0,
                        sm_count=108, comm_sms=16.0),
    "a100-80gb": Device("A100-80GB", 312.0, 19.5, 80.0, 2039.0, gemm_efficiency=0.80,
                        peak_tf32_tflops=156.0,
                        sm_count=108, comm_sms=16.0),
    "h100-sxm": Device("H100-SXM", 989.0, 67.0, 80.0, 3350.0, gemm_efficiency=0.70,
                       gemm_half_dim=128.0, peak_tf32_tflops=494.7,
                       sm_count=132, comm_sms=16.0),
    "h100-pcie": Device("H100-PCIe", 756.0, 51.2, 80.0, 2000.0, gemm_efficiency=0.70,
                        gemm_half_dim=128.0, peak_tf32_tflops=378.0,
                        sm_count=114, comm_sms=16.0),
    "h200": Device("H200", 989.0, 67.0, 141.0, 4800.0, gemm_efficiency=0.72,
                   gemm_half_dim=128.0, peak_tf32_tflops=494.7,
                   sm_count=132, comm_sms=16.0),
    "gh200": Device("GH200", 989.0, 67.0, 96.0, 4000.0, gemm_efficiency=0.72,
                    gemm_half_dim=128.0, peak_tf32_tflops=494.7,
                    sm_count=132, comm_sms=16.0),
    "mi250x-gcd": Device("MI250X-GCD", 191.5, 47.9, 64.0, 1638.0, gemm_efficiency=0.60,
                         gemm_half_dim=128.0,
                         sm_count=110, comm_sms=16.0),
    "mi300x": Device("MI300X", 1307.4, 163.4, 192.0, 5300.0, gemm_efficiency=0.55,
                     gemm_half_dim=160.0, peak_tf32_tflops=653.7,
                     sm_count=304, comm_sms=16.0),
    "b200": Device("B200", 2250.0, 75.0, 180.0, 7700.0, gemm_efficiency=0.70,
                   gemm_half_dim=160.0, peak_tf32_tflops=1100.0,
                   sm_count=148, comm_sms=16.0),
}

# torch.cuda.get_device_name() substring -> catalog key. The first match wins, so the more
# specific names come first ("GH200" before "H200", "H100 PCIe" before "H100").
TORCH_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("GH200", "gh200"), ("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"),
    ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"), ("A100-PCIE-80GB", "a100-80gb"),
    ("A100", "a100-40gb"), ("MI250X", "mi250x-gcd"), ("MI300X", "mi300x"), ("B200", "b200"),
)


def catalog_key_for_gpu(torch_name: str) -> str | None:
    """The catalog key of a GPU by the name torch gives it, or None for an unknown one."""
    for substring, key in TORCH_DEVICE_NAMES:
        if substring in torch_name:
            return key
    return None


_PAPER = "network: effective GB/s measured by the SC24 paper's authors"
_ESTIMATE = "network: estimates (not measured)"

_PRESETS: dict[str, Machine] = {
    "perlmutter": Machine(
        "perlmutter", DEVICES["a100-40gb"], gpus_per_node=4,
        network=Network(latency_us=10.0, stride_tables=(
            (1, ((2, 76.0), (4, 225.0), (8, 80.0))),
            (2, ((2, 76.0), (4, 40.0))),
            (4, ((2, 20.0),)),
            # strides >= 8: derived, not listed (a placeholder was): see Network.gbps
        )), note=_PAPER),
    "frontier": Machine(
        "frontier", DEVICES["mi250x-gcd"], gpus_per_node=8,
        network=Network(latency_us=15.0, stride_tables=(
            (1, ((2, 129.0), (4, 52.0), (8, 135.0), (16, 40.0))),
            (2, ((2, 50.0), (4, 72.0), (8, 20.0))),
            (4, ((2, 36.0), (4, 10.0))),
            # strides >= 8: derived, not listed (a placeholder was): see Network.gbps
        )), note=_PAPER),
    # 4 GH200 per node, all-to-all NVLink; 4 Slingshot-11 NICs (25 GB/s each) per node.
    "alps": Machine(
        "alps", DEVICES["gh200"], gpus_per_node=4,
        network=Network(latency_us=10.0, stride_tables=(
            (1, ((2, 130.0), (4, 200.0), (8, 22.0))),
            (2, ((2, 130.0), (4, 20.0))),
            (4, ((2, 18.0),)),  # strides >= 8: derived (see Network.gbps)
        )), note=_ESTIMATE),
    # NVSwitch inside the node; 8x400 Gb/s InfiniBand per node.
    "dgx-h100": Machine(
        "dgx-h100", DEVICES["h100-sxm"], gpus_per_node=8,
        network=Network(latency_us=8.0, intra_node_gbps=360.0, inter_node_gbps=40.0),
        note=_ESTIMATE),
}

MACHINE_NAMES: tuple[str, ...] = tuple(_PRESETS) + ("cpu",)


def _generic_node(key: str) -> Machine:
    device = DEVICES[key]
    per_node = 4 if key == "gh200" else 8
    intra = {"a100-40gb": 230.0, "a100-80gb": 230.0, "h100-pcie": 50.0, "mi250x-gcd": 50.0,
             "mi300x": 300.0, "b200": 700.0}.get(key, 360.0)
    inter = {"a100-40gb": 20.0, "a100-80gb": 20.0, "mi250x-gcd": 20.0, "b200": 80.0}.get(key, 40.0)
    return Machine(key, device, gpus_per_node=per_node,
                   network=Network(latency_us=10.0, intra_node_gbps=intra, inter_node_gbps=inter),
                   note=f"generic node of {per_node} {device.name}; {_ESTIMATE}")


# --------------------------------------------------------------------------------------------
# The CPU this runs on, measured.


def cache_dir() -> Path:
    """Where measured numbers are kept: $FOURFOLD_CACHE, else ~/.cache/fourfold."""
    return cache_root() / "plan"


def _probe_key() -> str:
    """What a cached probe belongs to: this host, its cores and torch. Not the caller's
    thread count: the probe times its GEMMs on one thread and its copy on every core, so a
    one-process run and a rank (one thread) read the same probe instead of overwriting each
    other's."""
    import torch

    return f"{platform.node()}|{platform.machine()}|{cores_available()}|{torch.__version__}"


def _time_matmul(size: int, budget_s: float, device: Any = None, dtype: Any = None) -> float:
    """FLOP/s of a size^3 matmul (float32 on the CPU unless told), best of as many runs as fit
    in budget_s: the GEMM timing of both the cpu machine's probe and `fourfold probe`."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    cuda = a.device.type == "cuda"
    torch.mm(a, b)  # warm-up: thread pool, allocation
    if cuda:
        torch.cuda.synchronize(a.device)
    best = float("inf")
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return 2.0 * size**3 / best


def _time_copy(budget_s: float) -> float:
    """Bytes/s of a large copy (read + write), the memory bandwidth memory-bound work sees."""
    import torch

    src = torch.empty(16 * 1024 * 1024)  # 64 MiB, larger than caches
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return 2 * src.numel() * 4 / best


def _fit_half_dim(rates: dict[int, float]) -> tuple[float, float]:
    """Fit rate(d) = peak * (d / (d + h))^3 to measured rates; return (peak, h)."""
    import math

    best = (float("inf"), 0.0, max(rates.values()))
    for step in range(0, 129):  # h in [0, 512]: beyond that the probe is noise, not shape
        h = step * 4.0
        peaks = [r / (d / (d + h)) ** 3 for d, r in rates.items()]
        peak = math.exp(sum(math.log(p) for p in peaks) / len(peaks))
        err = sum((math.log(r) - math.log(peak * (d / (d + h)) ** 3)) ** 2
                  for d, r in rates.items())
        if err < best[0]:
            best = (err, h, peak)
    return best[2], best[1]


def _read_probe(path: Path, key: str) -> dict[str, Any] | None:
    """A probe's cached result when its key matches (a damaged cache reads as none)."""
    if not path.is_file():
        return None
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cached if isinstance(cached, dict) and cached.get("key") == key else None


def _cached_probe(path: Path, key: str, refresh: bool,
                  measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A probe's result from its cache file when the key matches, else measured and cached
    (written atomically; a damaged cache is measured again, a read-only one only costs a
    re-measurement next time)."""
    cached = None if refresh else _read_probe(path, key)
    if cached is not None:
        return cached
    result = dict(measure(), key=key)
    write_cache_json(path, result)
    return result


def measure_cpu(refresh: bool = False) -> dict[str, float]:
    """Measure (or read from the cache) this CPU's matmul rate and memory bandwidth (~1 s).
    This is the one CPU FLOP probe: the planner's `cpu` machine and the trainer's logged MFU
    both read it. A probe taken while the host was busy reads low, so `refresh` (the trainer
    asks for one when its MFU would exceed 100%) keeps the faster of the old and new result."""
    path, key = cache_dir() / "cpu_probe.json", _probe_key()
    old = _read_probe(path, key) if refresh else None
    result = _cached_probe(path, key, refresh, _probe_cpu)
    if old is not None and float(old["peak_flops"]) > float(result["peak_flops"]):
        write_cache_json(path, old)
        return old
    return result


def _probe_cpu() -> dict[str, Any]:
    import torch

    # One thread, scaled by the core count: ranks split the cores anyway, and a busy host
    # stalls multi-threaded small GEMMs on thread wake-ups, which is noise, not shape.
    # The copy runs on every core: the host's bandwidth, which the ranks share.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rates = {size: _time_matmul(size, 0.2) for size in (128, 256, 512)}
        torch.set_num_threads(cores_available())
        copy_bytes_per_s = _time_copy(0.1)
    finally:
        torch.set_num_threads(threads)
    peak, half_dim = _fit_half_dim(rates)
    peak *= cores_available()
    return {"peak_flops": peak, "gemm_half_dim": half_dim, "copy_bytes_per_s": copy_bytes_per_s,
            "rates": {str(k): v for k, v in rates.items()}}


# The comm probe: N local gloo ranks, timed together, as a training job of N ranks on this host
# would run them. Rank counts above _MAX_PROBE_RANKS are extrapolated (see host_calibration).
_MAX_PROBE_RANKS = 16
_PROBE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_PROBE_SIZES = (4 * 1024, 512 * 1024, 8 * 1024 * 1024)  # bytes per call, as the ledger counts
_PROBE_REPEATS = (15, 7, 3)  # calls timed per size (fixed, so every rank issues the same calls)


def ring_volume(op: str, group_size: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective (all-reduce 2(p-1)/p of the buffer,
    all-gather / reduce-scatter (p-1)/p of the full buffer)."""
    share = (group_size - 1) / group_size
    return (2 * share if op == "all_reduce" else share) * nbytes


def time_collective(op: str, group: Any, group_size: int, sizes: tuple[int, ...],
                    repeats: tuple[int, ...], device: Any, dtype: Any) -> list[tuple[int, float]]:
    """(bytes per call, median seconds) of `op` over `group` at each buffer size (the full
    buffer, as the ledger counts it), every rank of every probed group calling at once: the
    one timing both the cpu machine's probe and `fourfold probe` use."""
    import torch
    import torch.distributed as dist

    elem = torch.empty((), dtype=dtype).element_size()
    points = []
    for nbytes, count in zip(sizes, repeats):
        numel = max(group_size, nbytes // elem // group_size * group_size)
        full = torch.ones(numel, dtype=dtype, device=device)
        part = torch.ones(numel // group_size, dtype=dtype, device=device)

        def call() -> None:
            if op == "all_reduce":
                dist.all_reduce(full, group=group)
            elif op == "all_gather":
                dist.all_gather_into_tensor(full, part, group=group)
            else:
                dist.reduce_scatter_tensor(part, full, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        call()  # warm-up: connections, buffers
        times = []
        for _ in range(count):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        points.append((numel * elem, sorted(times)[len(times) // 2]))
    return points


# (sequences, heads, seq, head_dim) of the attention probe: plan_check's per-rank shape
_ATTENTION_PROBE_SHAPE = (4, 8, 128, 32)
_BUSY_WINDOW_S = 0.4  # per compute probe: long against barrier skew and scheduler slices


def _calls_per_second(work: Callable[[], Any]) -> float:
    """How often this rank runs `work` per second while every rank runs it, as a synchronous
    step sees it. First each rank counts its calls in a window of _BUSY_WINDOW_S by its own
    clock (no collective inside it). Ranks that share cores do not all run for the whole of
    their windows (a rank released early from the barrier, or finished early, has the cores
    to fewer others), so those rates overstate the shared rate: on 8 ranks over 2 cores they
    summed to twice the machine's GEMM peak and every prediction of bench/plan_check.py was
    about 2x too fast. So then every rank runs the number of calls the slowest rank made in
    the window, between two barriers: the time until the last rank is done is the rate."""
    import torch
    import torch.distributed as dist

    work()  # warm-up: allocation, autograd graph
    dist.barrier()
    calls, start = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= _BUSY_WINDOW_S:
            break
    slowest = torch.tensor([calls / elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    n = max(1, int(float(slowest) * _BUSY_WINDOW_S))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        work()
    dist.barrier()  # ends when the last rank is done
    return n / (time.perf_counter() - start)


def probe_groups(world: int) -> dict[int, Any]:
    """This rank's group of every size p > 1 dividing `world` (consecutive ranks, as the x
    axis; on loopback the stride does not matter). Every rank must call it, once."""
    import torch.distributed as dist

    rank, mine = dist.get_rank(), {}
    for p in divisors(world)[1:]:
        groups = [dist.new_group(list(range(g, g + p))) for g in range(0, world, p)]
        mine[p] = groups[rank // p]
    return mine


def measure_host_costs(groups: dict[int, Any]) -> dict[str, Any]:
    """One rank's part of the host probe, in an initialised gloo job whose every rank calls it:
    collectives over each of `groups` (all groups of a size at once), then a matmul, a copy and
    a small-op loop with every rank busy. `merge_rank_probes` combines the ranks' parts."""
    import torch

    out: dict[str, Any] = {"comm": {}}
    for p, group in sorted(groups.items()):
        for op in _PROBE_OPS:
            points = time_collective(op, group, p, _PROBE_SIZES, _PROBE_REPEATS,
                                     torch.device("cpu"), torch.float32)
            out["comm"][f"{op}/{p}"] = points
    # compute with every rank busy. Each rank loops for a fixed window after a common barrier
    # and divides by its own elapsed time: timed between two barriers, a short loop measured
    # the barriers instead (16 256^3 GEMMs are ~4 ms of work per rank against ~10-20 ms for a
    # gloo barrier of 8 ranks on 2 cores: the GEMM rate read 2-4x low, every prediction slow)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out["matmul_flops"] = 2 * 256**3 * _calls_per_second(lambda: torch.mm(a, b))
    src, dst = torch.ones(2 * 1024 * 1024), torch.empty(2 * 1024 * 1024)  # 8 MiB: past caches
    out["copy_bytes_per_s"] = 2 * src.numel() * 4 * _calls_per_second(lambda: dst.copy_(src))
    x = torch.ones(8, requires_grad=True)
    # small ops with autograd: framework cost, not arithmetic (mul, sum, and their backward)
    out["small_op_s"] = 1 / 4 / _calls_per_second(lambda: (x * 2.0).sum().backward())
    # element-wise work as a block runs it: SwiGLU's silu(gate) * up (an exp per element: on a
    # CPU slower than a copy), counted as the 3 tensors it reads and writes
    gate, up = torch.randn(2 * 1024 * 1024), torch.randn(2 * 1024 * 1024)
    out["elementwise_bytes_per_s"] = 3 * gate.numel() * 4 * _calls_per_second(
        lambda: torch.nn.functional.silu(gate) * up)
    # the seeded noise mezo and es perturb the weights with, added into a weight: its integer
    # hash and Box-Muller are ~45 element-wise ops on int32 and float32, whose CPU speed does
    # not follow silu's (measured here at 1 and 2 threads: 30 to 210 silu-bytes an element),
    # so the probe times the generator itself (imported here only: the planner never imports
    # the trainer otherwise)
    from fourfold.train.methods.noise import CHUNK_ELEMENTS, ShardNoise

    # (a 16 MiB weight, past the caches, a chunk at a time as add_noise makes it)
    rows = 16 * CHUNK_ELEMENTS // 256
    weight = torch.zeros(rows, 256)
    noise = ShardNoise((rows, 256), (rows, 256), (0, 0), torch.device("cpu"))

    def perturb() -> None:
        for start, stop in noise.chunks():
            weight[start:stop].add_(noise.sample(start, stop, 1).mul_(1e-3))

    out["noise_s_per_element"] = 1 / weight.numel() / _calls_per_second(perturb)
    # the loss over the logits, forward and backward (log-softmax: exps, several passes)
    logits = torch.randn(512, 4096, requires_grad=True)
    targets = torch.randint(0, 4096, (512,))
    out["loss_s_per_logit"] = 1 / logits.numel() / _calls_per_second(
        lambda: torch.nn.functional.cross_entropy(logits, targets).backward())
    # causal attention as the blocks run it (scaled_dot_product_attention), forward and
    # forward + backward, per unit of sequences x heads x seq^2 x head_dim: torch's CPU kernel
    # runs at 20-40 GFLOP/s here, a fifth of a GEMM's rate, so GEMM-rate attention read 5-10x
    # fast (a profile of bench/plan_check.py's one-process step: 33-45 ms against 7 modelled)
    q, k, v = (torch.randn(*_ATTENTION_PROBE_SHAPE, requires_grad=True) for _ in range(3))
    units = math.prod(_ATTENTION_PROBE_SHAPE) * _ATTENTION_PROBE_SHAPE[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        out["attention_forward_s_per_unit"] = 1 / units / _calls_per_second(
            lambda: sdpa(q, k, v, is_causal=True))
    out["attention_s_per_unit"] = 1 / units / _calls_per_second(
        lambda: sdpa(q, k, v, is_causal=True).sum().backward())
    return out


def merge_rank_probes(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's probe from its ranks' parts: a collective ends when its slowest rank does;
    compute is shared evenly, so it is averaged."""
    world = len(ranks)
    return {"comm": {k: [(n, max(r["comm"][k][i][1] for r in ranks))
                         for i, (n, _) in enumerate(ranks[0]["comm"][k])]
                     for k in ranks[0]["comm"]},
            **{k: sum(r[k] for r in ranks) / world for k in ranks[0] if k != "comm"}}


def _probe_rank(rank: int, world: int, store_path: str) -> dict[str, Any]:
    """One forked rank of the cpu machine's probe: its own gloo job, then the host costs."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out = measure_host_costs(probe_groups(world))
    dist.destroy_process_group()
    return out


def _probe_main(world: int, result_path: str) -> None:
    """Entry of the probe's subprocess: fork `world` ranks after torch is imported once (a
    fresh interpreter per rank would cost a torch import each), merge their results. The ranks'
    files go next to `result_path`, in the caller's temporary directory."""
    import torch  # noqa: F401  (imported before the fork, so each rank skips it)

    tmp = os.path.dirname(result_path)
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                result = _probe_rank(rank, world, os.path.join(tmp, "store"))
                Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
            except BaseException:  # noqa: BLE001  (report and leave; the parent sees the code)
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    if failed:
        sys.exit(f"{len(failed)} probe ranks failed")
    ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    Path(result_path).write_text(json.dumps(merge_rank_probes(ranks)))


def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 16.0


def _run_comm_probe(world: int) -> dict[str, Any]:
    """Run the comm probe in a fresh interpreter (the caller may itself be a gloo rank)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fourfold-probe-") as tmp:
        result = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # not part of the caller's job
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from fourfold.plan.machines import _probe_main; "
             "_probe_main(int(sys.argv[1]), sys.argv[2])", str(world), result],
            env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not os.path.isfile(result):
            raise PlanError(f"the cpu comm probe with {world} ranks failed: "
                            f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
        return json.loads(Path(result).read_text())


def measure_cpu_comm(world: int, refresh: bool = False) -> dict[str, Any]:
    """Probe (or read from the cache) what `world` gloo ranks on this host pay: collectives by
    group size and buffer size, the matmul rate and the small-op cost per rank (~2-4 s)."""
    path = cache_dir() / f"cpu_comm_{world}ranks_{cores_available()}cores.json"
    # v5: attention probed,
    # v4: compute rates shared by all ranks (v3 read up to 2x high on shared cores),
    # v3: compute rates timed by `_calls_per_second` (v1 caches read 2-4x low: re-measure),
    # element-wise and loss rates probed
    return _cached_probe(path, f"{_probe_key()}|{world}|v5", refresh,
                         lambda: _run_comm_probe(world))


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares fit of seconds = latency + volume * seconds_per_byte to (ring volume,
    seconds) points, both terms kept non-negative; returns (latency_s, seconds_per_byte)."""
    n = len(points)
    mean_v = sum(v for v, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((v - mean_v) ** 2 for v, _ in points)
    slope = sum((v - mean_v) * (t - mean_t) for v, t in points) / var if var > 0 else 0.0
    if slope <= 0.0:
        return mean_t, 0.0
    latency = mean_t - slope * mean_v
    if latency < 0.0:
        # a busy host slowed the larger calls and tilted the line below the origin; no call
        # is free, and the smallest one is bound by latency (its bytes take microseconds), so
        # its time stands for the latency; the rate is the line through the origin
        smallest = min(points)[1]
        return smallest, sum(v * t for v, t in points) / sum(v * v for v, _ in points)
    return latency, slope


@dataclass(frozen=True)
class HostCalibration:
    """What one rank pays when `world` ranks share this host, fitted from the comm probe."""

    world: int
    cores: int
    # group size -> (latency s, s per ring byte); all ops pooled (gloo's rings cost alike)
    collective_fit: tuple[tuple[int, tuple[float, float]], ...]
    flops_per_rank: float  # a large GEMM's rate with every rank busy
    bytes_per_s_per_rank: float  # memory-bound work (copies, element-wise) with every rank busy
    op_overhead_s: float  # framework cost of one op with every rank busy
    scale: float = 1.0  # > 1 when world exceeds the probed rank count (extrapolated)
    elementwise_bytes_per_s: float = 0.0  # silu * mul with every rank busy (0: as copies)
    loss_s_per_logit: float = 0.0  # cross-entropy forward + backward (0: as 6 copy passes)
    # causal attention per sequence x head x seq^2 x head_dim (0: at the GEMM rate)
    attention_forward_s_per_unit: float = 0.0
    attention_s_per_unit: float = 0.0  # forward + backward
    noise_s_per_element: float = 0.0  # mezo / es: seeded noise added into a weight (0: unprobed)

    def collective_seconds(self, op: str, group_size: int, nbytes: float) -> float:
        fit = self.collective_fit[0][1]
        for size, f in self.collective_fit:  # the largest probed group size <= this one
            if size <= group_size:
                fit = f
        latency, per_byte = fit
        return self.scale * (latency + per_byte * ring_volume(op, group_size, nbytes))

    @property
    def overlap_efficiency(self) -> float:
        """Fraction of the engine's overlap that still hides communication. gloo moves bytes
        with CPU threads: a collective hides under compute only on a core no rank needs."""
        return min(1.0, max(0.0, (self.cores - self.world) / self.world))


def host_calibration(world: int, cores: int, gemm_half_dim: float) -> HostCalibration:
    """What `world` ranks on this host of `cores` cores pay, fitted from the comm probe (run
    once per rank count and cached); gemm_half_dim is the single-thread GEMM shape law's."""
    probed = min(world, _MAX_PROBE_RANKS)
    return calibration_from_probe(measure_cpu_comm(probed), world, probed, cores, gemm_half_dim)


def calibration_from_probe(probe: dict[str, Any], world: int, probed: int, cores: int,
                           gemm_half_dim: float) -> HostCalibration:
    """Fit a HostCalibration for `world` ranks to a probe of `probed` ranks (the dict that
    `measure_cpu_comm` caches, or `merge_rank_probes` of a job's own `measure_host_costs`)."""
    by_size: dict[int, list[tuple[float, float]]] = {}
    for name, points in probe["comm"].items():
        op, size = name.split("/")
        by_size.setdefault(int(size), []).extend(
            (ring_volume(op, int(size), n), t) for n, t in points)
    fits = tuple(sorted((size, fit_latency_bandwidth(pts)) for size, pts in by_size.items()))
    if not fits:  # one rank: no collectives were probed, and none will be issued
        fits = ((1, (0.0, 0.0)),)
    # the probe times 256^3 GEMMs; undo their shape loss to get a large GEMM's rate
    shape = (256 / (256 + gemm_half_dim)) ** 3
    # beyond the probed count, ranks time-share the cores further: costs grow with them
    scale = max(1.0, world / max(probed, cores))
    return HostCalibration(world=world, cores=cores, collective_fit=fits,
                           flops_per_rank=probe["matmul_flops"] / shape / scale,
                           bytes_per_s_per_rank=probe["copy_bytes_per_s"] / scale,
                           op_overhead_s=probe["small_op_s"] * scale, scale=scale,
                           elementwise_bytes_per_s=probe.get("elementwise_bytes_per_s", 0.0)
                           / scale,
                           loss_s_per_logit=probe.get("loss_s_per_logit", 0.0) * scale,
                           attention_forward_s_per_unit=probe.get(
                               "attention_forward_s_per_unit", 0.0) * scale,
                           attention_s_per_unit=probe.get("attention_s_per_unit", 0.0) * scale,
                           noise_s_per_element=probe.get("noise_s_per_element", 0.0) * scale)


def machine_for_torch_device(device: Any, refresh: bool = False) -> Machine | None:
    """The catalog machine a torch.device runs on: this host for a CPU (probed; `refresh`
    probes again), a generic node of its catalog entry for a known GPU, else None."""
    if device.type == "cpu":
        return cpu_machine(refresh)
    if device.type == "cuda":
        import torch

        key = catalog_key_for_gpu(torch.cuda.get_device_name(device))
        return _generic_node(key) if key is not None else None
    return None


def cpu_machine(refresh: bool = False) -> Machine:
    """This host as a machine: ranks share its cores and memory; gloo over loopback."""
    probe = measure_cpu(refresh)
    tflops = probe["peak_flops"] / 1e12
    device = Device("cpu", peak_bf16_tflops=tflops, peak_fp32_tflops=tflops,
                    memory_gib=_host_memory_gib(), hbm_gbps=probe["copy_bytes_per_s"] / 1e9,
                    gemm_efficiency=1.0, gemm_half_dim=probe["gemm_half_dim"],
                    op_overhead_us=20.0, shared_host=True,
                    note="measured by a matmul probe (float32; bfloat16 assumed equal)")
    return Machine("cpu", device, gpus_per_node=cores_available(),
                   network=Network(latency_us=50.0, intra_node_gbps=2.0, inter_node_gbps=2.0),
                   reserved_gib=0.5,
                   probed_host=True,
                   note="compute and gloo collectives probed with the job's rank count")


# --------------------------------------------------------------------------------------------
# Loading


_TOP_KEYS = {"name", "base", "gpus_per_node", "reserved_gib", "device", "network", "note"}
_DEVICE_KEYS = {f.name for f in dataclasses.fields(Device)} | {"base"}
_NETWORK_KEYS = {"latency_us", "intra_node_gbps", "inter_node_gbps"}


def _named(spec: str) -> Machine | None:
    key = spec.lower()
    if key == "cpu":
        return cpu_machine()
    if key in _PRESETS:
        return _PRESETS[key]
    if key in DEVICES:
        return _generic_node(key)
    return None


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
        if str(table["base"]).lower() not in DEVICES:
            raise PlanError(f"{where}: [device].base = {table['base']!r}: choose one of "
                            f"{', '.join(DEVICES)}")
        base = DEVICES[str(table["base"]).lower()]
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
        base = _named(str(data["base"]))
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
                   probed_host=base.probed_host if base is not None else False)


def load_machine(spec: str | Machine) -> Machine:
    """A machine from a preset name, a catalog device name, or a MACHINE.toml path."""
    if isinstance(spec, Machine):
        return spec
    machine = _named(spec)
    if machine is not None:
        return machine
    if spec.endswith(".toml") or os.path.sep in spec or Path(spec).is_file():
        if not Path(spec).is_file():
            raise PlanError(f"machine file {spec!r} does not exist")
        return machine_from_toml(spec)
    raise PlanError(f"unknown machine {spec!r}: choose a preset ({', '.join(MACHINE_NAMES)}), "
                    f"a device ({', '.join(DEVICES)}) or a MACHINE.toml path")
