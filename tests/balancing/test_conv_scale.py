"""The "conv" planner at scale (>= 100k examples), where it keeps fewer candidates: its plans stay
as good as the full candidate set's on the real-data mixture."""

from __future__ import annotations

import numpy as np
import pytest

from mmbalance import _core
from mmbalance.balancing import lower_bound, post_balance
from mmbalance.balancing.datasets import mixture


@pytest.fixture(scope="module")
def sizes():
    return mixture(60 * 2560, 2560)  # 153,600 examples


# (phase, beta) -> makespan / lower bound of the plan every candidate refined gives (measured);
# the bound is loose by up to a few percent here, so each case has its own ceiling
CASES = {
    ("audio", 0.0): 1.0028,
    ("audio", 1e-7): 1.0048,  # the refined LPT candidate wins; unrefined, the runs look better
    ("audio", 1 / 64): 1.0389,
    ("vision", 1e-6): 1.0349,
    ("llm", 1 / 8192): 1.0503,
}


@pytest.mark.parametrize(("phase", "beta"), list(CASES))
def test_conv_at_scale_keeps_its_quality(sizes, phase, beta):
    lengths = sizes.phase(phase)
    d = 2560
    plan = post_balance(lengths, d, "conv", beta=beta)
    ratio = plan.makespan / lower_bound(lengths, d, "conv", beta=beta)
    assert ratio <= CASES[(phase, beta)] * (1 + 1e-4)
    # never worse than the paper's algorithm 5 or LPT on token sums
    for alg in (5, 1):
        other = _core.paper_algorithm(np.ascontiguousarray(lengths, dtype=np.int64), d, alg)
        costs = _core.batch_costs(np.ascontiguousarray(lengths, dtype=np.int64), other, d, 3, 1.0, beta)
        assert plan.makespan <= costs.max()
