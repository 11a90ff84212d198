"""Tensor parallelism across processes on one host: rank 0 is the engine's own process;
it spawns the other ranks (astream.parallel.worker), which only run steps.

The weights' split and the collectives inside a step are the model's
(astream.models.tensor_parallel); this package sets up the process group and carries
each step's inputs from rank 0 to the others.
"""

from astream.parallel.workers import WorkerGroup

__all__ = ["WorkerGroup"]
