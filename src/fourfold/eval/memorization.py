"""Measure how much of its training text a model reproduces verbatim.

Each document is cut into a prompt (its first `prefix` tokens) and a true continuation (the
next `suffix` tokens). The model continues the prompt greedily for `suffix` tokens, and the
generated tokens are compared with the true ones three ways:

- exact match: the whole continuation is reproduced (the SC24 paper's and the goldfish paper's
  headline number);
- token match: the fraction of positions where the generated token equals the true one;
- ROUGE-L F1: longest common subsequence of generated and true tokens, which still credits a
  continuation that drifts by a token and then falls back into the memorized text.

On a process grid every rank audits the same documents through the parallelized model (full
recomputation, no cache) and picks each token with a parallel argmax over the vocabulary shards,
so every rank, and a single process, reach the same report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from fourfold.errors import FourfoldError
from fourfold.models.llama import KVCache, Llama

if TYPE_CHECKING:
    from fourfold.parallel import ParallelModel


class MemorizationAuditError(FourfoldError, ValueError):
    """A user mistake in an audit request; the message is one line meant for the user."""


class NextLogits(Protocol):
    """Any model that maps tokens (B, T), with an optional cache of earlier positions, to
    logits (B, T, V). A fourfold Llama is one; tests pass hand-made ones."""

    def __call__(self, tokens: torch.Tensor, cache: Any = None) -> torch.Tensor: ...


def greedy_next(logits: torch.Tensor) -> torch.Tensor:
    """The greedy choice (B,) from the last position's logits (B, T, V). On a grid whose logits
    are vocabulary shards, a parallel argmax goes here."""
    return logits[:, -1, :].argmax(dim=-1)


def vocab_parallel_greedy_next(pmodel: ParallelModel) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `pick` for greedy_decode on a grid: from this rank's vocabulary shard of the logits
    (B, T, V/Gy), the global argmax (B,) over all y-ranks, ties to the lowest global index
    (torch.argmax's choice on whole logits). On a grid with whole logits it is greedy_next."""
    vocab_start = getattr(pmodel.criterion, "vocab_start", None)
    if vocab_start is None:  # whole logits (y = 1 included)
        return greedy_next
    comm = pmodel.comm

    def pick(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1, :]
        local_index = last.argmax(dim=-1)
        local_value = last.gather(-1, local_index[:, None]).squeeze(-1)
        # float64 carries both the (float32 or lower) logit and the vocabulary index exactly.
        mine = torch.stack([local_value.double(), (local_index + vocab_start).double()])[None]
        gathered = comm.all_gather(mine, "y").wait()  # (Gy, 2, B)
        values, indices = gathered[:, 0], gathered[:, 1]
        best = values.max(dim=0).values
        candidates = torch.where(values == best, indices, torch.full_like(indices, float("inf")))
        return candidates.min(dim=0).values.long()

    return pick


def greedy_decode(model: NextLogits, prompts: torch.Tensor, n_new: int,
                  cache: Any = None,
                  pick: Callable[[torch.Tensor], torch.Tensor] = greedy_next) -> torch.Tensor:
    """Continue prompts (B, P) by n_new tokens; returns the new tokens (B, n_new).

    With a cache (e.g. `KVCache.empty(n_layers)`) the prompt is prefilled once and each step
    feeds one token; without one, each step runs the model on the whole sequence so far.
    """
    if n_new < 1:
        return prompts.new_empty(prompts.shape[0], 0)
    generated: list[torch.Tensor] = []
    with torch.no_grad():
        logits = model(prompts, cache=cache)
        sequence = prompts
        for step in range(n_new):
            next_ids = pick(logits).to(prompts.dtype)  # (B,)
            generated.append(next_ids)
            if step == n_new - 1:
                break
            sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
            logits = model(next_ids[:, None] if cache is not None else sequence, cache=cache)
    return torch.stack(generated, dim=1)


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of two token sequences (O(len(a) * len(b)))."""
    if not a or not b:
        return 0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f1(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F1 on token ids: the harmonic mean of LCS/len(candidate) and LCS/len(reference)."""
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


@dataclass
class DocumentResult:
    """One audited document. `document` indexes the list given to the audit; `matched_prefix`
    is how many generated tokens match before the first mistake."""

    document: int
    exact_match: bool
    token_match: float
    rouge_l: float
    matched_prefix: int


