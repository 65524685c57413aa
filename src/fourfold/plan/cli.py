"""`fourfold plan`: rank every 4D configuration of a job, answer scaling-law questions, sweep.

    fourfold plan --model PRESET|CONFIG.toml --gpus N --machine NAME|MACHINE.toml
                  [--global-batch B] [--seq S] [--top K] [--json | --simulate]
                  [--reduce-dtype float32|bfloat16|auto] [--overlap-forward auto|on|off]
                  [--optimizer adamw|lomo|adalomo|mezo|es|blockllm|galore]
    fourfold plan --compute FLOPS | --tokens T [--law chinchilla|epoch]
    fourfold plan --dataset DATA_DIR --compute FLOPS [--dataset-tokens N] [--out CONFIG.toml]
    fourfold plan --sweep [--machine NAME] [--gpus MAX] [--out PLOT.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Callable

from fourfold.config import (PRESETS, Config, ConfigError, ModelConfig, TrainConfig,
                             load_config, model_config)
from fourfold.errors import FourfoldError
from fourfold.methods import method_names
from fourfold.parsing import ArgumentParser
from fourfold.parallel.grid import AXES, RANK_ORDER, GridShape
from fourfold.plan.errors import PlanError
from fourfold.plan.catalog import DEVICES, GIB, Machine, match_name
from fourfold.plan.machine_file import load_machine
from fourfold.plan.perf import Overlap
from fourfold.plan.scaling import (count_params, data_constrained_optimum, dataset_tokens,
                                   dataset_vocab_size, format_count, get_law, model_for_params,
                                   training_config)
from fourfold.plan.search import (Candidate, Plan, grid_problem, grid_shapes,
                                  model_label, plan)
from fourfold.plan.sweep import format_sweep, gpu_counts, plot_sweep, run_sweep


def _positive_number(text: str) -> float:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="fourfold plan", description="Predict time and memory of every 4D "
                "configuration and pick the best; scaling-law answers; weak-scaling sweeps.",
                       usage_error=PlanError)
    p.add_argument("--model", help="a preset (" + ", ".join(PRESETS) + "; any case, e.g. "
                   "70B) or a CONFIG.toml")
    p.add_argument("--gpus", type=int, help="GPU count (for --sweep: the largest)")
    p.add_argument("--machine", help="a preset (perlmutter, frontier, alps, dgx-h100, cpu: "
                   "this host, probed), a device (" + ", ".join(DEVICES) + "; any case, short "
                   "names such as h100, a100, mi250x), or a MACHINE.toml (default: cpu)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: "
                   "the config's train.batch_size, else 2^20 tokens (about 1M) on GPUs and "
                   "2^14 on cpu, whatever the GPU count: the nearest batch a grid can split)")
    p.add_argument("--seq", type=int, help="sequence length (default: the config's "
                   "train.seq_len, else the model's max_seq_len)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: bfloat16 on GPUs, float32 on cpu")
    p.add_argument("--grad-accum", type=int, help="fix gradient accumulation (default: search)")
    p.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--no-overlap", action="store_true", help="predict with every overlap off")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                   help="parallel.reduce_dtype of the weight-gradient reduce-scatters and the "
                   "data all-reduce (auto: the faster per grid; bfloat16 is not exact)")
    p.add_argument("--overlap-forward", choices=("auto", "on", "off"), default="off",
                   help="parallel.overlap_forward: forward GEMMs in two token halves, one "
                   "half's output all-reduce under the other's GEMM (auto: the faster per grid)")
    p.add_argument("--optimizer", help="train.optimizer whose step, gradients and state the "
                   "time and memory columns model: " + ", ".join(method_names()) + " (default: the "
                   "config's train.optimizer, else adamw)")
    p.add_argument("--top", type=int, default=10, help="rows to show (0: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--simulate", action="store_true", help="then run the top row's ranks (the "
                   "first and last on each axis) under fake collectives and tensors, as "
                   "`fourfold simulate` does, and print their table")
    p.add_argument("--compute", type=_positive_number, help="training FLOPs for a scaling-law "
                   "answer")
    p.add_argument("--tokens", type=_positive_number, help="training tokens for a scaling-law "
                   "answer")
    p.add_argument("--law", default="chinchilla", help="chinchilla (Hoffmann et al. 2022, "
                   "approach 3) or epoch (Besiroglu et al. 2024 refit)")
    p.add_argument("--dataset", help="a prepared DATA_DIR whose tokens will be repeated")
    p.add_argument("--dataset-tokens", type=_positive_number, help="unique tokens (instead of "
                   "reading DATA_DIR/manifest.json)")
    p.add_argument("--out", help="--dataset: where to write the config TOML; --sweep: the PNG")
    p.add_argument("--sweep", action="store_true", help="weak-scaling sweep of GPT-style models")
    p.add_argument("--params-per-gpu", type=_positive_number, default=5e8,
                   help="--sweep: model parameters per GPU (default 5e8)")
    return p


# --------------------------------------------------------------------------------------------
# Inputs


# The fields that make two models the same network (not init_from, not the preset's name).
_SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                 "tie_embeddings", "bias")


def resolve_model(spec: str) -> tuple[ModelConfig, int | None, int | None, TrainConfig | None]:
    """(model, batch, seq_len, train) from a preset name or a CONFIG.toml (which also gives its
    train.batch_size, train.seq_len and its [train] table, None for a preset). A file whose
    model keys change its preset's shape describes another model: its preset reads "custom",
    not the name it started from."""
    path = Path(spec)
    preset = None if path.suffix == ".toml" or os.sep in spec else \
        match_name(spec, tuple(PRESETS), "model")
    if preset is not None:
        return model_config(preset), None, None, None
    if path.suffix == ".toml" or path.is_file() or path.is_dir():
        try:
            cfg = load_config(path)
        except ConfigError as e:
            raise PlanError(str(e)) from None
        model = cfg.model
        if model.preset != "custom":
            preset = model_config(model.preset)
            if any(getattr(model, f) != getattr(preset, f) for f in _SHAPE_FIELDS):
                model = dataclasses.replace(model, preset="custom")
        return model, cfg.train.batch_size, cfg.train.seq_len, cfg.train
    raise PlanError(f"unknown model {spec!r}: choose a preset ({', '.join(PRESETS)}) or a "
                    "CONFIG.toml path")


def resolve_train(optimizer: str | None, config_train: TrainConfig | None) -> TrainConfig:
    """The train config whose optimizer the memory is planned for: --optimizer over the
    config file's train.optimizer (keeping its [train.method] options), else adamw."""
    if optimizer is not None and optimizer not in method_names():
        raise PlanError(f"--optimizer {optimizer!r}: choose one of {', '.join(method_names())}")
    if config_train is None:
        return TrainConfig(optimizer=optimizer or "adamw")
    return dataclasses.replace(config_train, optimizer=optimizer or config_train.optimizer)


