"""Everything that talks between ranks (``mmbalance.collectives``).

* batch movement: :func:`gather_lengths`, :func:`rebalance`, the multi-phase :class:`Orchestrator`
  (its phases are :class:`mmbalance.balancing.PhaseSpec`);
* context parallelism: :func:`cp_shard`, :func:`ring_attention`, :func:`cp_unshard`, :class:`GroupPool`;
* tensor parallelism: :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`,
  :class:`ColumnParallelLinear`, :class:`RowParallelLinear`;
* :class:`RankMismatchError`, what every entry point raises on every rank when ranks disagree;
* :func:`shutdown`, the end of a distributed run in an order that cannot hang (instead of
  ``dist.destroy_process_group()``; see ``collectives.teardown``).

Everything else is importable from its module only (``collectives.alltoall.verify_plan``,
``collectives.ring_plan.ring_plan``, ``collectives.overlap_plan.ShardLayout``,
``collectives.broadcast.broadcast_from_leader``, ...).
"""

from .agreement import RankMismatchError
from .alltoall import gather_lengths, rebalance
from .group_pool import GroupPool
from .orchestrator import Orchestrator, StepPlan
from .overlap import all_gather_matmul, matmul_reduce_scatter
from .ring import cp_shard, cp_unshard, ring_attention
from .teardown import shutdown
from .tp_linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "GroupPool",
    "Orchestrator",
    "RankMismatchError",
    "RowParallelLinear",
    "StepPlan",
    "all_gather_matmul",
    "cp_shard",
    "cp_unshard",
    "gather_lengths",
    "matmul_reduce_scatter",
    "rebalance",
    "ring_attention",
    "shutdown",
]
