"""The planners on real data: ``mmbalance bench planners`` (``python -m mmbalance.bench.planners``),
``mmbalance bench sampler`` and ``mmbalance simulate``.

Read ``peers.py`` (the peers, run in an environment of their own), ``schedulers.py`` (the cost
model, CP groups, reordering, ISF and partition planners against the papers' methods) and
``post_balancing.py`` (post-balancing's speed, quality and locality, then the schedulers' tables:
the command); beside them ``sampler.py`` (the batch samplers side by side) and ``simulate.py`` (the
what-if simulator: what balancing gives on your data at your scale).
"""

from .post_balancing import main

__all__ = ["main"]