# The global batch when neither --global-batch nor a config gives one: a number of tokens, not
# of GPUs, since the batch is a training choice (what the optimizer sees) and not a hardware
# one. On a host's cores (cpu) a smaller one: its runs are small.
DEFAULT_BATCH_TOKENS = 2**20
DEFAULT_HOST_BATCH_TOKENS = 2**14


def default_batch(model: ModelConfig, world: int, seq_len: int, machine: Machine,
                  optimizer: str) -> int:
    """Sequences per step by default: of the batches within a factor of two of
    DEFAULT_BATCH_TOKENS tokens (on a shared host DEFAULT_HOST_BATCH_TOKENS), the nearest one
    that some grid of `world` ranks can split (3 GPUs take 129 sequences of 8192 tokens, not
    128); at least one sequence."""
    tokens = DEFAULT_HOST_BATCH_TOKENS if machine.device.shared_host else DEFAULT_BATCH_TOKENS
    target = max(1, tokens // seq_len)
    shapes = grid_shapes(world)
    nearest = sorted(range(max(1, target // 2), 2 * target + 1),
                     key=lambda b: (abs(math.log(b / target)), b))
    return next((b for b in nearest
                 if any(grid_problem(model, s, b, optimizer) is None for s in shapes)), target)


# --------------------------------------------------------------------------------------------
# Output


def time_unit(seconds: list[float]) -> tuple[str, float, int]:
    """One unit for every time column of a table (name, scale from seconds, decimals): seconds
    when its longest step takes 10 s or more, else milliseconds."""
    return ("s", 1.0, 2) if max(seconds, default=0.0) >= 10 else ("ms", 1e3, 1)


def describe_model(model: ModelConfig, config_path: str | None = None) -> str:
    """How the plan names a model: its preset, or "custom", with the config file it came from."""
    label = model_label(model)
    return label if config_path is None else f"{label} ({Path(config_path).name})"


def _placement(machine: Machine, world: int) -> str:
    if machine.probed_host:
        return (f"all {world} ranks on this host, sharing its {machine.device.memory_gib:.1f} "
                f"GiB and {machine.gpus_per_node} cores")
    return f"{machine.gpus_per_node} per node"


def format_plan(result: Plan, top: int, model_name: str | None = None,
                command: str | None = None) -> str:
    """The plan as a table, best first; under it `command` (the line that runs the top row,
    `train_command`) when the top row fits, else why nothing fits and what would."""
    m, model = result.machine, result.model
    rows = result.candidates if top <= 0 else result.candidates[:top]
    unit, scale, decimals = time_unit([c.prediction.step_s for c in rows])
    per = "rank" if m.device.shared_host else "GPU"
    tokens = result.global_batch * result.seq_len
    header = [f"model {model_name or describe_model(model)} ({format_count(count_params(model))} "
              f"params, {model.n_layers} layers, dim {model.dim}) on {result.world_size} x "
              f"{m.device.name} ({m.name}: {_placement(m, result.world_size)}, "
              f"{m.usable_memory_bytes(result.world_size) / GIB:.1f} GiB usable per {per})",
              f"batch {result.global_batch} x {result.seq_len} tokens ({format_count(tokens)}), "
              f"{result.precision.name}; {len(result.candidates)} grids, "
              f"{len(result.rejected)} cannot split the model; comm columns: {unit} per step "
              "(hidden %); red: parallel.reduce_dtype, ovf: parallel.overlap_forward",
              "ranked by predicted step time (so by MFU: model FLOPs, 6N + attention per token); "
              "HFU also counts the forward that activation checkpointing (AC) recomputes",
              f"memory planned for train.optimizer = {result.optimizer} (its gradients and "
              "state)" + (f"; {result.time_note}" if result.time_note else ""),
              f"{m.device.note}; {m.note}" if m.note else m.device.note]
    columns = (f"{'#':>3} {'data,z,y,x':>12} {'mb x acc':>9} {'AC':>3} {'red':>4} {'ovf':>3} "
               f"{'step ' + unit:>9} {'tokens/s':>11} {'MFU':>5} {'HFU':>5} "
               + " ".join(f"{a + ' ' + unit:>13}" for a in AXES)
               + f" {'GiB/' + per:>8}  fits")
    lines = header + [columns]
    for i, c in enumerate(rows, 1):
        p = c.prediction
        grid = ",".join(str(getattr(c.shape, a)) for a in RANK_ORDER)
        comm = []
        for a in AXES:
            total = p.comm_s[a]
            share = f"({p.hidden_s[a] / total:.0%})" if total > 0 else ""
            cell = f"{total * scale:.{decimals}f}{share}" if total > 0 else "-"
            comm.append(f"{cell:>13}")
        fits = "fits" if c.fits else f"OOM by {c.oom_gib:.1f} GiB"
        lines.append(f"{i:>3} {grid:>12} {f'{c.micro_batch}x{c.grad_accum}':>9} "
                     f"{'on' if c.activation_checkpointing else 'off':>3} "
                     f"{'bf16' if c.reduce_dtype == 'bfloat16' else 'f32':>4} "
                     f"{'on' if c.overlap_forward else 'off':>3} "
                     f"{p.step_s * scale:>9.{decimals}f} "
                     f"{p.tokens_per_s:>11,.0f} {p.mfu:>5.0%} {p.hfu:>5.0%} " + " ".join(comm)
                     + f" {c.memory.total / GIB:>8.2f}  {fits}")
    if not result.best.fits:
        lines.append(result.why_nothing_fits())
    elif command is not None:
        ranks = "" if m.probed_host else \
            f" (every one of the {result.world_size} ranks runs it: torchrun or srun)"
        lines += [f"to run #1{ranks}:", f"  {command}"]
    return "\n".join(lines)


def planned_settings(result: Plan, row: Candidate, overlap: Overlap,
                     config_path: str | None = None) -> list[tuple[str, str]]:
    """The `section.key=value` settings that make the config file at `config_path` (or the
    defaults) run `row` as the planner predicted it: the model (its preset, without a file),
    the grid, the batch and its micro-batches, activation checkpointing, the dtypes, the
    overlaps and the optimizer. The grid is always set; the rest only where the config file
    (or the defaults) says otherwise."""
    base = load_config(config_path) if config_path else Config()
    grid = [(f"parallel.{a}", getattr(row.shape, a)) for a in RANK_ORDER]
    settings: list[tuple[str, object]] = [
        ("train.batch_size", result.global_batch), ("train.seq_len", result.seq_len),
        ("train.grad_accum", row.grad_accum),
        ("train.activation_checkpointing", row.activation_checkpointing),
        ("train.dtype", result.precision.name), ("train.optimizer", result.optimizer),
        ("parallel.reduce_dtype", row.reduce_dtype),
        ("parallel.overlap_forward", row.overlap_forward),
        *((f"parallel.{f.name}", getattr(overlap, f.name)) for f in dataclasses.fields(overlap)
          if f.name != "overlap_forward")]
    model = [] if config_path else [("model.preset", result.model.preset)]
    wanted = model + grid + [(key, value) for key, value in settings
                             if getattr(getattr(base, key.split(".")[0]), key.split(".")[1])
                             != value]
    return [(key, str(value).lower() if isinstance(value, bool) else str(value))
            for key, value in wanted]


def train_command(result: Plan, row: Candidate, overlap: Overlap,
                  config_path: str | None = None) -> str:
    """The `fourfold train` line that runs `row` as the planner predicted it
    (`planned_settings`)."""
    words = ["fourfold", "train"] + ([config_path] if config_path else [])
    if result.machine.probed_host and result.world_size > 1:
        words += ["--nproc", str(result.world_size)]
    for key, value in planned_settings(result, row, overlap, config_path):
        words += ["--set", f"{key}={value}"]
    return shlex.join(words)


def plan_json(result: Plan, top: int, model_name: str | None = None,
              command: str | None = None) -> dict:
    rows = result.candidates if top <= 0 else result.candidates[:top]
    m = result.machine
    return {
        "model": {"preset": model_label(result.model),
                  "name": model_name or describe_model(result.model),
                  "params": count_params(result.model)},
        "machine": {"name": m.name, "device": m.device.name, "gpus_per_node": m.gpus_per_node,
                    "usable_memory_gib": m.usable_memory_bytes(result.world_size) / GIB},
        "gpus": result.world_size, "global_batch": result.global_batch,
        "seq_len": result.seq_len, "dtype": result.precision.name,
        "ranked_by": "step_s (equivalently mfu: model FLOPs; hfu adds the recomputed forward)",
        "optimizer": result.optimizer,
        "step_time_method_specific": True,
        "step_time_note": result.time_note or "AdamW's forward, backward and communication",
        "configurations": [c.to_json() for c in rows],
        "rejected": [{"grid": {a: getattr(s, a) for a in RANK_ORDER},
                      "reason": why} for s, why in result.rejected],
        "train_command": command if result.best.fits else None,
        "nothing_fits": result.why_nothing_fits() or None,
    }


# --------------------------------------------------------------------------------------------
# Modes


# What `--simulate` runs: the config of the top row, its grid and the machine -> exit code.
# The command passes it in (fourfold.simulate), so that the planner never imports the trainer.
SimulateTop = Callable[[Config, GridShape, Machine], int]


def _plan_mode(args: argparse.Namespace, simulate_top: SimulateTop | None) -> int:
    if args.simulate and args.json:
        raise PlanError("--simulate prints a table after the plan's: drop --json or --simulate")
    if args.simulate and simulate_top is None:
        raise PlanError("--simulate needs the `fourfold plan` command (this entry point cannot "
                        "run the trainer)")
    if not args.model:
        raise PlanError("--model is required (a preset or a CONFIG.toml), or use --compute, "
                        "--tokens, --dataset or --sweep")
    if args.gpus is None:
        raise PlanError("--gpus is required: how many GPUs (ranks) the job has")
    if args.gpus < 1:
        raise PlanError(f"--gpus {args.gpus}: the GPU count must be at least 1")
    model, config_batch, config_seq, config_train = resolve_model(args.model)
    train = resolve_train(args.optimizer, config_train)
    machine = load_machine(args.machine or "cpu")
    seq = args.seq or config_seq or model.max_seq_len
    batch = args.global_batch if args.global_batch is not None else \
        (config_batch or default_batch(model, args.gpus, seq, machine, train.optimizer))
    dtype = args.dtype or ("float32" if machine.device.shared_host else "bfloat16")
    checkpointing = {"auto": (False, True), "on": (True,), "off": (False,)}[
        args.activation_checkpointing]
    if args.no_overlap and args.overlap_forward != "off":
        raise PlanError(f"--overlap-forward {args.overlap_forward} with --no-overlap: "
                        "--no-overlap turns every overlap off; drop one of them")
    overlap = Overlap(False, False, False, False) if args.no_overlap else Overlap()
    reduce_dtypes = ("float32", "bfloat16") if args.reduce_dtype == "auto" else \
        (args.reduce_dtype,)
    splits = {"auto": (False, True), "on": (True,), "off": (False,)}[args.overlap_forward]
    result = plan(model, args.gpus, machine, batch, seq, dtype, overlap, checkpointing,
                  args.grad_accum, reduce_dtypes, splits, train)
    config_path = None if config_train is None else args.model
    command = train_command(result, result.best, overlap, config_path) \
        if result.best.fits else None
    name = describe_model(model, config_path)
    if args.json:
        print(json.dumps(plan_json(result, args.top, name, command), indent=2))
    else:
        print(format_plan(result, args.top, name, command), flush=True)
    if args.simulate:
        assert simulate_top is not None
        settings = planned_settings(result, result.best, overlap, config_path)
        cfg = load_config(config_path, [f"{key}={value}" for key, value in settings])
        return simulate_top(cfg, result.best.shape, machine)
    return 0


def _scaling_mode(args: argparse.Namespace) -> int:
    law = get_law(args.law)
    if args.dataset or args.dataset_tokens:
        if args.compute is None:
            raise PlanError("--dataset needs --compute FLOPS: the budget to spend on it")
        unique = args.dataset_tokens or dataset_tokens(args.dataset)
        vocab = (dataset_vocab_size(args.dataset) if args.dataset else None) or 32000
        r = data_constrained_optimum(law, args.compute, unique)
        seq = args.seq or 2048
        model = model_for_params(r.n_params, vocab, seq)
        answer = {"law": law.name, "compute": args.compute, "unique_tokens": unique,
                  "params": r.n_params, "tokens": r.n_tokens, "epochs": r.epochs,
                  "loss": r.loss, "unconstrained_params": r.unconstrained_params,
                  "unconstrained_tokens": r.unconstrained_tokens,
                  "unconstrained_loss": r.unconstrained_loss,
                  "model": {k: getattr(model, k) for k in ("n_layers", "dim", "n_heads",
                                                           "n_kv_heads", "ffn_dim", "vocab_size")},
                  "model_params": count_params(model)}
        if args.dataset:
            out = Path(args.out or "plan_config.toml")
            cfg = training_config(model, r.n_tokens, args.dataset, seq)
            out.parent.mkdir(parents=True, exist_ok=True)
            cfg.save(out)
            answer["config"] = str(out)
        if args.json:
            print(json.dumps(answer, indent=2))
        else:
            print(f"{law.name} law with data-constrained repetition (Muennighoff et al. 2023), "
                  f"{format_count(unique)} unique tokens, {args.compute:.3g} FLOPs:")
            print(f"  train {format_count(r.n_params)} params on {format_count(r.n_tokens)} "
                  f"tokens ({r.epochs:.1f} epochs), predicted loss {r.loss:.3f}")
            print(f"  with unlimited data: {format_count(r.unconstrained_params)} params on "
                  f"{format_count(r.unconstrained_tokens)} tokens, loss "
                  f"{r.unconstrained_loss:.3f}")
            print(f"  model: {model.n_layers} layers, dim {model.dim}, {model.n_heads} heads "
                  f"({model.n_kv_heads} kv), ffn {model.ffn_dim}, vocab {model.vocab_size} = "
                  f"{format_count(count_params(model))} params")
            if "config" in answer:
                print(f"  wrote {answer['config']}")
        return 0
    if args.compute is not None:
        n, d = law.compute_optimal(args.compute)
        compute = args.compute
    else:
        n, compute = law.optimal_for_tokens(args.tokens)
        d = args.tokens
    answer = {"law": law.name, "compute": compute, "params": n, "tokens": d,
              "loss": law.loss(n, d), "tokens_per_param": d / n}
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"{law.name} law: compute-optimal for {compute:.3g} FLOPs (C = 6ND): "
              f"{format_count(n)} params, {format_count(d)} tokens ({d / n:.0f} tokens/param), "
              f"predicted loss {law.loss(n, d):.3f}")
    return 0


def _sweep_mode(args: argparse.Namespace) -> int:
    machine = load_machine(args.machine or "perlmutter")
    max_gpus = args.gpus if args.gpus is not None else 1024
    counts = gpu_counts(max_gpus, machine.gpus_per_node)
    seq = args.seq or 2048
    dtype = args.dtype or ("float32" if machine.device.shared_host else "bfloat16")
    rows = run_sweep(machine, counts, args.params_per_gpu, seq, sequences_per_gpu=4, dtype=dtype)
    out = Path(args.out or f"plan_sweep_{machine.name}.png")
    plot_sweep(rows, machine, out)
    if args.json:
        print(json.dumps([{"gpus": r.gpus, "params": r.n_params, "global_batch": r.global_batch,
                           "tflops_per_gpu": r.tflops_per_gpu, **r.best.to_json()}
                          for r in rows], indent=2))
    else:
        print(format_sweep(rows, machine))
        print(f"plot: {out}")
    return 0


def plan_main(argv: list[str], simulate_top: SimulateTop | None = None) -> int:
    """Entry point of `fourfold plan`; raises PlanError for user mistakes. `simulate_top`:
    what `--simulate` runs on the top row."""
    args = build_parser().parse_args(argv)
    other = args.sweep or args.compute is not None or args.tokens is not None or \
        args.dataset or args.dataset_tokens
    if args.simulate and other:
        raise PlanError("--simulate runs the top row of a plan (--model, --gpus), not a "
                        "scaling-law answer or a sweep")
    if args.sweep:
        return _sweep_mode(args)
    if other:
        return _scaling_mode(args)
    return _plan_mode(args, simulate_top)


if __name__ == "__main__":
    try:
        sys.exit(plan_main(sys.argv[1:]))
    except FourfoldError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
