"""Fine-tuning quality of each training method against AdamW: R = (L0 - L) / (L0 - L_adamw).

A `15m` model is first trained with AdamW on builtin:stdlib (examples/15m.toml, --base-steps
steps), or taken from --base RUN_DIR, and exported with `fourfold convert`. Each method then
continues it for --steps steps on --data at each of its learning rates, through `fourfold train`
with model.init_from = that export: one process, float32, the base's tokenizer. The data is
builtin:stdlib-tests by default (the standard library's test packages, which share no file with
builtin:stdlib: continued pre-training on unseen code); builtin:stdlib-docstrings is a
supervised fine-tune (write a function's docstring; the loss is on the answers), the kind of
task the memory-lean methods' papers fine-tune on. L0 is the base's validation loss on the
held-out split (every fine-tune validates at step 0 on the same fixed batches), L a run's
validation loss after its last step; a method's row is its best learning rate (lowest L; the
same validation batches pick it and score it). With --mezo-steps, MeZO runs again for that
many steps (10x --steps by default) at each of its learning rates that did not diverge at
--steps, and that row too is its best rate's.

    python bench/lean_quality.py [--steps 300] [--methods adamw lomo ...] [--lrs 1e-3,3e-3 |
        METHOD=LR,LR,...] [--base RUN_DIR] [--data DATA] [--out-dir runs/lean_quality]

Each run has its own directory under --out-dir (METHOD-sSTEPS-lrLR): a finished one
(summary.json) is read back, an interrupted one resumes from its checkpoint, one that stopped
on a non-finite loss is recorded as diverged. So the script can be stopped and rerun with the
same command; each run's line and each method's row are printed as soon as they are done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header, parser  # noqa: E402

METHODS = ("adamw", "lomo", "adalomo", "galore", "blockllm", "mezo", "es")
DEFAULT_METHODS = ("adamw", "lomo", "adalomo", "galore", "blockllm", "mezo")  # es: 8 forwards/step
# Three learning rates per method, around where each one's best lay in a 30-step trial here (an
# 80-step base, batch 4 x 128); a longer run may prefer others, so a winner at an end of its
# grid is marked "(edge)". AdamW-like methods near the base's 1e-3 (GaLore's projected step is
# smaller, BlockLLM trains a tenth of the weights); AdaLomo's step is relative to RMS(w) (~0.02
# here, so ~30x AdamW's lr); LOMO is plain SGD without clipping or weight decay (on the 15m
# fine-tune from the 2000-step base: 1e-2 4.42, 3e-2 4.30, 1e-1 4.14, 3e-1 3.97, 1.0 diverged;
# with AdamW's decoupled weight decay 0.1, which SGD's large steps turn into a fast shrink of
# the weights, 1e-2 was its best at 4.47); BlockLLM's best was 2e-3 at seeds 0, 1 and 2 (1e-2:
# 4.65, far off) and 3e-3 over 300 steps of the debug base, so its grid spans them; MeZO and
# ES step along random directions.
# MeZO's grid is two steps lower than that trial's: its run at --mezo-steps takes the same
# rates, and over thousands of steps a rate that helps for hundreds climbs (1e-3 within 300
# steps, 3e-4 within 3,000, on the 15m and the debug base alike).
DEFAULT_LRS = {
    "adamw": (3e-4, 1e-3, 3e-3),
    "lomo": (3e-2, 1e-1, 3e-1),
    "adalomo": (1e-2, 3e-2, 1e-1),
    "galore": (1e-3, 3e-3, 1e-2),
    "blockllm": (1e-3, 3e-3, 1e-2),
    "mezo": (3e-5, 1e-4, 3e-4),
    "es": (3e-4, 1e-3, 3e-3),
}
# The targets for R at --steps: how close to AdamW each method's paper puts it after a short
# fine-tune. MeZO's paper runs it for many times the steps of fine-tuning by backpropagation,
# so its run at --mezo-steps has a target of its own. LOMO's paper compares it with LoRA and
# zero-shot, not with AdamW on one run, so its figure is reported without one.
TARGETS = {"adamw": (None, "1 (reference)"), "lomo": (None, "reported"),
           "adalomo": (0.95, ">= 0.95"), "galore": (0.9, ">= 0.9"),
           "blockllm": (0.9, ">= 0.9"), "mezo": (0.0, "> 0"), "es": (None, "-")}
MEZO_LONG_TARGET = (0.3, "> 0.3")
BASE_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "15m.toml"
CHECKPOINT_EVERY = 100  # steps; lets an interrupted run resume instead of starting over
DIVERGED_FILE = "diverged.txt"


def fourfold(args: list[str], log: Path) -> tuple[int, float]:
    """Run `python -m fourfold ARGS` with its output in `log`; (exit code, wall seconds)."""
    started = time.perf_counter()
    with open(log, "a") as out:
        code = subprocess.run([sys.executable, "-m", "fourfold", *args], stdout=out,
                              stderr=subprocess.STDOUT).returncode
    return code, time.perf_counter() - started


def tail(log: Path, lines: int = 3) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


def sets(values: dict[str, object]) -> list[str]:
    return [a for key, value in values.items() for a in ("--set", f"{key}={value}")]


def common_sets(args: argparse.Namespace, steps: int) -> dict[str, object]:
    """The keys every run shares: one process, float32, fixed batches and validation."""
    return {"train.steps": steps, "train.batch_size": args.batch, "train.seq_len": args.seq,
            "train.warmup_steps": max(1, steps // 10), "train.dtype": "float32",
            "train.seed": args.seed, "train.log_every": max(1, min(50, steps // 10)),
            "train.sample_tokens": 0, "train.device": args.device,
            "checkpoint.every": CHECKPOINT_EVERY, "checkpoint.keep": 1, "parallel.auto": "false"}


def train_base(args: argparse.Namespace, out: Path) -> Path:
    run = out / "base"
    if (run / "summary.json").is_file():
        return run
    run.mkdir(parents=True, exist_ok=True)
    print(f"training the base: {args.base_steps} AdamW steps of examples/15m.toml on "
          f"builtin:stdlib ({run / 'train.log'})", flush=True)
    keys = {**common_sets(args, args.base_steps), "data.tokenizer": args.tokenizer,
            "train.eval_every": args.base_steps, "train.eval_batches": args.eval_batches}
    code, seconds = fourfold(["train", str(BASE_CONFIG), *sets(keys), "--out", str(run)],
                             run / "train.log")
    if code:
        sys.exit(f"error: training the base failed (exit {code}): {tail(run / 'train.log')}")
    print(f"base trained in {seconds:.0f} s", flush=True)
    return run


def base_tokenizer(base: Path) -> str:
    """The tokenizer spec that gives the held-out corpus the base's tokens."""
    from fourfold.data import resolve_data_path
    from fourfold.train.runs import run_config

    data = run_config(base).data
    if data.tokenizer == "byte" or not data.tokenizer.startswith("bpe:"):
        return data.tokenizer  # byte, or a tokenizer file / directory: the same for any corpus
    # bpe:N is trained on the corpus; its DATA_DIR holds the trained tokenizer
    return str(resolve_data_path(data.path, data.tokenizer))


