"""The planner's model of each training method: one module per method's module of
fourfold.train.methods, each registered with its method's declaration (fourfold.methods)."""

from fourfold.plan.methods.base import MethodCost, MethodModel, MethodState, method_model

__all__ = ["MethodCost", "MethodModel", "MethodState", "method_model"]
