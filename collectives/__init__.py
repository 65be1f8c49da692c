"""Everything that talks between ranks (``mmbalance.collectives``)."""

# All-gather/GEMM overlap for tensor parallelism (issue 6).
# All-to-all batch communicator and orchestrator (issue 4).
from .alltoall import Route, gather_lengths, rebalance, route_of, verify_plan  # noqa: F401, E402
from .group_pool import GroupPool  # noqa: F401, E402
from .orchestrator import Orchestrator, PhaseSpec, StepPlan, broadcast_from_leader, connector_lengths  # noqa: F401, E402
from .overlap import all_gather_matmul, matmul_reduce_scatter  # noqa: F401
from .overlap_plan import OverlapCostModel, ShardLayout, choose_chunks, exchange_shard_sizes  # noqa: F401

# Ring attention for context parallelism of any degree (issue 5).
from .ring import RingPlan, cp_shard, cp_unshard, ring_attention, ring_plan  # noqa: F401, E402
from .tp_linear import ColumnParallelLinear, RowParallelLinear, sequence_shards  # noqa: F401
