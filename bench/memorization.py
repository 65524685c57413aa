"""Memorization with the standard loss and with the goldfish loss, at laptop size.

The SC24 paper found that a model large enough for its data memorizes training text, and that
the goldfish loss (Hans et al. 2024) prevents it. This bench reproduces the finding in minutes
on a CPU: a small byte-level model is trained for many epochs on a few documents of Python
standard-library source, twice from the same initialization and in the same document order,
once with the standard loss and once with the goldfish loss. At each evaluation it prompts with
the first --prefix bytes of every training document, greedily generates --suffix bytes, and
measures exact match, token match and ROUGE-L (fourfold.eval.audit_memorization), plus the loss
on held-out documents.

    python bench/memorization.py [--config examples/memorization.toml] [--epochs 50]

The training loop is written here on purpose (model, AdamW, a warmup + cosine schedule) so the
bench depends only on the model, the goldfish mask and the audit. The mask is applied as the
trainer does: (per-token loss * mask).sum() / mask.sum().
"""

from __future__ import annotations

import json
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Table, fail, header  # noqa: E402
from common import parser as bench_parser  # noqa: E402

from fourfold.config import Config, load_config
from fourfold.eval.memorization import audit_memorization
from fourfold.models import build_model
from fourfold.train.goldfish import goldfish_mask

EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "memorization.toml"


def stdlib_documents(n: int, length: int, skip: int = 0) -> list[np.ndarray]:
    """n byte documents of exactly `length` bytes, each from the middle of a different
    standard-library module (sorted by path, so the choice is the same on every run of one
    Python version); the first `skip` suitable modules are passed over."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    docs: list[np.ndarray] = []
    suitable = 0
    for path in paths:
        data = path.read_bytes()
        if len(data) < 4 * length or not data.isascii():
            continue
        suitable += 1
        if suitable <= skip:
            continue
        middle = len(data) // 2
        docs.append(np.frombuffer(data[middle:middle + length], dtype=np.uint8).astype(np.int64))
        if len(docs) == n:
            return docs
    raise SystemExit(f"error: the standard library at {root} has too few modules for "
                     f"{n} documents of {length} bytes")


@dataclass
class Point:
    epoch: int
    train_loss: float
    val_loss: float
    exact_match: float
    token_match: float
    rouge_l: float


def _lr_at(step: int, total: int, cfg: Config) -> float:
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, total - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _validation_loss(model: torch.nn.Module, docs: torch.Tensor, batch_size: int) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model(docs[i:i + batch_size, :-1], docs[i:i + batch_size, 1:]).mean()
                  for i in range(0, len(docs), batch_size)]
    model.train()
    return float(torch.stack(losses).mean())


def train_and_audit(cfg: Config, train_docs: list[np.ndarray], val_docs: list[np.ndarray],
                    goldfish: bool, epochs: int, eval_every: int, prefix: int,
                    suffix: int) -> list[Point]:
    """Train from the seed's initialization for `epochs` epochs; audit every eval_every."""
    t = cfg.train
    model = build_model(cfg.model, seed=t.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.effective_weight_decay())
    rows = torch.from_numpy(np.stack(train_docs))  # (n_docs, seq_len + 1)
    val = torch.from_numpy(np.stack(val_docs))
    steps_per_epoch = math.ceil(len(rows) / t.batch_size)
    total_steps = epochs * steps_per_epoch
    order_rng = torch.Generator().manual_seed(t.seed)  # same order for both losses
    points: list[Point] = []
    step = 0
    for epoch in range(1, epochs + 1):
        epoch_loss, epoch_batches = 0.0, 0
        for batch in rows[torch.randperm(len(rows), generator=order_rng)].split(t.batch_size):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            if goldfish:
                mask = goldfish_mask(inputs, targets, t.goldfish_k, t.goldfish_h)
            else:
                mask = torch.ones_like(targets, dtype=torch.bool)
            loss = (model(inputs, targets) * mask).sum() / mask.sum()
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, total_steps, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            step += 1
            epoch_loss += loss.item()
            epoch_batches += 1
        if epoch % eval_every == 0 or epoch == epochs:
            report = audit_memorization(model, train_docs, prefix=prefix, suffix=suffix,
                                        batch_size=len(train_docs))
            points.append(Point(epoch=epoch, train_loss=epoch_loss / epoch_batches,
                                val_loss=_validation_loss(model, val, t.batch_size),
                                exact_match=report.exact_match_rate,
                                token_match=report.token_match_rate, rouge_l=report.rouge_l))
            p = points[-1]
            print(f"  [{'goldfish' if goldfish else 'standard'}] epoch {epoch:>3}: train "
                  f"{p.train_loss:.3f} val {p.val_loss:.3f} exact {p.exact_match:.2f} token "
                  f"{p.token_match:.2f} rougeL {p.rouge_l:.2f}", flush=True)
    return points


