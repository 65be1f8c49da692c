"""``BalancedBatchSampler(equal_counts=True)``: every micro-batch holds exactly ``batch_size``
examples (DPO's pairs: a loss that is a mean over each micro-batch keeps its value), every example
once per epoch, the same plan on every rank, the reported costs recomputed here in float64 from
the yielded micro-batches, and neither the step's nor any slot's max/mean ever worse than the
examples dealt as sampled; on skewed lengths, clearly better."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing.accum import plan_equal_counts, sampled_costs
from mmbalance.integrations.data import BalancedBatchSampler

BETA = 1.0 / (6 * 4096)


def _cost(lengths: np.ndarray, padded: bool, quadratic: bool) -> float:
    """One micro-batch's cost, float64, from the definition."""
    l = lengths.astype(np.float64)
    if l.size == 0:
        return 0.0
    h = (lambda x: x + BETA * x * x) if quadratic else (lambda x: x)
    return float(l.size * h(l.max())) if padded else float(h(l).sum())


def _ratios(costs: np.ndarray) -> tuple[float, float]:
    """(step, worst slot) max/mean over ranks of ``[G, ranks]`` costs."""

    def r(x):
        m = x.mean(axis=-1)
        return np.where(m > 0, x.max(axis=-1) / np.where(m > 0, m, 1), 1.0)

    return float(r(costs.sum(axis=0))), float(r(costs).max())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 40), st.integers(0, 3000), st.just(0)), min_size=1, max_size=120
    ),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    g=st.integers(1, 3),
    padding=st.booleans(),
    cost=st.sampled_from(["sum", "quadratic"]),
    epoch=st.integers(0, 2),
)
def test_properties(lengths, batch_size, world, g, padding, cost, epoch):
    lengths = np.asarray(lengths, dtype=np.int64)
    kw = dict(padding=padding, cost=cost, seed=5, beta=BETA, alpha=1.0, grad_accum=g, equal_counts=True)
    samplers = [BalancedBatchSampler(lengths, batch_size, world, r, **kw) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    out = [list(s) for s in samplers]
    plan = samplers[0].plan_epoch()
    assert all(len(o) == samplers[0].num_steps * g for o in out)
    assert all(len(mb) == batch_size for o in out for mb in o)  # the trainer's own count, always
    seen = Counter(i for o in out for mb in o for i in mb)
    assert sorted(seen.elements()) == sorted(plan.indices.reshape(-1).tolist())
    assert set(seen) == set(range(lengths.size))  # (a padded epoch repeats its first examples)
    if lengths.size % samplers[0].step_size == 0:
        assert max(seen.values()) == 1
    for s in range(samplers[0].num_steps):
        got = np.array([
            [_cost(lengths[out[r][s * g + k]], padding, cost == "quadratic") for r in range(world)]
            for k in range(g)
        ])  # fmt: skip
        np.testing.assert_allclose(plan.costs[s], got, rtol=1e-12, atol=1e-9)
        st_ = samplers[0].epoch_stats[s]
        assert (
            st_["cost"] <= st_["cost_before"] + 1e-12
            and st_["micro_cost"] <= st_["micro_cost_before"] + 1e-12
        )


@pytest.mark.parametrize("padding", [False, True])
def test_skewed_steps_are_balanced_much_better_than_drawn(padding):
    rng = np.random.default_rng(0)
    lengths = (1 + rng.random(960) ** 3 * 600).astype(np.int64)
    s = BalancedBatchSampler(lengths, 4, 8, 0, grad_accum=3, padding=padding, equal_counts=True, seed=1)
    list(s)
    before = np.mean([x["cost_before"] for x in s.epoch_stats])
    after = np.mean([x["cost"] for x in s.epoch_stats])
    assert after < before - 0.1, (before, after)
    assert np.mean([x["micro_cost"] for x in s.epoch_stats]) < np.mean(
        [x["micro_cost_before"] for x in s.epoch_stats]
    )


def test_a_plan_worse_than_the_draw_keeps_the_draw():
    # one step, two ranks, one pair each: any plan is a relabelling of the draw, never worse
    rank, micro, costs = plan_equal_counts([5, 5], 1, 2, 2, 1, "sum", 1.0, 0.0, False)
    drawn = sampled_costs([5, 5], 1, 2, 2, 1, "sum", 1.0, 0.0)
    assert _ratios(costs[0]) <= _ratios(drawn[0])
    assert sorted(zip(rank.tolist(), micro.tolist(), strict=True)) == [(0, 0), (1, 0)]


def test_bad_input_is_refused_by_name():
    with pytest.raises(TypeError, match="equal_counts"):
        BalancedBatchSampler([1, 2], 1, 2, 0, equal_counts="yes")
    with pytest.raises(ValueError, match="lengths"):
        plan_equal_counts([1, 2, 3], 1, 3, 2, 1, "sum", 1.0, 0.0, False)
    with pytest.raises(ValueError, match="policy"):
        plan_equal_counts([1, 2], 1, 2, 2, 1, "cubic", 1.0, 0.0, False)
