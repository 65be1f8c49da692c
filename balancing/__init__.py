"""Planners (``mmbalance.balancing``): numpy only, no torch, safe in data-loader workers.

>>> from mmbalance.balancing import post_balance
>>> plan = post_balance([7, 1, 3, 5, 2, 2], num_ranks=2)
>>> plan.costs.tolist()
[10.0, 10.0]
"""

from .node_perm import node_wise_permutation
from .plan import DEFAULT_BETA, POLICIES, Plan
from .post_balance import lower_bound, paper_algorithm, post_balance

__all__ = [
    "DEFAULT_BETA",
    "POLICIES",
    "Plan",
    "lower_bound",
    "node_wise_permutation",
    "paper_algorithm",
    "post_balance",
]

# Cost models, dynamic CP groups, microbatch reordering, ISF batching, pipeline partition and
# resource allocation.
from .cost_model import CostModel, FitReport, Measurement  # noqa: E402
from .cp_schedule import CPGroup, CPSchedule, cp_schedule, paper_cp_schedule  # noqa: E402
from .isf import Batches, BatchStats, batch_stats, dist_ratio, isf_batches, isf_limits, pad_ratio  # noqa: E402
from .partition import (  # noqa: E402
    Allocation,
    ModuleConfig,
    ModuleCost,
    PartitionCandidate,
    PartitionPlan,
    allocate_resources,
    balanced_partition,
    paper_partition,
)
from .reorder import (  # noqa: E402
    ReorderPlan,
    inter_reorder,
    intra_reorder,
    paper_inter_reorder,
    paper_intra_reorder,
    paper_reorder,
    reorder,
    simulate_1f1b,
)

__all__ += [
    "Allocation",
    "BatchStats",
    "Batches",
    "CPGroup",
    "CPSchedule",
    "CostModel",
    "FitReport",
    "Measurement",
    "ModuleConfig",
    "ModuleCost",
    "PartitionCandidate",
    "PartitionPlan",
    "ReorderPlan",
    "allocate_resources",
    "balanced_partition",
    "batch_stats",
    "cp_schedule",
    "dist_ratio",
    "inter_reorder",
    "intra_reorder",
    "isf_batches",
    "isf_limits",
    "pad_ratio",
    "paper_cp_schedule",
    "paper_inter_reorder",
    "paper_intra_reorder",
    "paper_partition",
    "paper_reorder",
    "reorder",
    "simulate_1f1b",
]


def __getattr__(name):
    # The profiler runs torch, so it lives in mmbalance.collectives and loads on first use only:
    # importing the planners (also with ``import *``: it is not in __all__) stays torch-free.
    if name == "profile":
        from mmbalance.collectives.profile import profile

        return profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
