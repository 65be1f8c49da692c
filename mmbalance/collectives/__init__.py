"""Everything that talks between ranks (``mmbalance.collectives``).

* batch movement: :func:`gather_lengths`, :func:`rebalance`, the multi-phase :class:`Orchestrator`
  (with :class:`PhaseSpec`, the per-phase cost model);
* context parallelism: :func:`cp_shard`, :func:`ring_attention`, :func:`cp_unshard`, :class:`GroupPool`;
* tensor parallelism: :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`,
  :class:`ColumnParallelLinear`, :class:`RowParallelLinear`;
* :class:`RankMismatchError`, what every entry point raises on every rank when ranks disagree;
* :func:`shutdown`, the end of a distributed run in an order that cannot hang (instead of
  ``dist.destroy_process_group()``; see ``collectives.teardown``).

Everything else stays importable from its module (``collectives.alltoall.route_of``,
``collectives.overlap_plan.ShardLayout``, ``collectives.broadcast.broadcast_from_leader``, ...).
"""

from .agreement import RankMismatchError

# Names that were exported here before; importable as they were, no longer in __all__.
from .alltoall import Route, gather_lengths, rebalance, route_of, verify_plan  # noqa: E402, F401, I001
from .broadcast import broadcast_from_leader  # noqa: E402, F401
from .group_pool import GroupPool
from .orchestrator import (
    Orchestrator,
    PhaseSpec,
    StepPlan,
    connector_lengths,  # noqa: E402, F401
)
from .overlap import all_gather_matmul, matmul_reduce_scatter
from .overlap_plan import OverlapCostModel, ShardLayout, choose_chunks, exchange_shard_sizes  # noqa: E402, F401
from .ring import RingPlan, cp_shard, cp_unshard, ring_attention, ring_plan  # noqa: E402, F401
from .teardown import shutdown
from .tp_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    sequence_shards,  # noqa: E402, F401
)

__all__ = [
    "ColumnParallelLinear",
    "GroupPool",
    "Orchestrator",
    "PhaseSpec",
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
