"""The one interface every training method implements, and what methods share: the global view
of each local shard (for seeded noise and grid-wide statistics) and the batch split.

A step is driven by the caller's `StepData`: `losses()` runs this rank's forward over the step's
micro-batches and yields each one's loss, scaled so that the sum over micro-batches and over the
ranks that split the batch (the method's `batch_axes`) is the step's mean loss. Each call is a
fresh pass over the same micro-batches; methods that need two forwards call it twice.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from fourfold.methods import MethodSpec, method_spec
from fourfold.parallel import Axis, Layout, ParallelModel
from fourfold.noise import CHUNK_ELEMENTS, ShardNoise
from fourfold.train.optim import uses_weight_decay



def _nothing() -> None:
    return None


@dataclass(frozen=True)
class PhaseHooks:
    """Calls a training method makes at the boundaries of its phases, for what acts there
    without the method knowing what it does (the run's host-memory policy:
    train/host_memory.py). Each does nothing unless given."""

    step_start: Callable[[], None] = _nothing  # before a step's first forward
    after_forward: Callable[[], None] = _nothing  # between a micro-step's forward and backward
    before_forward: Callable[[], None] = _nothing  # before each forward of a forward-only step
    before_update: Callable[[], None] = _nothing  # after backward, before the update's work
    before_transient: Callable[[], None] = _nothing  # before a large short-lived allocation


class StepGuard(Protocol):
    """What a training method asks before it applies a step's update (the trainer's is
    resilience.UpdateGate: the loss guard and train.nan_policy). A method asks once a step,
    with the step's loss and gradient norm (or its gradient estimate's size), reduced over the
    grid so that every rank is answered alike."""

    def check(self, loss: float, grad_norm: float | None) -> str | None:
        """Why the update must not be applied (one phrase), or None. `grad_norm` None: the
        method never knows it (LOMO without two_pass clipping): only the loss is judged."""

    def allow(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """`check` on the device, for a method that never reads its loss on the host: a bool
        tensor, true where the update may be applied."""


@dataclass(frozen=True)
class StepData:
    micro_steps: int
    losses: Callable[[], Iterator[torch.Tensor]]

    @classmethod
    def one_batch(cls, pmodel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  tokens: torch.Tensor, dtype: str = "float32") -> StepData:
        """A step of one micro-batch: the mean next-token loss of `tokens` (b, T + 1), every
        position counted, where every rank sees the whole batch (no batch axes split it). The
        forward runs under bfloat16 autocast when `dtype` is "bfloat16", as the trainer runs
        it. For a loop of one's own, the benches and the tests."""
        def losses() -> Iterator[torch.Tensor]:
            with torch.autocast(tokens.device.type, dtype=torch.bfloat16,
                                enabled=dtype == "bfloat16"):
                per_token = pmodel(tokens[:, :-1], tokens[:, 1:])
            yield per_token.float().mean()

        return cls(1, losses)


@dataclass(frozen=True)
class StepResult:
    """A step's numbers, the same on every rank: floats, or 0-d device tensors for a method
    that never reads them on the host (AdamW; its guard decided on the device)."""

    loss: float | torch.Tensor  # the step's mean loss
    grad_norm: float | torch.Tensor  # the norm the method clipped by, or its estimate's size
    skipped: bool = False  # the update was not applied (the guard's reason, or the method's)
    reason: str = ""


@dataclass
class ParamView:
    """One trainable local shard and where it sits in its full tensor."""

    name: str
    param: nn.Parameter
    layout: Layout
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    decay: bool  # gets decoupled weight decay (see optim.uses_weight_decay)
    noise: ShardNoise


def param_views(pmodel: ParallelModel, tied_output: bool = False) -> list[ParamView]:
    """The trainable parameters (requires_grad) of a ParallelModel, with their global place."""
    layouts = pmodel.layouts()
    shape, coords = pmodel.grid.shape, pmodel.grid.shape.coords(pmodel.grid.rank)
    views = []
    for name, p in pmodel.named_parameters():
        if not p.requires_grad:
            continue
        layout = layouts[name]
        dims = layout.dims + ((),) * (p.dim() - len(layout.dims))
        full = tuple(n * _parts(axes, shape) for n, axes in zip(p.shape, dims))
        offsets = layout.offsets(full, shape, coords) if p.dim() else ()
        views.append(ParamView(name, p, layout, full, offsets,
                               uses_weight_decay(name, tied_output),
                               ShardNoise(tuple(p.shape), full, offsets, p.device)))
    return views


