"""The training methods fourfold knows, each declared once under its key (train.optimizer).

A method is three modules, one per layer, tied together by its `MethodSpec` (methods/base.py):
- here, its declaration: its options (the `[train.method]` section, a dataclass with its
  paper's defaults and its own checks), the weight decay train.weight_decay = "auto" gives
  it, when it updates, the axes its batch is split over and what it asks of the engine (the
  blocked loss, training a subset of the parameters);
- fourfold.train.methods.<module>: how it trains, a TrainingMethod (torch);
- fourfold.plan.methods.<module>: what it costs, its planner model (memory and step time).

The declarations live apart from both halves, and import neither torch nor the trainer nor the
planner, so that a config (and a --set) is checked, each method's options included, before
torch is imported, and so that the planner reads the same declaration as the trainer without
importing the trainer. Every module of this package but base declares `METHODS`, a tuple of
MethodSpec: adding a method is adding its module here, its TrainingMethod and its planner
model; `register_method` adds one from elsewhere (a plugin, a test).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from fourfold.errors import ConfigError
from fourfold.methods.base import MethodOptions, MethodSpec, UpdateTime


def _builtin() -> dict[str, MethodSpec]:
    found: dict[str, MethodSpec] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name == "base":
            continue
        for spec in importlib.import_module(f"{__name__}.{module.name}").METHODS:
            found[spec.name] = spec
    return found


# The registry: the built-in methods, and those register_method adds. Only ever added to (a
# key is never replaced), so a name means one method for the life of the process.
_REGISTRY: dict[str, MethodSpec] = _builtin()
BUILTIN_METHODS: tuple[str, ...] = tuple(_REGISTRY)  # those that come with fourfold


def register_method(spec: MethodSpec) -> None:
    """Make `spec` known under spec.name: train.optimizer may then name it, in this process
    (every rank of a job registers it before it loads its config)."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"a training method named {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec


def method_names() -> tuple[str, ...]:
    """Every known train.optimizer, the built-in ones first."""
    return tuple(_REGISTRY)


def method_spec(name: str) -> MethodSpec:
    """The declaration of train.optimizer = `name`; a one-line ConfigError for an unknown one."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"train.optimizer = {name!r}: choose one of {', '.join(_REGISTRY)}")
    return spec


def method_options(name: str, **values: Any) -> MethodOptions:
    """The options of method `name` with `values` set and the rest at their defaults (for
    code that builds a TrainConfig itself: TrainConfig(optimizer=name, method=...))."""
    return method_spec(name).options(**values)


__all__ = ["MethodOptions", "MethodSpec", "UpdateTime", "method_names", "method_options",
           "method_spec", "register_method"]
