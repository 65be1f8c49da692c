"""Planners (``mmbalance.balancing``): numpy only, no torch, safe in data-loader workers.

>>> from mmbalance.balancing import post_balance
>>> plan = post_balance([7, 1, 3, 5, 2, 2], num_ranks=2)
>>> plan.costs.tolist()
[10.0, 10.0]

The papers' own algorithms, the baselines every planner here is held to, are in
:mod:`mmbalance.balancing.paper`; input validation is :mod:`mmbalance.balancing.validate`. The
profiler that measures a model for :class:`CostModel` runs torch, so it is
``mmbalance.bench.profile``.
"""

from .cost_model import CostModel, FitReport, Measurement
from .cp_schedule import CPGroup, CPSchedule, cp_schedule
from .isf import Batches, BatchStats, batch_stats, dist_ratio, isf_batches, isf_limits, pad_ratio
from .node_perm import node_wise_permutation
from .partition import (
    Allocation,
    ModuleConfig,
    ModuleCost,
    PartitionCandidate,
    PartitionPlan,
    allocate_resources,
    balanced_partition,
)
from .phases import TEXT, PhasePlans, PhaseSpec, connector_lengths, plan_step
from .plan import DEFAULT_BETA, POLICIES, Plan, imbalance
from .post_balance import lower_bound, post_balance
from .reorder import ReorderPlan, inter_reorder, intra_reorder, reorder, simulate_1f1b

__all__ = [
    "DEFAULT_BETA",
    "POLICIES",
    "TEXT",
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
    "PhasePlans",
    "PhaseSpec",
    "Plan",
    "ReorderPlan",
    "allocate_resources",
    "balanced_partition",
    "batch_stats",
    "connector_lengths",
    "cp_schedule",
    "dist_ratio",
    "imbalance",
    "inter_reorder",
    "intra_reorder",
    "isf_batches",
    "isf_limits",
    "lower_bound",
    "node_wise_permutation",
    "pad_ratio",
    "plan_step",
    "post_balance",
    "reorder",
    "simulate_1f1b",
]
