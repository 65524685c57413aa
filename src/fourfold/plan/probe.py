"""`fourfold probe --machine-out MACHINE.toml`: measure the cluster the job runs on.

Run under torchrun or srun, one process per device, on the nodes a training job would use:

    torchrun --nproc-per-node 4 --nnodes 2 ... -m fourfold.cli probe --machine-out mine.toml
    fourfold plan --model 8b --gpus 8 --machine mine.toml

Every rank times square GEMMs at a few sizes on its device (the cpu machine's probe's
`time_matmul`; the slowest rank's rate counts), fitted to rate(d) = peak * (d/(d+h))^3 as
the cpu machine is (`fit_gemm_shape_law`): gemm_efficiency = fitted peak / the datasheet peak of
`--base`'s device, gemm_half_dim = h. Then, for every stride s and group size p of the grid
axes a job of this size can have (s * p dividing the world; all groups of one
(s, p) at once, as an axis's groups run), all-reduce, all-gather and reduce-scatter at a few
buffer sizes (`time_collective`, the cpu probe's timing); latency + ring volume x seconds per
byte is fitted over the three ops (`fit_latency_bandwidth`, the cpu calibration's fit), and
1 / seconds-per-byte is the table's effective GB/s at [network.stride_s] p. The latency per
ring step (fitted latency / steps, median over the groups that span nodes, else all) is
[network] latency_us. Rank 0 writes the MACHINE.toml (`machine_from_toml` reads it).

On this CPU (gloo) the same timings calibrate the `cpu` machine (its comm probe calls
`time_collective`); a MACHINE.toml written here has `base = "cpu"` and is planned with the
host calibration, its tables recorded for reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from fourfold.parsing import ArgumentParser
from fourfold.plan.catalog import catalog_key_for_gpu, ring_volume
from fourfold.plan.errors import PlanError
from fourfold.plan.host_probe import (PROBE_OPS, fit_gemm_shape_law, fit_latency_bandwidth,
                                      time_collective, time_matmul)
from fourfold.plan.machine_file import load_machine

_GPU_SIZES = (512, 1024, 2048, 4096, 8192)
_CPU_SIZES = (128, 256, 512)
_BUFFER_BYTES = (64 * 1024, 4 * 1024 * 1024, 64 * 1024 * 1024)
_REPEATS = (9, 5, 3)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fourfold probe", description="Measure GEMM rates and collective "
                       "bandwidth/latency of this job's ranks; write a MACHINE.toml for the "
                       "planner.", usage_error=PlanError)
    p.add_argument("--machine-out", required=True, help="the MACHINE.toml to write")
    p.add_argument("--base", help="preset or catalog device whose datasheet peaks and memory "
                   "the file keeps (default: cpu on CPU, else guessed from the device name)")
    p.add_argument("--name", help="machine name in the file (default: the file's stem)")
    p.add_argument("--gemm-sizes", help="comma-separated square GEMM sizes")
    p.add_argument("--buffer-bytes", help="comma-separated collective buffer sizes (bytes)")
    p.add_argument("--max-group", type=int, default=0, help="largest group size to probe "
                   "(default: the world size)")
    return p


def _ints(text: str | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise PlanError(f"--{what} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise PlanError(f"--{what} {text!r}: every value must be a positive integer")
    return values


def _guess_base(device_name: str) -> str:
    """The catalog device of a GPU by torch's name for it (as the trainer's MFU reads it)."""
    key = catalog_key_for_gpu(device_name)
    if key is None:
        raise PlanError(f"cannot tell which catalog device {device_name!r} is: pass --base")
    return key


def group_specs(world: int, max_group: int) -> list[tuple[int, int]]:
    """(stride, group size) pairs a grid of `world` ranks can give an axis: the axis's size p
    and the product s of the sizes inside it, with s * p dividing the world."""
    return [(s, p) for s in range(1, world) if world % s == 0
            for p in range(2, min(world // s, max_group) + 1) if (world // s) % p == 0]


def probe(gemm_sizes: tuple[int, ...] | None, buffer_bytes: tuple[int, ...],
          max_group: int) -> dict:
    """This rank's part of the probe (collective: every rank of the job calls it)."""
    import torch
    import torch.distributed as dist

    from fourfold.parallel.grid import init_distributed

    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = gemm_sizes or (_GPU_SIZES if cuda else _CPU_SIZES)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(1)  # as the cpu machine's probe: per-core rate, no wake-up noise
    rates = {s: time_matmul(s, 0.2, device, dtype) for s in sizes}
    torch.set_num_threads(threads)
    repeats = (_REPEATS * len(buffer_bytes))[:len(buffer_bytes)]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    fits: dict[tuple[int, int], tuple[float, float]] = {}
    for stride, p in group_specs(world, max_group or world):
        ranks = [[base + offset + k * stride for k in range(p)]
                 for base in range(0, world, stride * p) for offset in range(stride)]
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        points = []
        for op in PROBE_OPS:
            for nbytes, t in time_collective(op, group, p, buffer_bytes, repeats, device,
                                             dtype):
                points.append((ring_volume(op, p, nbytes), t, op))
        # the slowest rank decides a collective's time
        local_times = torch.tensor([t for _, t, _ in points], dtype=torch.float64)
        if cuda:
            local_times = local_times.to(device)
        dist.all_reduce(local_times, op=dist.ReduceOp.MAX)
        times = local_times.cpu().tolist()
        pairs = [(v, t) for (v, _, _), t in zip(points, times)]
        latency, per_byte = fit_latency_bandwidth(pairs)
        if per_byte <= 0.0:
            # the buffers were too small (or the host too busy) for time to grow with volume:
            # the largest buffer's rate, latency included, is a lower bound on the bandwidth
            volume, seconds = max(pairs)
            per_byte = seconds / volume if volume > 0 else 0.0
        fits[(stride, p)] = (latency, per_byte)
    gathered = [None] * world
    dist.all_gather_object(gathered, rates)
    slowest = {s: min(r[s] for r in gathered) for s in sizes}  # type: ignore[index]
    return {"rank": rank, "world": world, "local": local, "device": device,
            "rates": slowest, "fits": fits}


