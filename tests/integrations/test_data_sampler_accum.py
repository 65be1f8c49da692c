"""``BalancedBatchSampler`` with gradient accumulation and padded costs: every example once per
epoch, one plan on every rank, every micro-batch slot balanced, no empty micro-batch, and the
reported costs against a float64 reference computed here from the yielded micro-batches."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.integrations.data import BalancedBatchSampler

BETA = 1.0 / (6 * 4096)


def _reference_cost(lengths: np.ndarray, policy: str, alpha: float, beta: float) -> float:
    """Cost of one micro-batch, float64, straight from the definition."""
    l = lengths.astype(np.float64)
    if l.size == 0:
        return 0.0
    if policy == "sum":
        return float(l.sum())
    if policy == "quadratic":
        return float(alpha * l.sum() + beta * (l * l).sum())
    m = float(l.max())
    h = m if policy == "padded" else alpha * m + beta * m * m
    return float(l.size * h)


lengths_st = st.lists(
    st.one_of(st.integers(0, 40), st.integers(0, 3000), st.sampled_from([0, 1, 50000])),
    min_size=1,
    max_size=160,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    batch_size=st.integers(1, 5),
    world=st.integers(1, 5),
    g=st.integers(1, 4),
    padding=st.booleans(),
    cost=st.sampled_from(["sum", "quadratic"]),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_properties(lengths, batch_size, world, g, padding, cost, drop_last, epoch):
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    kw = dict(padding=padding, cost=cost, drop_last=drop_last, seed=3, beta=BETA)
    if drop_last and n < batch_size * world * g:
        with pytest.raises(ValueError, match="smaller than one optimizer step"):
            BalancedBatchSampler(lengths, batch_size, world, 0, grad_accum=g, **kw)
        return
    samplers = [BalancedBatchSampler(lengths, batch_size, world, r, grad_accum=g, **kw) for r in range(world)]
    first = samplers[0].plan_epoch()  # cached for epoch 0: the cache must follow set_epoch
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    for s, got in zip(samplers, per_rank):
        assert len(got) == len(s) == s.num_steps * g, "len() counts micro-batches"
    steps = [[per_rank[r][i * g : (i + 1) * g] for r in range(world)] for i in range(samplers[0].num_steps)]
    if epoch == 0:
        assert samplers[0].plan_epoch() is first
    plans = [s.plan_epoch() for s in samplers]
    for p in plans[1:]:  # identical plans on every rank
        for name in ("indices", "rank", "micro", "costs"):
            assert np.array_equal(getattr(p, name), getattr(plans[0], name))
    plan = plans[0]
    policy, alpha, beta = samplers[0].policy, samplers[0].alpha, samplers[0].beta
    seen = Counter()
    for si, step in enumerate(steps):
        flat = [i for rank_batches in step for mb in rank_batches for i in mb]
        assert sorted(flat) == sorted(plan.indices[si].tolist()), "a step is its examples, split"
        seen.update(flat)
        w = lengths[plan.indices[si]].astype(np.float64)
        for r in range(world):
            for k in range(g):
                mb = step[r][k]
                assert mb, "no micro-batch is empty (every step has >= world * grad_accum examples)"
                ref = _reference_cost(lengths[mb], policy, alpha, beta)
                assert plan.costs[si, k, r] == pytest.approx(ref, rel=1e-9, abs=1e-9)
        if policy in ("sum", "quadratic"):  # list-scheduling bound of every slot's split
            item = w if policy == "sum" else alpha * w + beta * w * w
            assert plan.step_times[si] <= item.sum() / world + g * item.max() + 1e-6
    total = samplers[0].total_size
    assert sum(seen.values()) == total
    if drop_last:
        assert max(seen.values()) == 1
    else:
        assert set(seen) == set(range(n)) and sum(c - 1 for c in seen.values()) == total - n


def _skewed(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.lognormal(6.5, 1.0, n)).astype(np.int64) + 1


def test_slots_and_totals_balanced_packed():
    lengths = _skewed(8 * 8 * 4 * 30, 1)
    world, bs, g = 8, 8, 4
    s = BalancedBatchSampler(lengths, bs, world, 0, grad_accum=g, beta=BETA)
    plan = s.plan_epoch()
    w = lengths[plan.indices].astype(np.float64)
    w = w + BETA * w * w
    bound = np.maximum(w.sum(1) / world, w.max(1))  # no split of a step beats this
    assert np.mean(plan.step_times / bound) < 1.01
    slot = plan.costs.max(axis=2) / plan.costs.mean(axis=2)
    assert np.median(slot) < 1.01, "every micro-batch slot balanced across ranks"
    totals = plan.costs.sum(axis=1)
    assert np.median(totals.max(1) / totals.mean(1)) < 1.01, "and the step totals"
    # one balanced step per micro-batch with no notion of the step: clearly worse per step
    even = w.reshape(-1, world, g, bs).sum(-1).max(1).sum(1)
    assert np.mean(plan.step_times / even) < 0.8


def test_padded_never_empty_and_beats_packed_plans_on_padded_cost():
    lengths = _skewed(8 * 4 * 4 * 40, 2)
    world, bs, g = 8, 4, 4
    padded = BalancedBatchSampler(lengths, bs, world, 3, grad_accum=g, padding=True, beta=BETA)
    packed = BalancedBatchSampler(lengths, bs, world, 3, grad_accum=g, beta=BETA)
    assert padded.policy == "padded_quadratic"
    assert all(len(mb) > 0 for mb in padded)
    pp, qp = padded.plan_epoch(), packed.plan_epoch()

    def padded_time(plan):
        t = np.zeros(plan.costs.shape)
        for s in range(plan.indices.shape[0]):
            for k in range(g):
                for r in range(world):
                    mb = plan.indices[s][(plan.rank[s] == r) & (plan.micro[s] == k)]
                    t[s, k, r] = _reference_cost(lengths[mb], "padded_quadratic", 1.0, BETA)
        return t.max(axis=2).sum(axis=1)

    assert np.allclose(padded_time(pp), pp.step_times)
    assert np.mean(pp.step_times / padded_time(qp)) < 0.9
    # memory: no micro-batch pads to more tokens than the step's costliest slot level allows
    assert pp.costs.max() <= pp.step_times.max() + 1e-9


def test_grad_accum_one_is_one_micro_batch_per_step_and_dataloader():
    import torch

    lengths = _skewed(100, 3)
    s = BalancedBatchSampler(lengths, 3, 2, 1, grad_accum=2, padding=True)
    assert len(s) == 2 * s.num_steps
    loader = torch.utils.data.DataLoader(torch.arange(100), batch_sampler=s)
    assert [b.tolist() for b in loader] == list(s)
    assert set(s.stats) == {"llm", "cost", "micro_cost", "cost_before", "micro_cost_before"}


@pytest.mark.parametrize("padding", [False, True], ids=["packed", "padded"])
def test_stats_before_are_the_steps_dealt_as_sampled(padding):
    """``cost_before`` / ``micro_cost_before``: the step's examples dealt as ``DistributedSampler``
    and a plain loader deal them (example ``p`` of the step to rank ``p % world``, micro-batch
    ``(p // world) // batch``), priced here from the lengths; ``cost``: the plan's own."""
    rng = np.random.default_rng(9)
    lengths = rng.integers(1, 400, size=96)
    world, batch, g, beta = 4, 3, 2, 0.001
    s = BalancedBatchSampler(lengths, batch, world, 0, grad_accum=g, padding=padding, beta=beta, seed=5)
    list(s)
    plan = s.plan_epoch()

    def cost(ls):
        ls = np.asarray(ls, dtype=np.float64)
        if not ls.size:
            return 0.0
        h = lambda x: x + beta * x * x
        return ls.size * h(ls.max()) if padding else float(h(ls).sum())

    def ratio(load):
        return load.max() / load.mean()

    for step, got in enumerate(s.epoch_stats):
        idx = plan.indices[step]
        dealt = np.zeros((g, world))
        for k in range(g):
            for r in range(world):
                members = [
                    int(idx[p]) for p in range(idx.size) if p % world == r and (p // world) // batch == k
                ]
                dealt[k, r] = cost(lengths[members])
        assert got["cost_before"] == pytest.approx(ratio(dealt.sum(axis=0)), rel=1e-9)
        assert got["micro_cost_before"] == pytest.approx(max(ratio(dealt[k]) for k in range(g)), rel=1e-9)
        mine = np.zeros(world)
        for r in range(world):
            mine[r] = sum(
                cost(lengths[idx[(plan.rank[step] == r) & (plan.micro[step] == k)]]) for k in range(g)
            )
        assert got["cost"] == pytest.approx(ratio(mine), rel=1e-9)


class _Draw:
    """An ``order`` as ``balance_trainer(order="trainer")`` builds one: the epoch's whole steps in
    sampling order, ``steps = (whole steps, micro-batches of the partial last one)`` and the partial
    step's micro-batches of every rank."""

    def __init__(self, draw: list[int], tail: list[list[list[int]]], steps: int):
        self.draw, self._tail = draw, tail
        self.steps = (steps, len(tail[0]))

    def __call__(self, epoch):
        return np.asarray(self.draw)

    def tail(self, epoch):
        return self._tail


@pytest.mark.parametrize("partial", [False, True], ids=["whole_steps", "a_partial_last_step"])
def test_a_given_order_keeps_every_steps_examples_and_one_stats_entry_a_step(partial):
    """With ``order``, every step holds exactly the examples the order gives it (only their split
    over ranks and micro-batches changes), a partial last step is yielded as drawn, and the epoch's
    stats hold one entry per step the loader yields: none for a partial step that is not there."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, size=40)
    world, batch, g = 2, 2, 2
    step = world * batch * g
    draw = rng.permutation(40)[: 3 * step].tolist()
    tail = [[[int(draw[0]), 31]], [[32, 33]]] if partial else [[], []]
    yielded = {}
    for rank in range(world):
        s = BalancedBatchSampler(lengths, batch, world, rank, grad_accum=g, order=_Draw(draw, tail, 3))
        got = list(s)
        assert len(got) == len(s) == 3 * g + (1 if partial else 0)
        assert len(s.epoch_stats) == 3 + (1 if partial else 0)
        yielded[rank] = got
    for k in range(3):  # step k: both ranks' micro-batches together are the order's step k
        mine = sorted(i for r in range(world) for mb in yielded[r][k * g : (k + 1) * g] for i in mb)
        assert mine == sorted(draw[k * step : (k + 1) * step])
    if partial:
        assert [yielded[r][-1] for r in range(world)] == [tail[r][0] for r in range(world)]


def test_a_given_order_is_refused_by_name():
    lengths = np.arange(1, 21)
    with pytest.raises(TypeError, match="order must be callable"):
        BalancedBatchSampler(lengths, 2, 2, 0, order=[1, 2, 3])
    for bad, match in (
        (lambda e: np.array([0, 1, 2, 40]), "outside the dataset"),
        (lambda e: np.array([[0, 1], [2, 3]]), "1-D list of dataset indices"),
        (lambda e: np.array([0, 1]), "less than one step"),
    ):
        with pytest.raises(ValueError, match=match):
            list(BalancedBatchSampler(lengths, 2, 2, 0, order=bad))
    liar = _Draw(list(range(8)), [[], []], 3)  # 2 whole steps of 4, its steps say 3
    with pytest.raises(ValueError, match="its steps said 3"):
        list(BalancedBatchSampler(lengths, 2, 2, 0, order=liar))