def export_base(base: Path, out: Path) -> Path:
    hf = out / "base-hf"
    if not (hf / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        code, _ = fourfold(["convert", str(base), "--to", "hf", str(hf)], out / "convert.log")
        if code:
            sys.exit(f"error: fourfold convert {base} failed: {tail(out / 'convert.log')}")
    return hf


def check_settings(out: Path, settings: dict[str, object]) -> None:
    """Refuse to mix runs of other settings into one table."""
    path = out / "bench.json"
    if path.is_file():
        # a directory made before --data existed fine-tuned on its default
        saved = {"data": "builtin:stdlib-tests", **json.loads(path.read_text())}
        changed = [k for k in settings if saved.get(k) != settings[k]]
        if changed:
            sys.exit(f"error: --out-dir {out} holds runs made with "
                     + ", ".join(f"{k} = {saved.get(k)!r}" for k in changed)
                     + f" (now {', '.join(repr(settings[k]) for k in changed)}); "
                       "use another --out-dir")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")


def fine_tune(args: argparse.Namespace, out: Path, hf: Path, tokenizer: str, method: str,
              lr: float, steps: int) -> dict:
    """One run: {"L0", "L", "seconds", "cached"}; L is nan when it diverged."""
    extra = {k: v for m, k, v in args.extra if m == method}
    suffix = ("-" + hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:6]
              if extra else "")
    run = out / f"{method}-s{steps}-lr{lr:g}{suffix}"
    summary, diverged = run / "summary.json", run / DIVERGED_FILE
    cached = summary.is_file() or diverged.is_file()
    seconds = math.nan
    if not cached:
        run.mkdir(parents=True, exist_ok=True)
        keys = {**common_sets(args, steps), "model.init_from": hf,
                "data.path": args.data, "data.tokenizer": tokenizer,
                "train.optimizer": method, "train.lr": lr, "train.eval_every": steps,
                "train.eval_batches": args.eval_batches, **extra}
        code, seconds = fourfold(["train", *sets(keys), "--out", str(run)], run / "train.log")
        if code == 1:  # a training failure (non-finite loss), not a usage error
            diverged.write_text(tail(run / "train.log") + "\n")
        elif code:
            sys.exit(f"error: {method} at lr {lr:g} failed (exit {code}): "
                     f"{tail(run / 'train.log')}")
        if not args.keep_weights:
            shutil.rmtree(run / "checkpoints", ignore_errors=True)
            (run / "model.safetensors").unlink(missing_ok=True)
    if diverged.is_file():
        return {"L0": math.nan, "L": math.nan, "seconds": seconds, "cached": cached,
                "note": diverged.read_text().strip()}
    s = json.loads(summary.read_text())
    vals = dict((int(step), float(v)) for step, v in s["val_losses"])
    if not cached:
        seconds = s["time_s"]
    return {"L0": vals.get(0, math.nan), "L": float(s["val_loss"]), "seconds": seconds,
            "cached": cached, "per_step_s": s["train_time_s"] / max(1, s["steps"])}


