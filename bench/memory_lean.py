"""Memory per training method: each method's peak memory and speed against AdamW's, beside
the planner's prediction.

Library mode (the default): each method trains the same model (float32 unless --dtype
bfloat16, which runs the forward under bfloat16 autocast as the trainer does; activation
checkpointing on) for a few steps in a fresh process; its peak RSS above a process that only
imports fourfold is given as a ratio to AdamW's, and its tokens/s (steps after the first)
beside AdamW's. A step of MeZO is two forwards, of ES `--population` forwards: tokens/s counts
the batch's tokens once per step, so it compares steps, not forwards. BlockLLM runs at its
default sparsity (0.9); its first step selects, the middle ones train that selection and the
last one (of 3 or more) reselects, the method's largest step and the one the planner predicts.
GaLore refreshes its projection in the first, untimed step (`first step` shows its cost).

    python bench/memory_lean.py [--preset small] [--steps 4] [--batch 2] [--seq 128]
        [--methods adamw lomo ...] [--grid 2x2 [--grid-only]] [--tuned-malloc] [--phases]
        [--set METHOD:SECTION.KEY=VALUE] [--output-loss auto|blocks|whole]
        [--device cpu|cuda] [--dtype float32|bfloat16]
    python bench/memory_lean.py --cli [--preset 15m] [--grid 2x2] [--every 2] [--steps 4]
        [--config examples/grid_2x2.toml]

--device cuda: one process on GPU 0; the peak is torch.cuda.max_memory_allocated, against the
planner's GPU prediction (no host-side runtime in it).
--grid XxY: the same methods on x * y gloo ranks (torchrun, data = z = 1), each rank's peak
above the same baseline, beside the one-process ratios.
--tuned-malloc: glibc tuned as `fourfold train` tunes CPU runs and ranks; without it, freed
blocks that glibc keeps read as resident memory, which the planner does not model.
--phases: where each run's heap peaks (its 5 largest phases), the library code it paged in,
and at the largest heap in use that a named call began with, how much of that heap is tensors
Python reaches (the rest: the runtime's, torch's and gloo's own allocations, and tensors only
C++ holds, such as autograd's saved inputs).
--cli: each method through the command line as a user starts it, `fourfold train CONFIG
[--nproc N]` (--config's data and model, with --preset, the method and the grid set on it),
with a checkpoint every --every steps (0: none); rank 0's peak from the run's summary.json
(VmHWM) above a process that only imports torch and fourfold, beside the planner's total for
a CPU rank (fourfold.plan.memory.predicted_memory of the run's own config.toml: what the run's
fits-check uses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, job_env, mib, parse_grid  # noqa: E402
from common import parser as bench_parser  # noqa: E402
from lean_quality import parse_extra  # noqa: E402  METHOD:SECTION.KEY=VALUE, as lean_quality's

METHODS = ("adamw", "lomo", "adalomo", "mezo", "es", "blockllm", "galore")


def child(preset: str, method: str, steps: int, batch: int, seq: int, population: int,
          grid: tuple[int, int] = (1, 1), phases: bool = False, tuned: bool = False,
          sets: tuple[str, ...] = (), output_loss: str = "auto", device: str = "cpu") -> dict:
    """Train `method` for `steps` steps on this process (on a grid: this rank of an x by y
    grid, under torchrun) and report its peak RSS (VmHWM, KiB) and the rest of a row.
    `sets`: this method's extra `train.KEY=VALUE` keys (--set). On `device` "cuda" the peak
    is the GPU's instead: torch.cuda.max_memory_allocated (`gpu_bytes`), from zero."""
    import torch

    import fourfold  # noqa: F401  (the baseline process imports this much)
    if method == "none":
        return {"rss_kib": peak_kib()}
    from fourfold.config import ParallelConfig, model_config
    from fourfold.methods import method_spec
    from fourfold.models import build_model
    from fourfold.parallel import Grid, GridShape, init_distributed, parallelize
    from fourfold.train.host_memory import HostMemory
    from fourfold.train.methods import StepData, build_method

    cfg = train_config(method, seq, population, sets)
    policy = HostMemory(device == "cpu", grid[0] * grid[1], cfg.dtype)  # as build_run makes it
    if tuned:  # as build_run tunes a CPU run (the environment part comes from measure*)
        policy.tune()
    # what the process holds after the imports, before it joins the job (--phases prints it)
    base_kib = peak_kib()
    torch.set_num_threads(1)
    x, y = grid
    shape = GridShape(data=1, z=1, y=y, x=x)
    if shape.size > 1:  # gloo ranks on the host (--grid refuses --device cuda)
        _, _, rank_device = init_distributed("gloo", timeout_s=600)
        the_grid = Grid.build(shape, rank_device)
    else:
        the_grid = Grid.single(device)
    sampler = PeakSampler() if phases else None
    # on the meta device, as build_run does: parallelize makes this rank's shard of each tensor
    model = build_model(model_config(preset), seed=0, device="meta")
    model.activation_checkpointing = cfg.activation_checkpointing
    pmodel = parallelize(model, the_grid, ParallelConfig(x=x, y=y, output_loss=output_loss),
                         blocked_loss=method_spec(method).blocked_loss,
                         grad_buffers=policy.grad_buffers())
    trainer = build_method(pmodel, cfg, hooks=policy.hooks())
    if sampler is not None:
        sampler.label("built")
        sampler.instrument(pmodel, trainer)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps):
        # x and y split the weights, not the batch: every rank of the grid sees all of it
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        if sampler is not None:
            sampler.label(f"step {i}")
        if method == "blockllm" and i == steps - 1 and i >= 2:
            # the last step reselects, as block_patience steps without a better loss make it:
            # its backward hands off every gradient while the moments of the old selection
            # are still held, the method's largest step (and the one the planner predicts)
            trainer.selecting_next = True
        start = time.perf_counter()
        result = trainer.step(pmodel, StepData.one_batch(pmodel, tokens, cfg.dtype), cfg.lr)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {"rss_kib": peak_kib(), "base_kib": base_kib,
           "tokens_per_s": batch * seq * (len(times) - 1) / sum(times[1:]),
           "first_step_s": times[0], "peak_grad_bytes": trainer.peak_grad_bytes,
           "predicted": predicted_bytes(model.cfg, cfg, batch * seq, shape, output_loss,
                                        on_host=device == "cpu"),
           "loss": float(result.loss), "state_bytes": trainer.state_bytes()}
    if device == "cuda":
        out["gpu_bytes"] = torch.cuda.max_memory_allocated()
    if sampler is not None:
        out["phases"] = sampler.stop()
        out["files_bytes"] = sampler.files
        out["census"] = sampler.census
    return out