def machine_toml(result: dict, base: str, name: str) -> str:
    """The MACHINE.toml text for a probe's result."""
    base_machine = load_machine(base)
    peak, half_dim = fit_gemm_shape_law(result["rates"])
    cpu = result["device"].type != "cuda"
    dtype = "float32" if cpu else "bfloat16"
    if cpu:
        peak *= os.cpu_count() or 1  # per-core rate, as the cpu machine counts its peak
    datasheet = base_machine.device.peak_flops(dtype)
    local = result["local"]
    lines = [f"# written by `fourfold probe` on {result['world']} ranks ({local} per node), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f'name = "{name}"', f'base = "{base}"']
    if not cpu:  # the cpu machine's gpus_per_node is its core count, which its calibration uses
        lines.append(f"gpus_per_node = {local}")
    lines += ["",
             "[device]", f"# fitted {dtype} GEMM peak {peak / 1e12:.3g} TFLOP/s of the "
             f"datasheet's {datasheet / 1e12:.3g}; sizes {sorted(result['rates'])}",
             f"gemm_efficiency = {min(1.0, peak / datasheet):.4f}",
             f"gemm_half_dim = {half_dim:.1f}", ""]
    if cpu:
        lines.insert(-1, f"peak_fp32_tflops = {peak / 1e12:.6g}")
    step_latencies, spanning = [], []
    tables: dict[int, list[tuple[int, float]]] = {}
    for (stride, p), (latency, per_byte) in sorted(result["fits"].items()):
        if per_byte > 0:
            tables.setdefault(stride, []).append((p, 1.0 / per_byte / 1e9))
        per_step = latency / (p - 1)  # all ops pooled: the ring steps of a gather
        (spanning if stride * p > local else step_latencies).append(per_step)
    latency_us = statistics.median(spanning or step_latencies or [0.0]) * 1e6
    lines += ["[network]", f"latency_us = {latency_us:.2f}"]
    for stride, entries in sorted(tables.items()):
        lines += ["", f"[network.stride_{stride}]"]
        lines += [f"{p} = {gbps:.4g}" for p, gbps in entries]
    return "\n".join(lines) + "\n"


def probe_main(argv: list[str]) -> int:
    """Entry point of `fourfold probe`; raises PlanError for user mistakes."""
    import torch.distributed as dist

    args = build_parser().parse_args(argv)
    gemm_sizes = _ints(args.gemm_sizes, (), "gemm-sizes") or None
    buffers = _ints(args.buffer_bytes, _BUFFER_BYTES, "buffer-bytes")
    if args.max_group < 0:
        raise PlanError(f"--max-group {args.max_group}: must be a positive integer")
    if "WORLD_SIZE" not in os.environ and "SLURM_NTASKS" not in os.environ:
        raise PlanError("fourfold probe measures a job's ranks: run it under torchrun or srun "
                        "(e.g. torchrun --nproc-per-node 2 -m fourfold.cli probe ...)")
    start = time.perf_counter()
    result = probe(gemm_sizes, buffers, args.max_group)
    if result["rank"] == 0:
        device = result["device"]
        base = args.base or ("cpu" if device.type != "cuda" else
                             _guess_base(__import__("torch").cuda.get_device_name(device)))
        out = Path(args.machine_out)
        text = machine_toml(result, base, args.name or out.stem)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"probed {result['world']} ranks in {time.perf_counter() - start:.1f} s; "
              f"wrote {out} (use: fourfold plan --machine {out})")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(probe_main(sys.argv[1:]))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
