"""The 4D engine: data parallelism times a 3D parallel matrix multiply over grid axes x, y, z.
It knows nothing about language models beyond the leaf names of the Llama-family plan."""

from fourfold.parallel.comm import CollectiveError, Comm, CommLedger
from fourfold.parallel.grid import (AXES, Axis, Grid, GridError, GridShape, init_distributed,
                                    leave_job)
from fourfold.parallel.layout import REPLICATED, Layout
from fourfold.parallel.parallelize import ParallelModel, parallelize

__all__ = ["AXES", "Axis", "CollectiveError", "Comm", "CommLedger", "Grid", "GridError",
           "GridShape", "Layout", "ParallelModel", "REPLICATED", "init_distributed",
           "leave_job", "parallelize"]