def parse_lrs(tokens: list[str] | None, methods: list[str]) -> dict[str, tuple[float, ...]]:
    lrs = {m: DEFAULT_LRS[m] for m in methods}
    for token in tokens or []:
        name, _, values = token.rpartition("=")
        try:
            parsed = tuple(float(v) for v in values.split(","))
        except ValueError:
            sys.exit(f"error: --lrs {token!r}: expected LR,LR,... or METHOD=LR,LR,...")
        if name and name not in METHODS:
            sys.exit(f"error: --lrs {token!r}: unknown method {name!r}; choose from "
                     f"{', '.join(METHODS)}")
        for m in ([name] if name else methods):
            lrs[m] = parsed
    return lrs


def parse_extra(token: str) -> tuple[str, str, str]:
    method, _, assignment = token.partition(":")
    key, eq, value = assignment.partition("=")
    if method not in METHODS or not eq or "." not in key:
        raise argparse.ArgumentTypeError(
            f"{token!r}: expected METHOD:SECTION.KEY=VALUE with METHOD one of {', '.join(METHODS)}")
    return method, key, value


def reproduce(args: argparse.Namespace, lrs: dict[str, tuple[float, ...]]) -> str:
    parts = ["python", "bench/lean_quality.py", "--steps", str(args.steps),
             "--mezo-steps", str(args.mezo_steps), "--methods", *args.methods,
             "--lrs", *(f"{m}={','.join(f'{v:g}' for v in lrs[m])}" for m in args.methods),
             "--batch", str(args.batch), "--seq", str(args.seq),
             "--eval-batches", str(args.eval_batches), "--seed", str(args.seed),
             "--data", args.data,
             "--device", args.device, "--out-dir", str(args.out_dir)]
    if args.base:
        parts += ["--base", str(args.base)]
    else:
        parts += ["--base-steps", str(args.base_steps), "--tokenizer", args.tokenizer]
    for m, k, v in args.extra:
        parts += ["--set", f"{m}:{k}={v}"]
    if args.keep_weights:
        parts.append("--keep-weights")
    return shlex.join(parts)