@dataclass
class MemorizationReport:
    prefix: int
    suffix: int
    documents_audited: int
    documents_too_short: int
    exact_match_rate: float
    token_match_rate: float
    rouge_l: float
    rows: list[DocumentResult]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def format_table(self, max_rows: int = 20) -> str:
        """A summary plus the first max_rows per-document rows, as plain text."""
        lines = [
            f"memorization audit: prompt {self.prefix} tokens, continuation {self.suffix} tokens, "
            f"{self.documents_audited} documents ({self.documents_too_short} too short, skipped)",
            f"exact match {self.exact_match_rate:.3f}   token match {self.token_match_rate:.3f}"
            f"   ROUGE-L {self.rouge_l:.3f}",
            "",
            f"{'doc':>6} {'exact':>6} {'token':>7} {'rougeL':>7} {'matched':>8}",
        ]
        for row in self.rows[:max_rows]:
            lines.append(f"{row.document:>6} {'yes' if row.exact_match else 'no':>6} "
                         f"{row.token_match:>7.3f} {row.rouge_l:>7.3f} "
                         f"{row.matched_prefix:>8}")
        if len(self.rows) > max_rows:
            lines.append(f"... {len(self.rows) - max_rows} more documents (use --json for all)")
        return "\n".join(lines)


def score_continuation(document: int, generated: Sequence[int],
                       truth: Sequence[int]) -> DocumentResult:
    """Compare a generated continuation with the true one, position by position and by LCS."""
    if len(generated) != len(truth) or not truth:
        raise ValueError(f"generated ({len(generated)}) and true ({len(truth)}) continuations "
                         "must have the same, non-zero length")
    same = [g == t for g, t in zip(generated, truth)]
    matched_prefix = same.index(False) if False in same else len(same)
    return DocumentResult(document=document, exact_match=all(same),
                          token_match=sum(same) / len(same),
                          rouge_l=rouge_l_f1(generated, truth), matched_prefix=matched_prefix)


def _default_cache_factory(model: NextLogits) -> Callable[[], Any] | None:
    if isinstance(model, Llama):
        n_layers = model.cfg.n_layers
        return lambda: KVCache.empty(n_layers)
    return None


def audit_memorization(model: NextLogits, documents: Sequence[Sequence[int] | np.ndarray],
                       prefix: int, suffix: int, batch_size: int = 8,
                       new_cache: Callable[[], Any] | None = None,
                       pick: Callable[[torch.Tensor], torch.Tensor] = greedy_next,
                       device: torch.device | None = None) -> MemorizationReport:
    """Prompt with each document's first `prefix` tokens, greedily generate `suffix` tokens and
    compare them with the document's next `suffix` tokens. Documents shorter than prefix+suffix
    are skipped (counted in the report).

    `new_cache` makes a fresh cache per batch; by default a KVCache for a fourfold Llama and none
    (recompute the whole sequence each step) for other callables. `pick` chooses the next token
    from the logits (see vocab_parallel_greedy_next); `device` is where the tokens go (default:
    the model's parameters' device). On a grid use audit_memorization_on_grid.
    """
    usable = _usable_documents(model, documents, prefix, suffix, batch_size)
    if new_cache is None:
        new_cache = _default_cache_factory(model)
    device = device if device is not None else _model_device(model)
    rows = _decode_and_score(model, usable, prefix, suffix, batch_size, new_cache, pick, device)
    return _report(prefix, suffix, len(documents), rows)


def _usable_documents(model: object, documents: Sequence[Sequence[int] | np.ndarray],
                      prefix: int, suffix: int, batch_size: int
                      ) -> list[tuple[int, np.ndarray]]:
    """(index, first prefix + suffix tokens) of each document long enough; checks the sizes."""
    if prefix < 1 or suffix < 1:
        raise MemorizationAuditError(f"prefix = {prefix}, suffix = {suffix}: both must be at "
                                     "least 1 token")
    if batch_size < 1:
        raise MemorizationAuditError(f"batch_size = {batch_size}: must be at least 1")
    if isinstance(model, Llama) and prefix + suffix > model.cfg.max_seq_len:
        raise MemorizationAuditError(
            f"prefix + suffix = {prefix + suffix} tokens: longer than the model's max_seq_len "
            f"{model.cfg.max_seq_len}; use at most {model.cfg.max_seq_len} in all")
    usable = [(i, np.asarray(doc, dtype=np.int64)[:prefix + suffix])
              for i, doc in enumerate(documents) if len(doc) >= prefix + suffix]
    if not usable:
        raise MemorizationAuditError(
            f"none of the {len(documents)} documents has prefix + suffix = {prefix + suffix} "
            "tokens; use a shorter --prefix or --suffix")
    return usable


