"""LOMO (Lv et al. 2023): SGD fused into backward. Each shard is updated the moment its gradient
is final and the gradient is freed at once, so no full gradient buffer ever exists.

"Final" on a grid means after the shard's z reduce-scatter and its data all-reduce (the engine's
grad-ready hook, Engine.set_grad_ready_hook); on one process, when autograd has accumulated it
(a post-accumulate-grad hook). With data > 1 a gradient lives until its bucket's all-reduce is
done (at most two buckets in flight); norms and biases, summed over z at the end of backward,
are updated last.

Clipping (train.method.clip_mode): "value" clamps each element to +-train.grad_clip (local, exact on
every grid); "two_pass" runs backward twice, the first only to compute the global norm (the
paper's way), then clips by train.grad_clip; "none".
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fourfold.config import TrainConfig
from fourfold.methods.lomo import FusedBackwardOptions
from fourfold.parallel import Layout, ParallelModel
from fourfold.train.methods.base import (ParamView, PerParameterState, PhaseHooks, StepData,
                                         StepGuard, StepResult, TrainingMethod, backward_pass,
                                         check_meta, live_grad_bytes, on_final_gradients,
                                         padded_dims, param_views, reduce_loss, shard_norm_sq)
from fourfold.noise import CHUNK_ELEMENTS


class FusedBackward(TrainingMethod):
    """The machinery of a method that updates each shard inside backward."""

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        options = cfg.options()
        assert isinstance(options, FusedBackwardOptions)
        self.views = param_views(pmodel, tied_output)
        self._view = {id(v.param): v for v in self.views}
        self.grid, self.comm = pmodel.grid, pmodel.comm
        self.clip_mode, self.grad_clip = options.clip_mode, cfg.grad_clip
        self.weight_decay = cfg.effective_weight_decay()
        self._phase = ""  # "norm": first pass of two_pass; "update"; "": not in a step
        self._lr, self._scale = 0.0, 1.0
        # on the grid's device: the gradients' squared norms are added into it in place
        self._norm_sq = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        self.peak_grad_bytes = 0  # the most gradient bytes alive at one hand-off (tests read it)
        self._release = on_final_gradients(pmodel, self.views, self._on_grad_ready)
        self.hooks = hooks or PhaseHooks()

    @torch.no_grad()
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._phase or p.grad is None or id(p) not in self._view:
            return
        self.peak_grad_bytes = max(self.peak_grad_bytes, live_grad_bytes(self.views))
        view = self._view[id(p)]
        grad = p.grad
        if self._phase == "norm":
            self._norm_sq += shard_norm_sq(view, grad, self.grid.shape)
        else:
            if self.clip_mode == "value" and self.grad_clip > 0:
                grad.clamp_(-self.grad_clip, self.grad_clip)
            elif self._scale != 1.0:
                grad.mul_(self._scale)
            self.update(view, grad)
        del grad
        self._release(p)

    def update(self, view: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        if data.micro_steps != 1:
            raise ValueError(f"{self.name} updates during backward: one micro-step per step, "
                             f"not {data.micro_steps}")
        self._lr, self._scale, norm = lr, 1.0, math.nan
        self.hooks.step_start()
        try:
            if self.clip_mode == "two_pass":
                self._phase = "norm"
                self._norm_sq.zero_()
                loss = reduce_loss(pmodel, backward_pass(pmodel, data, self.hooks.after_forward))
                total = self._norm_sq.clone()
                if self.grid.world_size > 1:  # data replicas hold the same gradients
                    total = self.comm.all_reduce(total, "tensor").wait()
                norm = float(total.sqrt())
                # nothing has moved yet: a guard (nan_policy = "skip") can still skip the step
                reason = guard.check(loss, norm) if guard is not None else None
                if reason is not None or not math.isfinite(norm):
                    return StepResult(loss, norm, True, reason or "non-finite gradient norm")
                if self.grad_clip > 0 and norm > self.grad_clip:
                    self._scale = self.grad_clip / (norm + 1e-6)
            self._phase = "update"
            loss = reduce_loss(pmodel, backward_pass(pmodel, data, self.hooks.after_forward))
        finally:
            self._phase = ""
        if self.clip_mode == "two_pass":
            return StepResult(loss, norm)
        # the update is done, its norm never known: a guard can only judge the loss, and only
        # report it (hence nan_policy "skip" needs two_pass)
        reason = guard.check(loss, None) if guard is not None else None
        return StepResult(loss, norm, False, reason or "")

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {}, {"kind": self.name}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)


class LOMO(FusedBackward):
    """w <- (1 - lr wd) w - lr g, shard by shard as g becomes final. No optimizer state."""

    name = "lomo"

    def update(self, view: Any, grad: torch.Tensor) -> None:
        p = view.param
        if view.decay and self.weight_decay:
            p.mul_(1.0 - self._lr * self.weight_decay)
        p.add_(grad, alpha=-self._lr)


class AdaLomo(PerParameterState, FusedBackward):
    """AdaLomo (Lv et al. 2023): LOMO with an Adafactor-style factored second moment and a
    relative, normalised step, fused into backward like LOMO.

    For a matrix gradient g (m x n): row means r and column means c of g^2 are averaged with
    beta2; v = r c^T / mean(r); u = g / sqrt(v), divided by max(1, RMS(u)); the step is
    lr * max(1e-3, RMS(w)). A vector keeps an unfactored v. On a grid every statistic is over
    the full matrix: row sums are reduced over the axes that split the columns, column sums
    over those that split the rows, RMS sums over all splitting axes (a few floats per row or
    column, a scalar per tensor). State: m + n floats per matrix, each shard its own part of the
    global row and column means (checkpoints reshard them to any grid).
    """

    name = "adalomo"

    def __init__(self, pmodel: ParallelModel, cfg: TrainConfig, tied_output: bool = False,
                 hooks: PhaseHooks | None = None) -> None:
        super().__init__(pmodel, cfg, tied_output, hooks)
        self.beta2 = cfg.beta2
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps_done = 0
        self._t = 1  # the step being taken, for the bias correction of beta2

    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        self._t = self.steps_done + 1
        result = super().step(pmodel, data, lr, guard)
        if not result.skipped:
            self.steps_done += 1
        return result

    def _sum(self, t: torch.Tensor, axes: tuple) -> torch.Tensor:
        for axis in axes:
            t = self.comm.all_reduce(t, axis).wait()
        return t

    def field_layout(self, view: ParamView, field: str) -> Layout | None:
        # a matrix's row means follow its split rows, column means its split columns
        if view.param.dim() == 2:
            rows, cols = padded_dims(view)
            return {"row": Layout((rows,)), "col": Layout((cols,))}.get(field)
        return view.layout if field == "v" else None

    def update(self, view: Any, grad: torch.Tensor) -> None:
        p, b2 = view.param, self.beta2
        g = grad.float()
        state = self.state.setdefault(view.name, {})
        dims = view.layout.dims + ((),) * (p.dim() - len(view.layout.dims))
        correction = 1.0 - b2 ** self._t
        if p.dim() == 2:
            (m, n), (row_axes, col_axes) = view.full_shape, dims
            # row blocks of ~1 MiB: no temporary as large as the matrix (the embedding's would
            # be as large as its gradient), on a GPU too (larger blocks cost memory there and
            # gain no step time)
            block = max(1, CHUNK_ELEMENTS // g.shape[1])
            chunks = [(r, min(r + block, g.shape[0])) for r in range(0, g.shape[0], block)]
            row_sums, col_sums = [], torch.zeros(g.shape[1], dtype=g.dtype, device=g.device)
            for a, b in chunks:
                g2 = g[a:b].pow(2).add_(1e-30)
                row_sums.append(g2.sum(1))
                col_sums += g2.sum(0)
            rows = self._sum(torch.cat(row_sums), col_axes) / n  # (m_local,) full-row means
            cols = self._sum(col_sums, row_axes) / m  # (n_local,) full-column means
            if not state:
                state["row"], state["col"] = torch.zeros_like(rows), torch.zeros_like(cols)
            state["row"].mul_(b2).add_(rows, alpha=1.0 - b2)
            state["col"].mul_(b2).add_(cols, alpha=1.0 - b2)
            mean_row = self._sum(state["row"].sum(), row_axes) / m
            for a, b in chunks:  # u = g / sqrt(v), v = r c^T / mean(r), a row block at a time
                v = torch.outer(state["row"][a:b], state["col"]).div_(mean_row * correction)
                g[a:b].div_(v.sqrt_())
            u = g
        else:
            g2 = g.pow(2).add_(1e-30)
            if not state:
                state["v"] = torch.zeros_like(g2)
            state["v"].mul_(b2).add_(g2, alpha=1.0 - b2)
            u = g.div_((state["v"] / correction).sqrt_())
        numel = math.prod(view.full_shape)
        flat_u, flat_p = u.reshape(-1), p.detach().float().reshape(-1)
        # dot products: sums of squares without a full-size temporary; the RMS stay on the
        # device (a GPU does not wait for them: no host synchronisation per tensor)
        sums = self._sum(torch.stack([torch.dot(flat_u, flat_u), torch.dot(flat_p, flat_p)]),
                         view.layout.split_axes)
        rms_u, rms_p = sums.div_(numel).sqrt_().unbind()
        u.div_(rms_u.clamp_(min=1.0))
        if view.decay and self.weight_decay:
            p.mul_(1.0 - self._lr * self.weight_decay)
        p.add_(u.mul_(rms_p.clamp_(min=1e-3).mul_(-self._lr)).to(p.dtype))
