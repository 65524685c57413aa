"""This host as the `cpu` machine: its costs are measured, not looked up.

N training ranks share this host's cores, so what a rank pays depends on N, and two probes fit
the model (cached under $FOURFOLD_CACHE/plan/, keyed by host, torch version, and for the second
rank and core count):
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

`fourfold probe` (plan/probe.py) times a cluster's GEMMs and collectives with this module's
timings (`time_matmul`, `time_collective`) and fits them as the calibration does
(`fit_gemm_shape_law`, `fit_latency_bandwidth`).
"""

from __future__ import annotations

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
from fourfold.host import cores_available
from fourfold.intmath import divisors
from fourfold.plan.catalog import Device, Machine, Network, ring_volume
from fourfold.plan.errors import PlanError


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


def time_matmul(size: int, budget_s: float, device: Any = None, dtype: Any = None) -> float:
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


def time_copy(budget_s: float) -> float:
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


def fit_gemm_shape_law(rates: dict[int, float]) -> tuple[float, float]:
    """Fit rate(d) = peak * (d / (d + h))^3 to measured rates; return (peak, h)."""
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
        rates = {size: time_matmul(size, 0.2) for size in (128, 256, 512)}
        torch.set_num_threads(cores_available())
        copy_bytes_per_s = time_copy(0.1)
    finally:
        torch.set_num_threads(threads)
    peak, half_dim = fit_gemm_shape_law(rates)
    peak *= cores_available()
    return {"peak_flops": peak, "gemm_half_dim": half_dim, "copy_bytes_per_s": copy_bytes_per_s,
            "rates": {str(k): v for k, v in rates.items()}}


# The comm probe: N local gloo ranks, timed together, as a training job of N ranks on this host
# would run them. Rank counts above _MAX_PROBE_RANKS are extrapolated (see host_calibration).
_MAX_PROBE_RANKS = 16
PROBE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_PROBE_SIZES = (4 * 1024, 512 * 1024, 8 * 1024 * 1024)  # bytes per call, as the ledger counts
_PROBE_REPEATS = (15, 7, 3)  # calls timed per size (fixed, so every rank issues the same calls)



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
        for op in PROBE_OPS:
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
    # so the probe times the generator itself
    from fourfold.noise import CHUNK_ELEMENTS, ShardNoise

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
            [sys.executable, "-c", "import sys; from fourfold.plan.host_probe import _probe_main; "
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
                   reserved_gib=0.5, probe_host=host_calibration,
                   note="compute and gloo collectives probed with the job's rank count")