def _decode_and_score(model: NextLogits, usable: list[tuple[int, np.ndarray]], prefix: int,
                      suffix: int, batch_size: int, new_cache: Callable[[], Any] | None,
                      pick: Callable[[torch.Tensor], torch.Tensor],
                      device: torch.device) -> list[DocumentResult]:
    was_training = getattr(model, "training", False)
    if isinstance(model, torch.nn.Module):
        model.eval()
    try:
        rows: list[DocumentResult] = []
        # Every prompt has exactly `prefix` tokens, so any documents batch together unpadded.
        for start in range(0, len(usable), batch_size):
            chunk = usable[start:start + batch_size]
            tokens = torch.from_numpy(np.stack([doc for _, doc in chunk])).to(device)
            cache = new_cache() if new_cache is not None else None
            generated = greedy_decode(model, tokens[:, :prefix], suffix, cache=cache,
                                      pick=pick).cpu()
            truth = tokens[:, prefix:].cpu()
            for (index, _), gen_row, true_row in zip(chunk, generated.tolist(), truth.tolist()):
                rows.append(score_continuation(index, gen_row, true_row))
        return rows
    finally:
        if isinstance(model, torch.nn.Module) and was_training:
            model.train()


def _report(prefix: int, suffix: int, n_documents: int,
            rows: list[DocumentResult]) -> MemorizationReport:
    n = len(rows)
    return MemorizationReport(
        prefix=prefix, suffix=suffix, documents_audited=n,
        documents_too_short=n_documents - n,
        exact_match_rate=sum(r.exact_match for r in rows) / n,
        token_match_rate=sum(r.token_match for r in rows) / n,
        rouge_l=sum(r.rouge_l for r in rows) / n,
        rows=rows)


def audit_memorization_on_grid(pmodel: ParallelModel,
                               documents: Sequence[Sequence[int] | np.ndarray],
                               prefix: int, suffix: int,
                               batch_size: int = 8) -> MemorizationReport:
    """audit_memorization through a parallelized model. Collective: every rank of the grid calls
    it with the same documents and gets the same report. The documents are split over the data
    replicas (each tensor-parallel group decodes its share); the rows are gathered over data.
    Decodes with full recomputation (the parallel model has no KV cache)."""
    usable = _usable_documents(pmodel.module, documents, prefix, suffix, batch_size)
    grid = pmodel.grid
    mine = usable[grid.coord("data")::grid.size("data")]

    def forward(tokens: torch.Tensor, cache: Any = None) -> torch.Tensor:
        return pmodel(tokens)

    was_training = pmodel.training
    pmodel.eval()
    try:
        rows = _decode_and_score(forward, mine, prefix, suffix, batch_size, None,
                                 vocab_parallel_greedy_next(pmodel), grid.device)
    finally:
        pmodel.train(was_training)
    shares = pmodel.comm.all_gather_objects(rows, "data")
    rows = sorted((r for share in shares for r in share), key=lambda r: r.document)
    return _report(prefix, suffix, len(documents), rows)


def _model_device(model: NextLogits) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def memorization_main(run_dir: str, data: str, docs: int, prefix: int, suffix: int,
                      as_json: bool, x: int = 1, y: int = 1, z: int = 1) -> int:
    """`fourfold eval memorization RUN_DIR --data DATA`: audit a trained run on its training
    documents, print a table (or JSON), return the exit code.

    Inside a multi-rank job (torchrun, srun, `--nproc`) every rank joins a grid of x*y*z
    tensor-parallel ranks (the rest replicate over data) and runs the audit; rank 0 prints.
    """
    from fourfold.data import documents, resolve_data_path
    from fourfold.parallel import Grid, GridShape, init_distributed, parallelize
    from fourfold.rundir import check_data_for_run
    from fourfold.train.runs import load_trained

    if docs < 1:
        raise MemorizationAuditError(f"--docs {docs}: must be at least 1")
    for axis, size in (("x", x), ("y", y), ("z", z)):
        if size < 1:
            raise MemorizationAuditError(f"--{axis} {size}: must be at least 1")
    model, cfg = load_trained(run_dir)
    data_dir = resolve_data_path(data, cfg.data.tokenizer)
    check_data_for_run(run_dir, cfg, data_dir, data)
    texts = documents(data_dir, "train", docs)

    p = cfg.parallel
    rank, world, device = init_distributed(p.backend, p.timeout_s, device=cfg.train.device)
    shape = GridShape.resolve(x, y, z, "auto", world)
    if world == 1:
        # One process: the plain model with its KV cache is the fast path.
        report = audit_memorization(model, texts, prefix=prefix, suffix=suffix)
    else:
        grid = Grid.build(shape, device, timeout_s=p.timeout_s)
        model.to(device)
        pmodel = parallelize(model, grid, p)
        report = audit_memorization_on_grid(pmodel, texts, prefix=prefix, suffix=suffix)
    if rank == 0:
        print(report.to_json() if as_json else report.format_table(), flush=True)
    return 0