def peak_kib() -> int:
    """This process's own peak RSS in KiB (the trainer's peak_memory_bytes: VmHWM on Linux;
    getrusage's ru_maxrss would read this script's own peak in a child it started)."""
    import torch

    from fourfold.train.metrics import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu")) // 1024


class PeakSampler:
    """--phases: a thread that reads glibc's heap in use (mallinfo2: what malloc has handed
    out, brk and mmap) and VmRSS every millisecond, and the label of the phase the main
    thread is in (set at the step's parts: forward, backward, each method's update), so the
    report says what was alive at each peak. torch's kernels release the GIL, so it samples
    during them too."""

    def __init__(self) -> None:
        import gc
        import threading

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import rank_memory_worker as w

        self._heap, self._rss = w._heap, lambda: w._status("VmRSS")
        self._files = lambda: w._status("RssFile")  # resident pages of mapped files (code)
        gc.collect()  # garbage freed during the run would read as a lower heap
        self._base = (self._heap()[0], self._rss())
        self._files_base = self._files()
        self.files = 0  # mapped files' resident bytes added by the run, set by stop
        self._label = "build"
        self.peaks: dict[str, list[int]] = {}  # label: [heap used, rss] maxima above start
        # the largest heap in use that a labelled call began with, the bytes of the tensors
        # Python reaches then (gc's objects), and the call: what of the heap is not tensors
        self.census = [0, 0, ""]
        self._wrapped: list[tuple[object, str, object]] = []  # (owner, attr, its own value)
        self._before = set(self._storages())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def label(self, name: str) -> None:
        self._sample()
        self._label = name

    def _sample(self) -> None:
        heap, rss = self._heap()[0] - self._base[0], self._rss() - self._base[1]
        peak = self.peaks.setdefault(self._label, [0, 0])
        peak[0], peak[1] = max(peak[0], heap), max(peak[1], rss)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self._sample()

    def wrap(self, owner: object, attr: str, name: str) -> None:
        """Label calls of owner.attr `name`; a call whose first argument is a parameter's
        view (a method's per-tensor work: GaLore's projection at a hand-off) adds its name.
        stop() puts owner.attr back."""
        inner, raw = getattr(owner, attr), vars(owner).get(attr)  # raw: owner's own, if any
        self._wrapped.append((owner, attr, raw))

        def wrapped(*args, **kwargs):
            outer = self._label
            tensor = getattr(args[0], "name", None) if args else None
            part = f"{name} {tensor}" if isinstance(tensor, str) else name
            self.label(outer.split(" / ")[0] + " / " + part)
            self._take_census()
            try:
                return inner(*args, **kwargs)
            finally:
                self.label(outer)

        setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)

    def _take_census(self) -> None:
        """At a new largest heap in use: the bytes of the CPU tensors' storages that Python
        objects reach (each storage once). Tensors only C++ holds (autograd's saved inputs)
        count as the rest, with the allocations of the runtime, torch and gloo. Only the
        tensors made since the sampler started count, as only their heap does."""
        heap = self._heap()[0] - self._base[0]
        if heap <= self.census[0]:
            return
        storages = self._storages()
        self.census = [heap, sum(n for ptr, n in storages.items() if ptr not in self._before),
                       self._label]

    @staticmethod
    def _storages() -> dict[int, int]:
        """The CPU tensor storages that Python objects reach: address -> bytes."""
        import gc

        import torch

        storages: dict[int, int] = {}
        for obj in gc.get_objects():
            # type(), not isinstance: that asks obj.__class__, which some objects warn on
            if (issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu"
                    and obj.layout == torch.strided and not obj.is_meta):
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return storages

    def instrument(self, pmodel, trainer) -> None:
        from fourfold.parallel import embedding
        from fourfold.train.methods import zeroth

        self.wrap(pmodel.module, "forward", "forward")
        for attr in ("update", "_update", "_projection", "_project", "finish_backward"):
            if hasattr(trainer, attr):
                self.wrap(trainer, attr, attr)
        if hasattr(pmodel, "finish_backward"):
            self.wrap(pmodel, "finish_backward", "finish_backward")
        self.wrap(zeroth, "add_noise", "add_noise")
        self.wrap(embedding._OutputCrossEntropy, "backward", "loss backward")  # blocked loss

    def stop(self) -> dict[str, list[int]]:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.files = self._files() - self._files_base
        for owner, attr, raw in reversed(self._wrapped):
            if raw is None:  # wrap gave owner an attribute of its own over its class's
                delattr(owner, attr)
            else:
                setattr(owner, attr, raw)
        self._wrapped.clear()
        return self.peaks


