"""Everything that talks between ranks (``mmbalance.collectives``).

* batch movement: :func:`gather_lengths`, :func:`rebalance`, the multi-phase :class:`Orchestrator`;
* context parallelism: :func:`cp_shard`, :func:`ring_attention`, :func:`cp_unshard`, :class:`GroupPool`;
* tensor parallelism: :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`,
  :class:`ColumnParallelLinear`, :class:`RowParallelLinear`.
"""

from .agreement import RankMismatchError
from .alltoall import Route, gather_lengths, rebalance, route_of, verify_plan
from .group_pool import GroupPool
from .orchestrator import Orchestrator, PhaseSpec, StepPlan, broadcast_from_leader, connector_lengths
from .overlap import all_gather_matmul, matmul_reduce_scatter
from .overlap_plan import OverlapCostModel, ShardLayout, choose_chunks, exchange_shard_sizes
from .ring import RingPlan, cp_shard, cp_unshard, ring_attention, ring_plan
from .tp_linear import ColumnParallelLinear, RowParallelLinear, sequence_shards

__all__ = [
    "ColumnParallelLinear",
    "GroupPool",
    "Orchestrator",
    "OverlapCostModel",
    "PhaseSpec",
    "RankMismatchError",
    "RingPlan",
    "Route",
    "RowParallelLinear",
    "ShardLayout",
    "StepPlan",
    "all_gather_matmul",
    "broadcast_from_leader",
    "choose_chunks",
    "connector_lengths",
    "cp_shard",
    "cp_unshard",
    "exchange_shard_sizes",
    "gather_lengths",
    "matmul_reduce_scatter",
    "rebalance",
    "ring_attention",
    "ring_plan",
    "route_of",
    "sequence_shards",
    "verify_plan",
]
