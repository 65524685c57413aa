"""The planner: hardware catalog, performance and memory models, configuration search, scaling
laws. It reads model configs and grid shapes, and never imports the trainer."""

from fourfold.plan.errors import PlanError
from fourfold.plan.catalog import DEVICES, MACHINE_NAMES, Device, Machine, Network
from fourfold.plan.machine_file import load_machine
from fourfold.plan.memory import MemoryBreakdown, Precision, predict_memory, predict_param_memory
from fourfold.plan.perf import Overlap, StepPrediction, predict_step
from fourfold.plan.schedule import Collective, collective_schedule, predict_comm_bytes
from fourfold.plan.search import Candidate, Plan, choose_grid, grid_shapes, plan

__all__ = ["DEVICES", "MACHINE_NAMES", "Candidate", "Collective", "Device", "Machine",
           "MemoryBreakdown", "Network", "Overlap", "Plan", "PlanError", "Precision",
           "StepPrediction", "choose_grid", "collective_schedule", "grid_shapes", "load_machine",
           "plan", "predict_comm_bytes", "predict_memory", "predict_param_memory",
           "predict_step"]