def train_config(method: str, seq: int, population: int, sets: tuple[str, ...] | list[str] = ()):
    """The run's [train] section: the method, lr 1e-4, `seq`, activation checkpointing on,
    ES's population, then `sets` (train.KEY=VALUE strings, typed and checked as `fourfold
    train --set` checks them: train.activation_checkpointing=false turns it off)."""
    from fourfold.config import load_config

    keys = [f"train.optimizer={method}", "train.lr=1e-4", f"train.seq_len={seq}",
            "train.activation_checkpointing=true"]
    if method == "es":
        keys.append(f"train.method.population={population}")
    return load_config(overrides=[*keys, *sets]).train


def method_sets(args: argparse.Namespace, method: str) -> list[str]:
    """--dtype and --set's keys for `method`, as train.KEY=VALUE."""
    return [f"train.dtype={args.dtype}",
            *(f"{key}={value}" for m, key, value in args.extra if m == method)]


def check_sets(args: argparse.Namespace) -> None:
    """--set: keys of the methods being run, with values of their types; in library mode only
    [train] keys (before any process starts: one line and a non-zero exit, no traceback)."""
    from fourfold.config import ConfigError, load_config

    for method, key, value in args.extra:
        if not args.cli and not key.startswith("train."):
            fail(f"--set {method}:{key}={value}: only train.KEY keys apply here (--cli takes "
                 "any key)")
        if method not in args.methods and method != "adamw":
            fail(f"--set {method}:{key}={value}: {method} is not in --methods")
    for method in dict.fromkeys(["adamw", *args.methods]):
        try:
            if args.cli:
                load_config(args.config, cli_sets(args, method, (1, 1)))
            else:
                train_config(method, args.seq, args.population, method_sets(args, method))
        except ConfigError as e:
            fail(f"--set for {method}: {e}")