def print_table(standard: list[Point], goldfish: list[Point], k: int) -> None:
    table = Table("epoch", "standard: exact", "token", "ROUGE-L", "train", "val",
                  f"goldfish k={k}: exact", "token", "ROUGE-L", "train", "val")
    for s, g in zip(standard, goldfish):
        table.row(s.epoch, *(cell for p in (s, g) for cell in (
            f"{p.exact_match:.2f}", f"{p.token_match:.2f}", f"{p.rouge_l:.2f}",
            f"{p.train_loss:.3f}", f"{p.val_loss:.3f}")))


def save_plot(standard: list[Point], goldfish: list[Point], k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = [("exact_match", "exact match"), ("rouge_l", "ROUGE-L"), ("val_loss",
                                                                     "validation loss")]
    for ax, (field, title) in zip(axes, series):
        for points, label, style in ((standard, "standard loss", "o-"),
                                     (goldfish, f"goldfish k={k}", "s-")):
            ax.plot([p.epoch for p in points], [getattr(p, field) for p in points], style,
                    label=label)
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if field != "val_loss":
            ax.set_ylim(-0.05, 1.05)
    axes[0].legend()
    fig.suptitle("Memorization of training documents: standard vs goldfish loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--config", default=str(EXAMPLE_CONFIG))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--docs", type=int, default=16, help="training documents")
    parser.add_argument("--val-docs", type=int, default=32, help="held-out documents")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=5, help="epochs between audits")
    parser.add_argument("--prefix", type=int, default=128, help="prompt length, tokens")
    parser.add_argument("--suffix", type=int, default=64, help="continuation length, tokens")
    parser.add_argument("--out", default="runs/bench-memorization",
                        help="directory for memorization.png and memorization.json")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)

    cfg = load_config(args.config, args.set)
    if args.threads:
        torch.set_num_threads(args.threads)
    length = cfg.train.seq_len + 1
    if args.prefix + args.suffix > cfg.train.seq_len:
        fail(f"--prefix + --suffix = {args.prefix + args.suffix} must fit in train.seq_len = "
             f"{cfg.train.seq_len}")
    train_docs = stdlib_documents(args.docs, length)
    val_docs = stdlib_documents(args.val_docs, length, skip=args.docs)
    k = cfg.train.goldfish_k
    header("Memorization: the standard loss against the goldfish loss",
           f"{cfg.model.n_layers} layers, dim {cfg.model.dim}, "
           f"{build_model(cfg.model).num_params() / 1e6:.1f}M parameters; {args.docs} training "
           f"documents of {cfg.train.seq_len} tokens, {args.epochs} epochs, goldfish k={k} "
           f"h={cfg.train.goldfish_h}; audit: prompt {args.prefix}, continuation {args.suffix}; "
           "train: the epoch's mean loss on the tokens that count (goldfish leaves 1 in k out)")

    started = time.perf_counter()
    standard = train_and_audit(cfg, train_docs, val_docs, False, args.epochs, args.eval_every,
                               args.prefix, args.suffix)
    goldfish = train_and_audit(cfg, train_docs, val_docs, True, args.epochs, args.eval_every,
                               args.prefix, args.suffix)
    elapsed = time.perf_counter() - started

    print()
    print_table(standard, goldfish, k)
    print()
    for name, points in (("standard", standard), (f"goldfish k={k}", goldfish)):
        best = min(points, key=lambda p: p.val_loss)
        print(f"{name:>14}: final exact match {points[-1].exact_match:.2f}, ROUGE-L "
              f"{points[-1].rouge_l:.2f}; best validation loss {best.val_loss:.3f} "
              f"(epoch {best.epoch}), final {points[-1].val_loss:.3f}")
    print(f"({elapsed:.0f} s for both runs)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_plot(standard, goldfish, k, out / "memorization.png")
    (out / "memorization.json").write_text(json.dumps(
        {"config": cfg.to_dict(), "args": vars(args),
         "standard": [p.__dict__ for p in standard],
         "goldfish": [p.__dict__ for p in goldfish]}, indent=2))
    print(f"plot: {out / 'memorization.png'}   data: {out / 'memorization.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
