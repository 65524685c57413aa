"""The hardware catalog: devices, clusters, and the bandwidth a collective sees.

A `Machine` is a device (peak FLOP/s, memory, memory bandwidth, how well it runs GEMMs of a
given shape) times a cluster (devices per node and a network). The catalog holds the presets
(`perlmutter`, `frontier`, `alps`, `dgx-h100`) and the devices, each of which also names a
generic node of such devices (its network numbers are estimates). `match_machine_name` reads a
name as users type it: case, `-`, `_` and spaces do not matter, a family name means its usual
part (`h100`: h100-sxm, `a100`: a100-40gb) and a start that fits one name means that one
(`mi250x`, `mi300`, `dgx`); one that fits several is refused with the candidates. The `cpu`
machine is probed, not looked up (plan/host_probe.py); a MACHINE.toml describes any other
(plan/machine_file.py, whose `load_machine` takes all three).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fourfold.intmath import GIB
from fourfold.plan.errors import PlanError

if TYPE_CHECKING:
    from fourfold.plan.host_probe import HostCalibration



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


def ring_volume(op: str, group_size: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring collective (all-reduce 2(p-1)/p of the buffer,
    all-gather / reduce-scatter (p-1)/p of the full buffer)."""
    share = (group_size - 1) / group_size
    return (2 * share if op == "all_reduce" else share) * nbytes


@dataclass(frozen=True)
class Machine:
    name: str
    device: Device
    gpus_per_node: int
    network: Network
    reserved_gib: float = 2.0
    note: str = ""
    # Only for the `cpu` machine (and files based on it): its ranks share this host's cores,
    # and what `world` of them pay is measured, by host_probe.host_calibration(world, cores,
    # gemm_half_dim) with the machine's core count and GEMM shape law
    probe_host: Callable[[int, int, float], HostCalibration] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    # world size -> HostCalibration: a search asks once per grid; the probe is read, fitted once
    _calibrations: dict[int, "HostCalibration"] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)

    @property
    def probed_host(self) -> bool:
        """Whether this is this host, its costs probed (the `cpu` machine or a file based on
        it), rather than a cluster described by numbers."""
        return self.probe_host is not None

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
        if self.probe_host is None:
            return None
        if world_size not in self._calibrations:
            self._calibrations[world_size] = self.probe_host(
                world_size, self.gpus_per_node, self.device.gemm_half_dim)
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
# machine_file.machine_for_torch_device). Peaks are dense (no sparsity) vendor numbers per
# device as torch sees it; float32 is the rate of float32 GEMMs with TF32 off (PyTorch's default), TF32 the
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

# Machines by name: the presets and this host (`cpu`, built by host_probe.cpu_machine).
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


def catalog_machine(key: str) -> Machine:
    """The preset of that name, or a generic node of the catalog device `key` (a name as
    `match_machine_name` returns it, other than `cpu`)."""
    return _PRESETS[key] if key in _PRESETS else _generic_node(key)


# --------------------------------------------------------------------------------------------
# Names as users type them

# Short names for the part a family name most often means, as torch's device names read
# (TORCH_DEVICE_NAMES): a bare "H100" is the SXM part, a bare "A100" the 40 GB one.
SHORT_NAMES: dict[str, str] = {"h100": "h100-sxm", "a100": "a100-40gb"}


def _plain(name: str) -> str:
    """A name as matched: lower case, without `-`, `_` and spaces."""
    return "".join(c for c in name.lower() if c not in "-_ ")


def match_name(spec: str, names: tuple[str, ...], what: str,
               short_names: dict[str, str] | None = None) -> str | None:
    """The one of `names` that `spec` stands for, ignoring case, `-`, `_` and spaces: the name
    itself, a short name (`short_names`: short -> name), or the start of exactly one of them.
    None when it starts none; a one-line PlanError naming the candidates when it starts
    several."""
    plain, short = _plain(spec), short_names or {}
    if not plain:
        return None
    exact = [n for n in names if _plain(n) == plain]
    exact += [n for s, n in short.items() if _plain(s) == plain]
    if exact:
        return exact[0]
    candidates = [n for n in names if _plain(n).startswith(plain)]
    candidates += [n for s, n in short.items()
                   if _plain(s).startswith(plain) and n not in candidates]
    if len(candidates) > 1:
        raise PlanError(f"{what} {spec!r} is ambiguous: it could be {', '.join(candidates)}; "
                        "name one of them")
    return candidates[0] if candidates else None


def match_machine_name(spec: str) -> str | None:
    """The preset, `cpu` or catalog device that `spec` names (see `match_name`), else None."""
    return match_name(spec, MACHINE_NAMES + tuple(DEVICES), "machine", SHORT_NAMES)


def match_device_name(spec: str) -> str | None:
    """The catalog device that `spec` names (see `match_name`), else None."""
    return match_name(spec, tuple(DEVICES), "device", SHORT_NAMES)