def predicted_bytes(model_cfg, train_cfg, tokens: int, shape, output_loss: str = "auto",
                    on_host: bool = True) -> int:
    """The planner's peak for this run, per rank (plan/memory.py with the method's state, at
    train_cfg.dtype), without the final export's term: these runs train and stop, writing no
    model (a forward-only method's planned peak would be the export's block: MeZO's and ES's
    one process read +14.9% with it, 125m)."""
    from fourfold.methods import method_spec
    from fourfold.parallel.embedding import resolve_output_loss
    from fourfold.plan.memory import Precision, predict_memory, predict_method_memory

    precision = Precision.of(train_cfg.dtype)
    output_loss = resolve_output_loss(output_loss,
                                      method_spec(train_cfg.optimizer).blocked_loss)
    mem = predict_memory(model_cfg, shape, tokens, train_cfg.activation_checkpointing,
                         precision, on_host=on_host, output_loss=output_loss)
    mem = dataclasses.replace(mem, export=0)
    return predict_method_memory(mem, model_cfg, shape, train_cfg, precision,
                                 output_loss).total


def measure(args: argparse.Namespace, method: str) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import memory_lean as m; "
            f"print(json.dumps(m.child({args.preset!r}, {method!r}, {args.steps}, {args.batch}, "
            f"{args.seq}, {args.population}, phases={args.phases}, tuned={args.tuned_malloc}, "
            f"sets={tuple(method_sets(args, method))!r}, output_loss={args.output_loss!r}, "
            f"device={args.device!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=malloc_env(args))
    if proc.returncode:
        fail(f"{method} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def malloc_env(args: argparse.Namespace) -> dict[str, str]:
    """--tuned-malloc: the environment `fourfold train --nproc` gives CPU ranks (no tcache)."""
    from fourfold.host import rank_malloc_environment

    return dict(os.environ, **(rank_malloc_environment() if args.tuned_malloc else {}))


def measure_grid(args: argparse.Namespace, method: str, grid: tuple[int, int]) -> list[dict]:
    """One torchrun launch of x * y gloo ranks on this host; each rank's row, rank order."""
    env = job_env(**malloc_env(args), OMP_NUM_THREADS="1")
    spec = json.dumps([args.preset, method, args.steps, args.batch, args.seq, args.population,
                       list(grid), args.phases, args.tuned_malloc, method_sets(args, method),
                       args.output_loss])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(grid[0] * grid[1]), __file__, "--rank-worker", spec]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    if proc.returncode or not lines:
        fail(f"{method} on {grid[0]}x{grid[1]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def rank_worker(spec: str) -> None:
    import torch.distributed as dist

    from fourfold.parallel import leave_job

    preset, method, steps, batch, seq, population, grid, phases, tuned, sets, output_loss = \
        json.loads(spec)
    row = child(preset, method, steps, batch, seq, population, tuple(grid), phases, tuned,
                tuple(sets), output_loss)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(json.dumps(rows), flush=True)
    dist.barrier()
    leave_job(0)


def print_phases(rows: dict, top: int = 5) -> None:
    """Per method, its `top` phases by peak heap in use (MiB above the start of the build),
    each the largest over the steps (which step it was in brackets)."""
    for m, r in rows.items():
        if "phases" not in r:
            continue
        merged: dict[str, tuple[int, int, str]] = {}
        for label, (heap, rss) in r["phases"].items():
            step, _, phase = label.partition(" / ")
            if not step.startswith("step "):  # build, built: no step
                key, step = label, ""
            else:
                key = phase or "rest of the step"
            if key not in merged or heap > merged[key][0]:
                merged[key] = (heap, rss, step)
        best = sorted(merged.items(), key=lambda kv: -kv[1][0])[:top]
        files = (f"; mapped files +{r['files_bytes'] / 2**20:.0f} MiB by the end"
                 if "files_bytes" in r else "")
        print(f"  {m}: " + "; ".join(
            f"{k}{f' ({s})' if s else ''}: heap {h / 2**20:.0f} rss {rss / 2**20:.0f}"
            for k, (h, rss, s) in best) + files)
        if r.get("census", [0])[0]:
            heap, tensors, label = r["census"]
            print(f"    at {label} (the largest heap a named call began with): heap "
                  f"{heap / 2**20:.0f} MiB, of it tensors Python reaches {tensors / 2**20:.0f}, "
                  f"the rest {(heap - tensors) / 2**20:.0f}")


def parser() -> argparse.ArgumentParser:
    from fourfold.config import CHOICES

    ap = bench_parser(__doc__)
    ap.add_argument("--preset", default=None, help="model preset (default small; 15m with --cli)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--population", type=int, default=4, help="ES members per step")
    ap.add_argument("--output-loss", default="auto", choices=CHOICES[("parallel", "output_loss")],
                    help="parallel.output_loss of every run (auto: blocks for lomo, adalomo, "
                    "mezo, es, blockllm and galore, whole logits for adamw)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--grid", default=None, metavar="XxY",
                    help="also run every method on x * y gloo ranks (data = z = 1), per rank")
    ap.add_argument("--phases", action="store_true",
                    help="the 5 phases of each run with the most heap in use (the largest over "
                         "the steps; a method's per-tensor work named by its tensor), with RSS "
                         "(on a grid: each rank's), the resident pages of mapped files (library "
                         "code) the run added, and the tensors' share of the heap at its peak")
    ap.add_argument("--grid-only", action="store_true",
                    help="only the grid's table (no one-process column)")
    ap.add_argument("--tuned-malloc", action="store_true",
                    help="glibc tuned as `fourfold train` tunes CPU ranks (train/host_memory.py)")
    ap.add_argument("--set", dest="extra", action="append", type=parse_extra, default=[],
                    metavar="METHOD:SECTION.KEY=VALUE",
                    help="an extra key for one method's runs "
                    "(e.g. blockllm:train.method.patience=3)")
    ap.add_argument("--dtype", default="float32", choices=CHOICES[("train", "dtype")],
                    help="train.dtype of every run (bfloat16: the forward under autocast)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: one process on GPU 0, its peak torch.cuda.max_memory_allocated "
                    "against the planner's GPU prediction (not with --grid, --phases or "
                    "--tuned-malloc, which are about host memory)")
    ap.add_argument("--cli", action="store_true",
                    help="run each method through `fourfold train` as a user starts it")
    ap.add_argument("--config", default="examples/grid_2x2.toml",
                    help="--cli: the config the runs start from")
    ap.add_argument("--every", type=int, default=0,
                    help="--cli: checkpoint.every of the runs (0: no checkpoints)")
    return ap


def main() -> None:
    ap = parser()
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2])
        return
    args = ap.parse_args()
    args.preset = args.preset or ("15m" if args.cli else "small")
    grid = parse_grid(args.grid) if args.grid else None
    if args.grid_only and grid is None:
        fail("--grid-only needs --grid XxY")
    if args.cli:
        for flag, on in (("--phases", args.phases), ("--tuned-malloc", args.tuned_malloc),
                         ("--device cuda", args.device == "cuda")):
            if on:
                fail(f"--cli: {flag} applies to library mode only; leave it out")
        if args.steps < 1 or args.every < 0:
            fail("--cli: --steps must be at least 1, --every not negative")
        if not Path(args.config).is_file():
            fail(f"--config {args.config!r}: no such file")
        check_sets(args)
        cli_table(args, ([] if args.grid_only else [(1, 1)]) + ([grid] if grid else []))
        return
    if args.steps < 2:
        fail("--steps must be at least 2 (the first step is not timed)")
    if args.device == "cuda":
        for flag, on in (("--grid", grid), ("--phases", args.phases),
                         ("--tuned-malloc", args.tuned_malloc)):
            if on:
                fail(f"--device cuda: {flag} is about host memory; leave it out")
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda: torch sees no CUDA GPU "
                 f"(torch {torch.__version__}, torch.cuda.is_available() is False)")
    check_sets(args)
    header("Memory per training method against AdamW and the planner",
           f"preset {args.preset}, {args.dtype}, batch {args.batch} x {args.seq}, activation "
           f"checkpointing (unless --set), malloc "
           f"{'tuned' if args.tuned_malloc else 'glibc defaults'}")
    one_ratio: dict[str, float] = {}
    if not args.grid_only:
        one_ratio = one_process_table(args)
    if grid is not None:
        grid_table(args, grid, one_ratio)