def fmt(x: float, digits: int = 4) -> str:
    return "diverged" if math.isnan(x) else f"{x:.{digits}f}"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=300, help="fine-tuning steps per run")
    ap.add_argument("--mezo-steps", type=int, default=None,
                    help="MeZO again at each of its lrs for this many steps (default 10x "
                         "--steps; 0: off)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--lrs", nargs="+", metavar="[METHOD=]LR,LR",
                    help="learning rates to try: for every method, or METHOD=... for one")
    ap.add_argument("--base", type=Path, help="a finished AdamW run to start from (default: "
                    "train one under --out-dir/base)")
    ap.add_argument("--base-steps", type=int, default=2000)
    ap.add_argument("--tokenizer", default="bpe:8192",
                    help="the base's tokenizer when this script trains it (examples/15m.toml's)")
    ap.add_argument("--data", default="builtin:stdlib-tests",
                    help="the fine-tuning data set (config data.path): builtin:stdlib-tests "
                         "(continued pre-training on unseen code), builtin:stdlib-docstrings "
                         "(supervised fine-tuning, loss on the answers), or a prepared DATA_DIR")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--set", dest="extra", action="append", type=parse_extra, default=[],
                    metavar="METHOD:SECTION.KEY=VALUE",
                    help="an extra key for one method's runs (e.g. lomo:train.method.clip_mode=two_pass)")
    ap.add_argument("--out-dir", type=Path, default=Path("runs/lean_quality"))
    ap.add_argument("--keep-weights", action="store_true",
                    help="keep each run's model.safetensors and checkpoint")
    args = ap.parse_args()
    args.methods = list(dict.fromkeys(["adamw", *args.methods]))  # R needs AdamW's L
    if args.mezo_steps is None:
        args.mezo_steps = 10 * args.steps
    if args.steps < 1 or args.mezo_steps < 0 or args.base_steps < 1:
        fail("--steps and --base-steps must be positive, --mezo-steps >= 0")
    lrs = parse_lrs(args.lrs, args.methods)
    out = args.out_dir
    header("Fine-tuning quality of each training method against AdamW",
           "R = (L0 - L) / (L0 - L_adamw): L0 the base's validation loss, L a method's after "
           "its best learning rate's run\nreproduce: " + reproduce(args, lrs))

    if args.base is not None:
        if not (args.base / "model.safetensors").is_file():
            fail(f"--base {args.base}: no model.safetensors (not a finished run)")
        base_label = str(args.base.resolve())
    else:
        base_label = f"{BASE_CONFIG.name}, {args.base_steps} steps, {args.tokenizer}"
    check_settings(out, {"base": base_label, "data": args.data, "batch": args.batch,
                         "seq": args.seq, "eval_batches": args.eval_batches, "seed": args.seed})
    base = args.base if args.base is not None else train_base(args, out)
    tokenizer = base_tokenizer(base)
    hf = export_base(base, out)
    print(f"base {base}; fine-tuning on {args.data}, batch {args.batch} x {args.seq}, "
          f"{args.eval_batches} validation batches, float32, one process", flush=True)

    rows: list[dict] = []
    l0s: list[float] = []
    columns = ("method", "steps", "lr: L", "best lr", "L0", "L", "R", "target", "met")

    def row(method: str, steps: int, tried: dict[float, dict]) -> dict:
        finite = {lr: r for lr, r in tried.items() if not math.isnan(r["L"])}
        best = min(finite, key=lambda lr: finite[lr]["L"]) if finite else None
        if best is not None:
            l0s.append(finite[best]["L0"])
        return {"method": method, "steps": steps, "tried": tried, "best": best,
                "L": finite[best]["L"] if finite else math.nan}

    def cells(r: dict) -> tuple[str, ...]:
        l0 = l0s[0] if l0s else math.nan
        ref = rows[0]["L"] if rows and rows[0]["method"] == "adamw" else math.nan
        ratio = (l0 - r["L"]) / (l0 - ref) if not math.isnan(r["L"]) else math.nan
        bound, target = (TARGETS[r["method"]] if r["steps"] == args.steps
                         else MEZO_LONG_TARGET)
        met = ("-" if bound is None or math.isnan(ratio)
               else "yes" if (ratio > bound if r["method"] == "mezo" else ratio >= bound)
               else "no")
        tried = ", ".join(f"{lr:g}: {fmt(t['L'], 3)}" for lr, t in r["tried"].items())
        best = f"{r['best']:g}" if r["best"] is not None else "-"
        if len(r["tried"]) > 1 and r["best"] in (min(r["tried"]), max(r["tried"])):
            best += " (edge)"
        return (r["method"], str(r["steps"]), tried, best, fmt(l0), fmt(r["L"]),
                "-" if math.isnan(ratio) else f"{ratio:.3f}", target, met)

    plan = [(m, args.steps) for m in args.methods]
    if "mezo" in args.methods and args.mezo_steps:
        plan.append(("mezo", args.mezo_steps))
    for method, steps in plan:
        if steps == args.steps:
            candidates = lrs[method]
        else:  # the long MeZO run: a longer run may prefer another lr than the short one's
            short = next(r for r in rows if r["method"] == "mezo")
            candidates = tuple(lr for lr, t in short["tried"].items() if not math.isnan(t["L"]))
            if not candidates:
                print(f"mezo at {steps} steps: skipped (every lr diverged at {args.steps})")
                continue
        tried = {}
        for lr in candidates:
            r = fine_tune(args, out, hf, tokenizer, method, lr, steps)
            tried[lr] = r
            took = ("cached" if r["cached"]
                    else f"{r['seconds']:.0f} s" + (f", {r['per_step_s']:.2f} s/step"
                                                    if "per_step_s" in r else ""))
            note = f" ({r['note']})" if "note" in r else ""
            print(f"  {method} lr {lr:g}, {steps} steps: L0 {fmt(r['L0'])} -> L "
                  f"{fmt(r['L'])} [{took}]{note}", flush=True)
        rows.append(row(method, steps, tried))
        if len(rows) == 1:
            table = Table(*columns)
        table.row(*cells(rows[-1]))

    spread = max(l0s) - min(l0s) if l0s else 0.0
    print(f"\nL0 = {fmt(l0s[0] if l0s else math.nan)} (validation loss of the base on "
          f"{args.data}; spread over the runs {spread:.1e}); "
          "R = (L0 - L) / (L0 - L_adamw)\n")
    table = Table(*columns)
    for r in rows:
        table.row(*cells(r))


if __name__ == "__main__":
    main()
