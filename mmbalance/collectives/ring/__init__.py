"""Ring attention: context parallelism of any degree over packed varlen sequences.

Read ``plan.py`` (which tokens of each sequence a CP rank holds, in the zigzag or contiguous
layout: host arithmetic, the same on every rank) and then ``attention.py`` (``cp_shard`` and
``cp_unshard``, and the ring itself: key/value shards passed around the group while each step's
block computes, forward and backward).
"""

from .attention import cp_shard, cp_unshard, ring_attention

__all__ = ["cp_shard", "cp_unshard", "ring_attention"]