def one_process_table(args: argparse.Namespace) -> dict[str, float]:
    on_gpu = args.device == "cuda"
    base = 0 if on_gpu else measure(args, "none")["rss_kib"]
    rows = {m: measure(args, m) for m in dict.fromkeys(["adamw", *args.methods])}

    def above_kib(r: dict) -> float:  # the peak: GPU memory allocated, or RSS above the import
        return r["gpu_bytes"] / 1024 if on_gpu else r["rss_kib"] - base

    ref = rows["adamw"]
    print("one GPU; the peak is torch.cuda.max_memory_allocated\n" if on_gpu else
          f"one process; the peak is RSS above a process that imports fourfold "
          f"({base / 1024:.0f} MiB)\n")
    table = Table("method", "peak MiB", "vs adamw", "planner MiB", "planner error",
                  "state MiB", "peak gradients MiB", "tokens/s", "vs adamw", "first step s")
    one_ratio = {}
    for m, r in rows.items():
        above = above_kib(r)
        one_ratio[m] = above / above_kib(ref)
        table.row(m, f"{above / 1024:.0f}", f"{one_ratio[m]:.2f}", mib(r["predicted"]),
                  f"{r['predicted'] / (above * 1024) - 1:+.1%}", mib(r["state_bytes"], 1),
                  mib(r["peak_grad_bytes"], 1), f"{r['tokens_per_s']:.0f}",
                  f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}", f"{r['first_step_s']:.1f}")
    if args.phases:
        print_phases(rows)
    return one_ratio


