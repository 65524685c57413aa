"""Run by torchrun from test_lean_optim.py: for every grid of this world size, the checks named
in FOURFOLD_TEST_CHECKS, each against this process alone. Writes one JSON line per case.

Checks:
  frozen   some weights frozen: they get no gradient and move no reduce-scatter or data bytes;
           the trainable ones train as on one process (SGD, three steps)
  METHOD   a memory-lean training method (train/methods) trains the `debug` model as one
           process does: losses and gathered weights
"""

from __future__ import annotations

import math

import torch

from fourfold.config import ParallelConfig, TrainConfig, model_config
from fourfold.methods import method_options
from fourfold.models import build_model
from fourfold.parallel import Grid, GridShape, parallelize
from grid_cases import one_process_reference, run_grid_cases

BATCH, SEQ = 8, 16

# frozen check: inputs of every frozen linear still need a gradient (the embedding trains),
# so only the frozen weights' own work disappears
FROZEN = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
          "ffn.gate_proj.weight", "output.weight", "layers.0.attn_norm.weight",
          "layers.1.ffn.down_proj.bias")


def batches(vocab: int, steps: int, accum: int = 1
            ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        micro = BATCH // accum
        out.append([(tokens[i * micro:(i + 1) * micro, :-1], tokens[i * micro:(i + 1) * micro, 1:])
                    for i in range(accum)])
    return out


def shard_batch(micro_batches, index: int, count: int):
    out = []
    for inputs, targets in micro_batches:
        b = inputs.shape[0] // count
        out.append((inputs[index * b:(index + 1) * b], targets[index * b:(index + 1) * b]))
    return out


def pcfg(shape: GridShape) -> ParallelConfig:
    return ParallelConfig(x=shape.x, y=shape.y, z=shape.z, data=shape.data, bucket_mb=0.05)


def freeze(model: torch.nn.Module, names: tuple[str, ...] = FROZEN) -> None:
    for name, p in model.named_parameters():
        if name.endswith(names):
            p.requires_grad_(False)


def sgd_steps(pmodel, data, shard: tuple[int, int]) -> tuple[list[float], dict]:
    """Three SGD steps; returns losses and facts about gradients and saved activations."""
    params = [p for p in pmodel.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    losses, facts = [], {"frozen_with_grad": [], "saved_bytes": 0}
    for micro in data:
        local = shard_batch(micro, *shard)
        total = torch.zeros(())
        for inputs, targets in local:
            saved = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t.numel() * t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = pmodel(inputs, targets).sum() / (BATCH * SEQ)
            facts["saved_bytes"] = sum(saved)
            loss.backward()
            pmodel.finish_backward()
            total += loss.detach()
        facts["frozen_with_grad"] += [n for n, p in pmodel.named_parameters()
                                      if not p.requires_grad and p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(pmodel.reduce_over_batch(total)))
    return losses, facts


def check_frozen(shape: GridShape, grid: Grid) -> dict:
    cfg = model_config("debug", bias=True)
    data = batches(cfg.vocab_size, 3)

    def reference() -> tuple[list[float], dict]:
        ref_model = build_model(cfg, seed=7)
        freeze(ref_model)
        return sgd_steps(parallelize(ref_model, Grid.single()), data, (0, 1))[0], \
            ref_model.state_dict()

    ref_losses, ref_state = one_process_reference({"name": "frozen"}, reference)

    runs = {}
    for frozen in (False, True):
        model = build_model(cfg, seed=7)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        if frozen:
            freeze(model)
        pmodel = parallelize(model, grid, pcfg(shape))
        layouts = pmodel.layouts()
        local_initial = {n: layouts[n].shard(initial[n], shape, shape.coords(grid.rank))
                         for n in initial}
        pmodel.ledger.reset()
        losses, facts = sgd_steps(pmodel, data, grid.batch_shard)
        ledger = pmodel.ledger.snapshot()
        unchanged = all(torch.equal(p.detach(), local_initial[n])
                        for n, p in pmodel.named_parameters() if not p.requires_grad)
        # what the frozen weights would have moved: each sharded block's reduce-scatter input
        # (Gz shards of it), the z all-reduce of z-replicated ones, and the data all-reduce
        skipped = {"z": 0, "data": 0}
        for name, p in pmodel.named_parameters():
            if not name.endswith(FROZEN):
                continue
            nbytes = p.numel() * p.element_size()
            if shape.z > 1:
                skipped["z"] += nbytes * (shape.z if "z" in layouts[name].split_axes else 1)
            if shape.data > 1:
                skipped["data"] += nbytes
        state = pmodel.full_state_dict()
        runs[frozen] = dict(losses=losses, ledger=ledger, unchanged=unchanged,
                            skipped={k: 3 * v for k, v in skipped.items()}, **facts,
                            max_weight_diff=max(float((state[k] - ref_state[k]).abs().max())
                                                for k in ref_state) if frozen else None)
    on, off = runs[True], runs[False]
    return dict(ok=True, ref_losses=ref_losses, losses=on["losses"],
                max_weight_diff=on["max_weight_diff"], frozen_with_grad=on["frozen_with_grad"],
                unchanged=on["unchanged"], saved_bytes=[off["saved_bytes"], on["saved_bytes"]],
                ledger_delta={k: off["ledger"][k] - on["ledger"][k] for k in ("x", "y", "z", "data")},
                expected_delta={"x": 0, "y": 0, **on["skipped"]})


def full_backward_blockllm():
    """BlockLLM with a selection that does not stream: one backward that holds every gradient,
    every row's norm from them in one all-reduce per tensor, the same greedy choice. The
    reference that the streaming selection is held to."""
    from fourfold.train.methods.adamw import backward_pass
    from fourfold.train.methods.base import reduce_loss
    from fourfold.train.methods.blockllm import BlockLLM, choose_rows, row_norms_sq

    class FullBackwardBlockLLM(BlockLLM):
        def _select(self, pmodel, data) -> float:
            self._set_trainable(True)
            loss = reduce_loss(pmodel, backward_pass(pmodel, data))
            self.note_gradients(pmodel)
            norms = []
            for c in self.cands:
                full = torch.zeros(c.rows, dtype=torch.float64)
                if c.view.param.grad is not None:
                    full[c.first:c.first + c.count] = row_norms_sq(
                        c.matrix(c.view.param.grad), c.replicas)
                if self.grid.world_size > 1:
                    full = self.comm.all_reduce(full, "tensor").wait()
                norms.append(full.sqrt())
            new = choose_rows(norms, [c.row_size for c in self.cands], self.budget)
            self.grads = {}
            for i, c in enumerate(self.cands):
                g = c.view.param.grad
                if g is not None and new[i].numel():
                    self.grads[i] = c.matrix(g)[c.local_rows(new[i])].clone()
                c.view.param.grad = None
            self.norms = {c.view.name: n for c, n in zip(self.cands, norms)}
            self._keep_state(new)
            self.rows = new
            self._set_trainable(False)
            return loss

    return FullBackwardBlockLLM


def run_method(pmodel, cfg: TrainConfig, data, method_class=None
               ) -> tuple[list[float], object]:
    from fourfold.train.methods import StepData, batch_shard, build_method
    method = build_method(pmodel, cfg) if method_class is None else method_class(pmodel, cfg)
    index, count = batch_shard(pmodel.grid, method.batch_axes)
    losses = []
    method.selections = []  # blockllm: each selection's chosen rows and row norms
    for micro in data:
        selecting = getattr(method, "selecting_next", False)
        local = shard_batch(micro, index, count)

        def step_losses():
            for inputs, targets in local:
                yield pmodel(inputs, targets).sum() / (BATCH * SEQ)

        result = method.step(pmodel, StepData(len(local), step_losses), cfg.lr)
        losses.append(result.loss)
        if selecting:
            method.selections.append({"selected": method.selected,
                                      "norms": {k: v.tolist() for k, v in method.norms.items()}})
    return losses, method


def check_method(shape: GridShape, grid: Grid, check: dict) -> dict:
    """`check`: {"name": optimizer, "steps": n, "accum": k, "train": {TrainConfig fields},
    "method": {its [train.method] options}}."""
    # smaller than `debug`: the zeroth-order methods make noise for every weight many times
    cfg = model_config("debug", bias=True, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128)
    tcfg = TrainConfig(optimizer=check["name"], grad_accum=check.get("accum", 1),
                       method=method_options(check["name"], **check.get("method", {})),
                       **check.get("train", {}))
    # two batches in turn: a loss that goes down shows the method learns
    data = batches(cfg.vocab_size, 2, tcfg.grad_accum) * (check["steps"] // 2)
    # "freeze": true freezes FROZEN, a list the names ending so
    frozen = check.get("freeze", False)
    frozen = tuple(frozen) if isinstance(frozen, list) else FROZEN if frozen else ()

    def reference(*hooks) -> tuple:
        ref_model = build_model(cfg, seed=7)
        freeze(ref_model, frozen)
        return (*run_method(parallelize(ref_model, Grid.single()), tcfg, data, *hooks),
                ref_model.state_dict())

    ref_losses, ref_method, ref_state = one_process_reference(check, reference)
    model = build_model(cfg, seed=7)
    freeze(model, frozen)
    pmodel = parallelize(model, grid, pcfg(shape))
    pmodel.ledger.reset()
    losses, method = run_method(pmodel, tcfg, data)
    ledger = pmodel.ledger.snapshot()
    state = pmodel.full_state_dict()
    tensors, meta = method.state_dict()
    extra = {}
    if check["name"] == "blockllm":  # the selection as it was, on this grid and on one process
        full_model = build_model(cfg, seed=7)
        freeze(full_model, frozen)
        full_pmodel = parallelize(full_model, grid, pcfg(shape))
        full_losses, full = run_method(full_pmodel, tcfg, data, full_backward_blockllm())
        full_ref_losses, full_ref, _ = one_process_reference(
            {**check, "full_backward": True}, lambda: reference(full_backward_blockllm()))
        # against every candidate's gradient (at the end only the selected are trainable)
        total = sum(p.numel() * p.element_size() for n, p in pmodel.named_parameters()
                    if not n.endswith(frozen))
        extra = dict(selections=method.selections, ref_selections=ref_method.selections,
                     full_selections=full.selections, full_ref_selections=full_ref.selections,
                     full_losses=full_losses, full_ref_losses=full_ref_losses,
                     selection_grad_fraction=method.peak_grad_bytes / total,
                     full_selection_grad_fraction=full.peak_grad_bytes / total,
                     # this rank's chosen (elements, rows), and each tensor's full rows
                     selected_local=[
                         sum(c.local_rows(r).numel() * c.local_cols
                             for c, r in zip(method.cands, method.rows)),
                         sum(c.local_rows(r).numel() for c, r in zip(method.cands, method.rows))],
                     rows={c.view.name: c.rows for c in method.cands})
    if check["name"] == "galore":  # after the run's ledger: these reset it
        extra = dict(refreshes=galore_refreshes(method, ref_method, pmodel),
                     own_collectives=own_collectives(method, "adamw", pmodel, tcfg, data[0],
                                                     cfg, shape))
    if check["name"] == "adalomo" and not frozen and tcfg.options().clip_mode == "none":
        extra = dict(own_collectives=own_collectives(method, "lomo", pmodel, tcfg, data[0],
                                                     cfg, shape))
    result = dict(ok=True, losses=losses, ref_losses=ref_losses, ledger=ledger, **extra,
                max_rel_loss=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                max_weight_diff=max(float((state[k] - ref_state[k]).abs().max())
                                    for k in ref_state),
                worst_weight=max(ref_state, key=lambda k: float((state[k] - ref_state[k])
                                                                .abs().max())),
                weight_change=max(float((ref_state[k] - build_model(cfg, seed=7).state_dict()[k])
                                        .abs().max()) for k in ref_state),
                state_bytes=method.state_bytes(), meta=meta,
                # fused methods: the most gradient bytes alive at once, against all of them
                peak_grad_fraction=getattr(method, "peak_grad_bytes", 0) / sum(
                    p.numel() * p.element_size() for p in pmodel.parameters() if p.requires_grad),
                grads_left=[n for n, p in pmodel.named_parameters() if p.grad is not None],
                trainable_bytes=sum(p.numel() * p.element_size() for p in pmodel.parameters()
                                    if p.requires_grad),
                param_bytes=sum(p.numel() * p.element_size() for p in pmodel.parameters()),
                # what one forward all-gathers over z: every z-sharded module's block
                forward_gather_bytes=sum(m.block_shape[0] * m.block_shape[1] * 4
                                         for m in pmodel.engine.sharded) if shape.z > 1 else 0)
    if check["name"] == "blockllm":  # last: its selection step changes the state read above
        result["own_collectives"] = own_collectives(method, "adamw", pmodel, tcfg, data[0],
                                                    cfg, shape)
    return result


def own_collectives(method, baseline: str, pmodel, tcfg: TrainConfig, micro, cfg,
                    shape: GridShape) -> dict:
    """One step of `method` (GaLore: one without a refresh) against one step of `baseline`
    (AdamW for GaLore, LOMO for AdaLomo: the same model collectives) on the same model and
    batch: the ledger's difference per axis is the method's own, beside the planner's
    `method_collectives` for this model and grid. GaLore: also a refresh step against the
    step before it, beside `galore_refresh_collectives`."""
    from fourfold.plan.methods.galore import galore_refresh_collectives
    from fourfold.plan.perf import method_collectives
    from fourfold.train.methods import StepData, batch_shard, build_method

    index, count = batch_shard(pmodel.grid, method.batch_axes)
    local = shard_batch(micro, index, count)

    def losses():
        for inputs, targets in local:
            yield pmodel(inputs, targets).sum() / (BATCH * SEQ)

    while getattr(method, "gap", 0) and method.steps_done % method.gap == 0:
        method.step(pmodel, StepData(len(local), losses), 0.0)  # the next must not refresh
    frozen_vectors = 0
    if method.name == "blockllm":  # a selection's step (the planner's): every candidate trains
        method.selecting_next = True
        candidates = {id(c.view.param) for c in method.cands}
        frozen = [p for p in pmodel.parameters() if id(p) not in candidates]
        assert all(p.dim() == 1 for p in frozen)  # the frozen key biases
        frozen_vectors = len(frozen)

    def baseline_method():
        if method.name == "blockllm":  # the selection left only the chosen tensors trainable
            method._set_trainable(True)
        return build_method(pmodel, TrainConfig(optimizer=baseline))

    def ledger_of_a_step(m) -> tuple[dict, dict]:
        pmodel.ledger.reset()
        m.step(pmodel, StepData(len(local), losses), 0.0)
        return pmodel.ledger.snapshot(), dict(pmodel.ledger.calls)

    def per_axis(collectives) -> tuple[dict, dict]:
        nbytes, calls = {a: 0 for a in ("x", "y", "z")}, {a: 0 for a in ("x", "y", "z")}
        for c in collectives:
            nbytes[c.axis] += c.nbytes * c.calls
            calls[c.axis] += c.calls
        return nbytes, calls

    own, own_calls = ledger_of_a_step(method)
    refresh = {}
    if method.name == "galore":  # a refresh step against the step before it
        method.steps_done += -method.steps_done % method.gap
        new, new_calls = ledger_of_a_step(method)
        refresh["predicted"], refresh["predicted_calls"] = per_axis(
            galore_refresh_collectives(cfg, shape, tcfg))
        refresh["measured"] = {a: new[a] - own[a] for a in refresh["predicted"]}
        refresh["measured_calls"] = {a: new_calls.get(a, 0) - own_calls.get(a, 0)
                                     for a in refresh["predicted"]}
    # the baseline after the method's steps: a fused one takes over the hook
    base, base_calls = ledger_of_a_step(baseline_method())
    # what every step issues (galore's refresh collectives come every galore_gap steps)
    predicted, predicted_calls = per_axis(c for c in method_collectives(cfg, shape, tcfg)
                                          if c.every == 1)
    measured = {a: own[a] - base[a] for a in predicted}
    measured_calls = {a: own_calls.get(a, 0) - base_calls.get(a, 0) for a in predicted}
    if method.name == "blockllm":
        # its all-reduces over the tensor group (the ledger's "all"), which the planner books
        # on the group's innermost axis that splits; the planner counts every vector a
        # candidate, the test freezes some (their 8 bytes each)
        axis = next((a for a in ("x", "y", "z") if getattr(shape, a) > 1), None)
        if axis is not None:
            measured[axis] += own.get("all", 0) - base.get("all", 0) + 8 * frozen_vectors
            measured_calls[axis] += (own_calls.get("all", 0) - base_calls.get("all", 0)
                                     + frozen_vectors)
    return {"measured": measured, "measured_calls": measured_calls,
            "predicted": predicted, "predicted_calls": predicted_calls, "refresh": refresh}


def galore_refreshes(method, ref_method, pmodel) -> list[dict]:
    """GaLore's refresh of each matrix from a random global gradient (the same on every rank),
    each rank given its shard: the basis (its rows and block of r columns) gathered from the
    ranks against one process's and against a float64 SVD's subspace, and the bytes this
    rank's refresh moved."""
    from fourfold.parallel.parallelize import _gather_full
    from fourfold.methods.galore import projection_rank as galore_rank
    from fourfold.train.methods.base import padded_dims

    refs = {v.name: v for v in ref_method.views}
    out = []
    for i, view in enumerate(v for v in method.views if v.param.dim() == 2):
        (m, n), (rows, cols) = view.full_shape, view.param.shape
        left, r, dim = m < n, galore_rank(view.full_shape, 0), 0 if m < n else 1
        full = torch.randn(m, n, generator=torch.Generator().manual_seed(i))
        r0, c0 = view.offsets
        pmodel.ledger.reset()
        basis = method._projection(view, full[r0:r0 + rows, c0:c0 + cols], left, r, None)
        moved = sum(pmodel.ledger.snapshot().values())
        split = padded_dims(view)
        # its rows over this side's axes, its r columns over the other side's
        gathered = _gather_full(basis, method.field_layout(view, "proj"), method.comm)
        gathered = gathered.double()
        one = ref_method._projection(refs[view.name], full, left, r, None).double()
        u, _, vh = torch.linalg.svd(full.double(), full_matrices=False)
        svd = u[:, :r] if left else vh[:r].T
        parts = [math.prod(pmodel.grid.size(a) for a in axes) for axes in split]
        long_axes = sum(pmodel.grid.size(a) > 1 for a in split[1 - dim])
        out.append(dict(name=view.name, small=min(m, n), shard_bytes=4 * rows * cols,
                        small_parts=parts[dim], long_parts=parts[1 - dim], long_axes=long_axes,
                        moved=moved,
                        vs_one=float((gathered - one).abs().max()),
                        vs_svd=float((gathered @ gathered.T - svd @ svd.T).abs().max())))
    return out


def run_check(shape: GridShape, grid: Grid, check: dict) -> dict:
    if check["name"] == "frozen":
        return check_frozen(shape, grid)
    return check_method(shape, grid, check)


def main() -> None:
    run_grid_cases("FOURFOLD_TEST_CHECKS", "check", run_check)


if __name__ == "__main__":
    main()
