"""The rebalancing exchange: examples moved between ranks by a plan's routes.

Read ``alltoall.py`` (the batch communicator: the lengths gathered, payloads moved by one
all-to-all, backward along the inverse plan), ``broadcast.py`` (one rank's batch on every rank of
its group, gradients summed back) and, on top, ``orchestrator.py`` (a step's plans made ahead, in a
background thread, and its moves executed). Everything here stands on the plumbing below the
rooms (``group.py``, ``inflight.py``, ``agreement.py``).
"""

from .alltoall import gather_lengths, rebalance
from .orchestrator import Orchestrator, StepPlan

__all__ = ["Orchestrator", "StepPlan", "gather_lengths", "rebalance"]
