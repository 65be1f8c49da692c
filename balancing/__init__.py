"""Planners (``mmbalance.balancing``): numpy only, no torch, safe in data-loader workers.

>>> from mmbalance.balancing import post_balance
>>> plan = post_balance([7, 1, 3, 5, 2, 2], num_ranks=2)
>>> plan.costs.tolist()
[10.0, 10.0]
"""

from .node_perm import node_wise_permutation
from .plan import POLICIES, Plan
from .post_balance import lower_bound, paper_algorithm, post_balance

__all__ = ["POLICIES", "Plan", "lower_bound", "node_wise_permutation", "paper_algorithm", "post_balance"]