def _parts(axes: tuple[Axis, ...], shape: Any) -> int:
    n = 1
    for a in axes:
        n *= getattr(shape, a)
    return n


def batch_shard(grid: Any, batch_axes: tuple[Axis, ...]) -> tuple[int, int]:
    """(index, count) of this rank's slice of the batch when it is split over `batch_axes`
    (data outer, z inner)."""
    index, count = 0, 1
    for axis in ("data", "z"):
        if axis in batch_axes:
            index, count = index * grid.size(axis) + grid.coord(axis), count * grid.size(axis)
    return index, count


class TrainingMethod(ABC):
    """One way of turning a step's losses into an update of the trainable local shards.

    `name` is the key of its declaration (fourfold.methods), which says when the weights change
    (`spec.update_time`) and the grid axes the step's batch is split over (`batch_axes`). A
    method is built as Method(pmodel, train_config, tied_output, hooks): `hooks` (PhaseHooks)
    are what it calls at its phases' boundaries.
    """

    name: str = ""
    peak_grad_bytes: int = 0  # the most gradient bytes alive at once (train.memory_report)

    def checkpoint_part(self, pmodel: ParallelModel) -> Any:
        """What a checkpoint keeps of this method (CheckpointManager.register): by default its
        state_dict(), each tensor placed by state_layout (MethodShards)."""
        return MethodShards(self)

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.name)

    @property
    def batch_axes(self) -> tuple[Axis, ...]:
        return self.spec.batch_axes  # type: ignore[return-value]

    def note_gradients(self, pmodel: ParallelModel) -> None:
        """Record the gradient bytes alive now (call where they peak: after backward)."""
        live = sum(p.grad.numel() * p.grad.element_size() for p in pmodel.parameters()
                   if p.grad is not None)
        self.peak_grad_bytes = max(self.peak_grad_bytes, live)

    @abstractmethod
    def step(self, pmodel: ParallelModel, data: StepData, lr: float, guard: StepGuard | None = None
             ) -> StepResult:
        """One training step. Collective: every rank calls it with its own shard of the batch.
        `guard` is asked once, with the step's loss and gradient norm, before an update that
        can still be skipped where the method can skip it (else after it)."""

    @abstractmethod
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The method's state: local tensors by name, and JSON-able facts (no pickle)."""

    @abstractmethod
    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what state_dict() returned, or this rank's shards of it on another grid
        (for the tensors state_layout places)."""

    def state_layout(self, key: str) -> Layout | None:
        """Where state tensor `key` of state_dict() lies in a global tensor (a checkpoint then
        reshards it to any grid); None: only the grid that saved it can read it back."""
        return None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        tensors, _ = self.state_dict()
        return sum(t.numel() * t.element_size() for t in tensors.values())


class MethodShards:
    """A training method's state as a sharded checkpoint part (checkpoint.ShardedStateful):
    each tensor a shard of the global tensor the method's state_layout names (any grid reads
    it back), JSON for the rest."""

    def __init__(self, method: TrainingMethod) -> None:
        self.method = method

    def describe(self) -> str:
        return f"train.optimizer = {self.method.name!r}"

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.method.state_dict()

    def layout_of(self, key: str) -> Layout | None:
        return self.method.state_layout(key)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.method.load_state_dict(tensors, meta)


def on_final_gradients(pmodel: ParallelModel, views: list[ParamView],
                       hook: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """Call `hook(param)` the moment each view's gradient is final for the step: on a grid
    after its z reduce-scatter and data all-reduce (Engine.set_grad_ready_hook), on one process
    when autograd has accumulated it (each micro-step's backward). The hook may free it with
    what this returns, `release(param)`, once it keeps no reference to it: on a grid the
    engine keeps its buffer for a later gradient (Engine.release_grad), else it is dropped."""
    if pmodel.engine is not None:
        pmodel.engine.set_grad_ready_hook(hook)
        return pmodel.engine.release_grad
    for v in views:
        v.param.register_post_accumulate_grad_hook(hook)
    return _drop_grad


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None


def arm_on_last_micro_step(data: StepData, arm: Callable[[bool], None]) -> StepData:
    """`data` that calls arm(True) as its last micro-step's loss comes and arm(False) as the
    others' do, for a hand-off hook (on_final_gradients): on one process the hook runs after
    every micro-step's backward, and only their sum is the step's gradient."""
    def losses() -> Iterator[torch.Tensor]:
        for i, loss in enumerate(data.losses()):
            arm(i == data.micro_steps - 1)
            yield loss

    return StepData(data.micro_steps, losses)


def live_grad_bytes(views: list[ParamView]) -> int:
    return sum(v.param.grad.numel() * v.param.grad.element_size()
               for v in views if v.param.grad is not None)


def shard_norm_sq(view: ParamView, grad: torch.Tensor, shape: Any) -> torch.Tensor:
    """This shard's part of its full tensor's squared gradient norm (float64): elements held by
    several ranks are counted once (as ParallelModel.clip_grad_norm_), so a sum over the tensor
    axes is the full tensor's. In blocks of CHUNK_ELEMENTS: a float64 copy of the whole
    gradient would be twice its size (the embedding's: more than the selected gradients)."""
    flat = grad.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        total += flat[start:start + CHUNK_ELEMENTS].double().pow_(2).sum()
    return total / view.layout.replicas(shape)


def check_meta(meta: dict[str, Any], kind: str) -> None:
    if meta.get("kind") != kind:
        raise ValueError(f"optimizer state is for {meta.get('kind')!r}, not {kind!r}")
    json.dumps(meta)  # JSON only: nothing is unpickled on load


def flatten_state(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-parameter state {name: {field: tensor}} as the flat {"name/field": tensor} that
    checkpoints hold."""
    return {f"{name}/{key}": t for name, s in state.items() for key, t in s.items()}


def unflatten_state(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """flatten_state's inverse, on copies (the loaded tensors belong to the checkpoint)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, field = key.rsplit("/", 1)
        state.setdefault(name, {})[field] = t.clone()
    return state


def padded_dims(view: ParamView) -> tuple[tuple[Axis, ...], ...]:
    """The axes that split each dim of a shard (one entry per dim, () for unsplit ones)."""
    dims = view.layout.dims
    return dims + ((),) * (view.param.dim() - len(dims))


class PerParameterState:
    """The checkpoint state of a method that keeps {parameter name: {field: tensor}} and a
    step count (AdaLomo, GaLore): put it before TrainingMethod among the bases. The method's
    field_layout() says where each field's shard lies in its global tensor."""

    name: str
    views: list[ParamView]
    state: dict[str, dict[str, torch.Tensor]]
    steps_done: int

    def field_layout(self, view: ParamView, field: str) -> Layout | None:
        return None

    def state_layout(self, key: str) -> Layout | None:
        name, field = key.rsplit("/", 1)
        view = next((v for v in self.views if v.name == name), None)
        return None if view is None else self.field_layout(view, field)

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return flatten_state(self.state), {"kind": self.name, "steps_done": self.steps_done}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        check_meta(meta, self.name)
        self.steps_done = int(meta["steps_done"])
        # a checkpoint's tensors arrive on the CPU; the state lives with its parameter
        devices = {v.name: v.param.device for v in self.views}
        self.state = {name: {field: t.to(devices.get(name, t.device)) for field, t in s.items()}
                      for name, s in unflatten_state(tensors).items()}


def backward_pass(pmodel: ParallelModel, data: StepData,
                  after_forward: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward and backward over the step's micro-batches, the data all-reduce on the last one
    only: the one micro-batch loop of every method with a backward. Returns this rank's summed
    loss (float64, on the device: nothing waits for the host). `after_forward` runs between
    each micro-step's forward and its backward."""
    total: torch.Tensor | None = None
    for i, loss in enumerate(data.losses()):
        pmodel.set_requires_gradient_sync(i == data.micro_steps - 1)
        if after_forward is not None:
            after_forward()
        loss.backward()
        pmodel.finish_backward()
        value = loss.detach().double()
        total = value if total is None else total + value
    assert total is not None, "a step of no micro-batches"
    return total


def reduce_loss(pmodel: ParallelModel, local: torch.Tensor) -> float:
    """A loss summed over the batch axes (data and z): only a scalar crosses them."""
    return float(pmodel.reduce_over_batch(local.detach().double()))