def grid_table(args: argparse.Namespace, grid: tuple[int, int], one_ratio: dict[str, float]
               ) -> None:
    """The grid's rows, printed as each method's launch ends (AdamW's first)."""
    base = measure(args, "none")["rss_kib"]  # a process that only imports fourfold
    print(f"\ngrid x = {grid[0]}, y = {grid[1]} ({grid[0] * grid[1]} gloo ranks, data = z = 1), "
          "per rank: peak RSS above a process that imports fourfold "
          f"({base / 1024:.0f} MiB), ratio to AdamW's on this grid\n")
    table = Table("method", "peak MiB (ranks)", "vs adamw (ranks)", "one process vs adamw",
                  "largest difference", "planner MiB", "planner error (worst)", "tokens/s")
    ref_above: list[int] = []
    for m in dict.fromkeys(["adamw", *args.methods]):
        ranks = measure_grid(args, m, grid)
        above = [(r["rss_kib"] - base) * 1024 for r in ranks]
        ref_above = ref_above or above
        ratios = [a / b for a, b in zip(above, ref_above)]
        one = one_ratio.get(m)
        if one is None:
            one_text, diff_text = "-", "-"
        else:
            diff = max(ratios, key=lambda v: abs(v - one)) - one
            one_text, diff_text = f"{one:.2f}", f"{diff:+.2f}"
        errors = [r["predicted"] / a - 1 for r, a in zip(ranks, above)]
        table.row(m, f"{mib(min(above))}-{mib(max(above))}",
                  f"{min(ratios):.2f}-{max(ratios):.2f}", one_text, diff_text,
                  mib(ranks[0]["predicted"]), f"{max(errors, key=abs):+.1%}",
                  f"{min(r['tokens_per_s'] for r in ranks):.0f}")
        if args.phases:
            own = [(r["base_kib"] - base) / 1024 for r in ranks]
            print(f"  {m}: the ranks' own imports (before joining the job) held "
                  f"{min(own):.0f}-{max(own):.0f} MiB above the baseline")
            print_phases({f"{m} rank {i}": r for i, r in enumerate(ranks)})


