"""Everything that talks between ranks (``mmbalance.collectives``).

* batch movement: :func:`gather_lengths`, :func:`rebalance`, the multi-phase :class:`Orchestrator`
  (its phases are :class:`mmbalance.balancing.PhaseSpec`);
* context parallelism: :func:`cp_shard`, :func:`ring_attention`, :func:`cp_unshard`, :class:`GroupPool`;
* tensor parallelism: :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`,
  :class:`ColumnParallelLinear`, :class:`RowParallelLinear`;
* :class:`RankMismatchError`, what every entry point raises on every rank when ranks disagree;
* :func:`shutdown`, the end of a distributed run in an order that cannot hang (instead of
  ``dist.destroy_process_group()``; see ``collectives.teardown``).

Three rooms, by what they move: ``exchange/`` (examples between ranks by a plan), ``ring/`` (key and
value shards around a context-parallel group) and ``overlap/`` (tensor-parallel activations, sliced
behind their GEMMs), each read through its ``__init__``. Below them the plumbing every room uses:
``group.py`` (which group, this rank's place in it), ``inflight.py`` (collectives that leave nothing
behind), ``agreement.py`` (the entry protocol), ``pool.py`` (groups by their ranks) and
``teardown.py`` (the end of a run).

Everything else is importable from its module only (``collectives.exchange.alltoall.verify_plan``,
``collectives.ring.plan.ring_plan``, ``collectives.overlap.plan.ShardLayout``,
``collectives.exchange.broadcast.broadcast_from_leader``, ...).
"""

from .agreement import RankMismatchError
from .exchange import Orchestrator, StepPlan, gather_lengths, rebalance
from .overlap import ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_reduce_scatter
from .pool import GroupPool
from .ring import cp_shard, cp_unshard, ring_attention
from .teardown import shutdown

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
