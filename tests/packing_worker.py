"""Run by torchrun from test_packing_grid.py: packed chat data on every grid of this world size
against one process. Cases:
- "logits": each rank's packed rows (the loader's, balanced) through the parallel model; the
  logits of every document (this rank's vocabulary slice) against the document alone through
  the one-process model;
- "train": three SGD steps of the masked loss (trained tokens only, normalized by the global
  batch's trained count) with gradient accumulation and balanced shards, against one process
  with the whole batch in one micro-batch: losses and weights.
Writes one JSON line per case (grid_cases.py)."""

from __future__ import annotations

import os

import torch

from fourfold.config import ParallelConfig, model_config
from fourfold.data import BatchLoader
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, parallelize
from fourfold.plan.perf import sequence_cost

from grid_cases import one_process_reference, run_grid_cases  # noqa: E402

BATCH, SEQ, STEPS = 8, 128, 3  # rows per step, whole job (test_packing_grid.py uses the same)


def config(case: dict):  # noqa: ANN201
    return model_config("debug", max_seq_len=SEQ, bias=case.get("bias", False),
                        tie_embeddings=case.get("tie", False))


def loader(shard: tuple[int, int], accum: int) -> BatchLoader:
    cfg = config({})
    return BatchLoader(os.environ["FOURFOLD_TEST_DATA"], "train", BATCH, SEQ, seed=5,
                       shard_index=shard[0], num_shards=shard[1], micro_batches=accum,
                       cost=sequence_cost(cfg, SEQ))


def parallel(case: dict, shape: GridShape, grid: Grid):  # noqa: ANN201
    model = build_model(config(case), seed=7, device="meta")
    model.activation_checkpointing = case.get("ckpt", False)
    return parallelize(model, grid, ParallelConfig(x=shape.x, y=shape.y, z=shape.z,
                                                   data=shape.data, bucket_mb=0.05))


def logits_case(shape: GridShape, grid: Grid, case: dict) -> dict:
    reference = one_process_reference(case, lambda: build_model(config(case), seed=7).eval())
    pmodel = parallel(case, shape, grid)
    pmodel.eval()
    batch = loader(grid.batch_shard, 1).next_batch()
    with torch.no_grad():
        logits = pmodel(batch.inputs, documents=batch.documents)  # (b, T, V / y)
    start = getattr(pmodel.criterion, "vocab_start", None) or 0
    width = logits.shape[-1]
    worst, documents, shared_rows = 0.0, 0, 0
    with torch.no_grad():
        for row in range(batch.rows):
            ids = batch.documents[row]
            shared_rows += int(ids.max()) > 0
            for d in ids.unique().tolist():
                where = (ids == d).nonzero().flatten()
                alone = reference(batch.inputs[row:row + 1, where])[0, :, start:start + width]
                worst = max(worst, float((alone - logits[row, where]).abs().max()))
                documents += 1
    return dict(ok=True, max_logit_diff=worst, documents=documents, shared_rows=shared_rows)


def train(pmodel, shard: tuple[int, int], accum: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    data = loader(shard, accum)
    opt = torch.optim.SGD([p for p in pmodel.parameters()], lr=0.5)
    losses, counts = [], []
    for _ in range(STEPS):
        micro = data.next_batch().split(accum)
        masks = [m.loss_weights() for m in micro]
        total_count = pmodel.reduce_over_batch(torch.stack([m.sum() for m in masks]).sum())
        total = torch.zeros(())
        for i, (m, mask) in enumerate(zip(micro, masks)):
            pmodel.set_requires_gradient_sync(i == len(micro) - 1)
            per_token = pmodel(m.inputs, m.targets, documents=m.documents)
            loss = (per_token * mask).sum() / total_count
            loss.backward()
            pmodel.finish_backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(pmodel.reduce_over_batch(total)))
        counts.append(float(total_count))
    return losses, counts


def train_case(shape: GridShape, grid: Grid, case: dict) -> dict:
    def reference() -> tuple[list[float], dict]:
        model = build_model(config(case), seed=7)
        losses, _ = train(parallelize(model, Grid.single()), (0, 1), 1)
        return losses, model.state_dict()

    ref_losses, ref_state = one_process_reference(case, reference)
    pmodel = parallel(case, shape, grid)
    losses, counts = train(pmodel, grid.batch_shard, case.get("accum", 1))
    state = pmodel.full_state_dict()
    return dict(ok=True, losses=losses, ref_losses=ref_losses, trained_counts=counts,
                max_rel_loss=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                max_weight_diff=max(float((state[k] - ref_state[k]).abs().max())
                                    for k in ref_state))


def run_case(shape: GridShape, grid: Grid, case: dict) -> dict:
    return logits_case(shape, grid, case) if case["kind"] == "logits" else \
        train_case(shape, grid, case)


if __name__ == "__main__":
    run_grid_cases("FOURFOLD_TEST_CASES", "case", run_case)