# --cli: `fourfold train` as a user starts it

# the baseline reads its peak as a run's summary does
CLI_BASELINE = ("import torch, fourfold\n"
                "from fourfold.train.metrics import peak_memory_bytes\n"
                "print(peak_memory_bytes(torch.device('cpu')))")


def cli_baseline_bytes() -> int:
    """VmHWM of a process that only imports torch and fourfold, with the malloc tunables
    `fourfold train` runs its CPU processes under (its ranks and one process alike)."""
    from fourfold.host import rank_malloc_environment

    out = subprocess.run([sys.executable, "-c", CLI_BASELINE],
                         env=dict(os.environ, **rank_malloc_environment()), check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def cli_sets(args: argparse.Namespace, method: str, grid: tuple[int, int]) -> list[str]:
    """The --set keys of one `fourfold train` run."""
    x, y = grid
    return [f"model.preset={args.preset}", f"train.steps={args.steps}",
            "train.eval_batches=0", "train.sample_tokens=0", f"checkpoint.every={args.every}",
            f"train.optimizer={method}", f"parallel.x={x}", f"parallel.y={y}", "parallel.z=1",
            *(f"{key}={value}" for m, key, value in args.extra if m == method)]


def measure_cli(args: argparse.Namespace, method: str, grid: tuple[int, int],
                out: Path) -> tuple[int, int]:
    """One `fourfold train` run; (rank 0's peak bytes, the planner's bytes per rank)."""
    import shutil

    from fourfold.config import load_config
    from fourfold.parallel import GridShape
    from fourfold.plan.memory import predicted_memory

    shutil.rmtree(out, ignore_errors=True)  # a run directory with a checkpoint would resume
    cmd = [sys.executable, "-m", "fourfold", "train", args.config, "--out", str(out)]
    if grid[0] * grid[1] > 1:
        cmd += ["--nproc", str(grid[0] * grid[1])]
    for item in cli_sets(args, method, grid):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=job_env())
    if proc.returncode:
        fail(f"{method} on {grid[0]}x{grid[1]} failed:\n{proc.stderr[-2000:]}")
    peak = int(json.loads((out / "summary.json").read_text())["peak_mem_bytes"])
    cfg = load_config(out / "config.toml")
    shape = GridShape(data=1, z=1, y=grid[1], x=grid[0])
    return peak, int(predicted_memory(cfg, shape, on_host=True).total)


def cli_table(args: argparse.Namespace, grids: list[tuple[int, int]]) -> None:
    import tempfile

    base = cli_baseline_bytes()
    header("Memory per training method as `fourfold train` runs it, against the planner",
           f"{args.config} with preset {args.preset}, {args.steps} steps, checkpoint every "
           f"{args.every or 'never'}; rank 0's peak above a process that imports torch and "
           f"fourfold ({mib(base)} MiB)")
    table = Table("method", "grid", "peak MiB", "vs adamw", "planner MiB", "planner error")
    with tempfile.TemporaryDirectory() as tmp:
        for grid in grids:
            ref = None
            for method in dict.fromkeys(["adamw", *args.methods]):
                peak, planned = measure_cli(args, method, grid, Path(tmp) / method)
                measured = peak - base
                ref = ref or measured
                table.row(method, f"{grid[0]}x{grid[1]}", mib(measured, 1),
                          f"{measured / ref:.2f}", mib(planned, 1),
                          f"{(planned - measured) / measured:+.1%}")


if __name__ == "__main__":
    main()
