"""The papers' own algorithms, kept as baselines: every planner of :mod:`mmbalance.balancing` is
tested and benchmarked against them (never worse on any input, and usually better).

=========================== ======================================================================
``paper_algorithm``         OrchMLLM's post-balancing algorithms 1, 2, 4 and 5 (section 5.1)
``paper_cp_schedule``       DHP's dynamic CP groups: best-fit-decreasing packing + its 2-D DP
``paper_partition``         OmniBal's balanced model partitioning
``paper_intra_reorder``     DistTrain's intra-microbatch reordering
``paper_inter_reorder``     DistTrain's inter-microbatch reordering
``paper_reorder``           both reorderings, as DistTrain applies them
=========================== ======================================================================

The papers, with their arXiv ids, are listed in DESIGN.md.
"""

from .cp_schedule import paper_cp_schedule
from .partition import paper_partition
from .post_balance import paper_algorithm
from .reorder import paper_inter_reorder, paper_intra_reorder, paper_reorder

__all__ = [
    "paper_algorithm",
    "paper_cp_schedule",
    "paper_inter_reorder",
    "paper_intra_reorder",
    "paper_partition",
    "paper_reorder",
]
