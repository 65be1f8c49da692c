"""``cp_schedule(..., encoder_seconds=...)``: a group of degree d takes the cost's time plus its
sequences' encoder seconds over d. Checked against plain references: the group times, the greedy
static degrees, an exact optimum by enumeration on small batches, and the lower bound."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmbalance.balancing import CostModel, cp_schedule
from tests.balancing.cp_refs import (
    SETTINGS,
    batches,
    degree_penalty,
    models,
    static_groups,
    transformer_per_sequence,
)


def group_time(cost, lengths, enc, members, d) -> float:
    return cost.time(lengths[members], d) + float(enc[members].sum()) / d


def check(sched, lengths, enc, num_ranks, mem, cost):
    seen = np.concatenate([g.sequences for g in sched]) if len(sched) else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(seen), np.arange(lengths.size))  # every sequence exactly once
    assert sum(g.degree for g in sched) <= num_ranks
    for g in sched:
        assert lengths[g.sequences].sum() <= g.degree * mem
        assert g.time == pytest.approx(
            group_time(cost, lengths, enc, g.sequences, g.degree), rel=1e-9, abs=1e-12
        )
    assert sched.makespan == pytest.approx(max((g.time for g in sched), default=0.0), rel=1e-12)


def static_reference(lengths, enc, num_ranks, mem, cost, c):
    """Static degree c plainly (cp_refs.static_groups) with the share in every group's time."""
    time = lambda g, d: group_time(cost, lengths, enc, np.array(g, dtype=np.int64), d)  # noqa: E731
    groups = static_groups(lengths, num_ranks, mem, cost, c, group_time=time)
    return None if groups is None else max((time(g, c) for g in groups), default=0.0)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1 :]
        yield [[first]] + part


def exact_optimum(lengths, enc, num_ranks, mem, cost):
    """The least makespan over every grouping and every degree vector (small batches only)."""
    best = np.inf
    for part in set_partitions(list(range(lengths.size))):
        if len(part) > num_ranks:
            continue
        idx = [np.array(p, dtype=np.int64) for p in part]
        for degrees in itertools.product(range(1, num_ranks + 1), repeat=len(part)):
            if sum(degrees) > num_ranks or any(lengths[p].sum() > d * mem for p, d in zip(idx, degrees)):
                continue
            best = min(best, max(group_time(cost, lengths, enc, p, d) for p, d in zip(idx, degrees)))
    return best


def encoder_share(draw, lengths, cost):
    """Encoder seconds per sequence, from none to several times the sequence's LLM time."""
    scale = draw(st.sampled_from([0.0, 0.1, 1.0, 5.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    llm = np.array([cost.time([x], 1) for x in lengths.tolist()])
    return scale * llm * rng.random(lengths.size) * (rng.random(lengths.size) < 0.7)


@SETTINGS
@given(batch=batches(), cost=models, data=st.data())
def test_groups_take_the_cost_plus_their_encoder_share_and_beat_every_static_degree(batch, cost, data):
    lengths, num_ranks, mem = batch
    lengths = np.asarray(lengths, dtype=np.int64)
    enc = encoder_share(data.draw, lengths, cost)
    sched = cp_schedule(lengths, num_ranks, mem, cost, encoder_seconds=enc)
    check(sched, lengths, enc, num_ranks, mem, cost)
    statics = [static_reference(lengths, enc, num_ranks, mem, cost, c) for c in range(1, num_ranks + 1)]
    feasible = [s for s in statics if s is not None]
    if feasible:
        assert sched.makespan <= min(feasible) * (1 + 1e-9) + 1e-12
        assert sched.info["static_makespan"] == pytest.approx(min(feasible), rel=1e-9)
    assert sched.makespan >= sched.info["lower_bound"] * (1 - 1e-9) - 1e-12


@SETTINGS
@given(
    lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=5),
    num_ranks=st.integers(1, 4),
    cost=models,
    data=st.data(),
)
def test_lower_bound_and_plan_bracket_the_exact_optimum(lengths, num_ranks, cost, data):
    mem = 1024
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() > num_ranks * mem:
        return
    enc = encoder_share(data.draw, lengths, cost)
    sched = cp_schedule(lengths, num_ranks, mem, cost, encoder_seconds=enc)
    opt = exact_optimum(lengths, enc, num_ranks, mem, cost)
    assert sched.info["lower_bound"] <= opt * (1 + 1e-9) + 1e-12
    assert sched.makespan >= opt * (1 - 1e-9) - 1e-12


def test_the_share_changes_the_plan_where_it_should():
    # two sequences of equal length, one with heavy media: without the share each runs alone on
    # one rank (a ring only costs); with it, the heavy one gets the three other ranks
    cost = CostModel(linear=1.0, ring=1.0)
    lengths = np.array([1000, 1000])
    plain = cp_schedule(lengths, 4, 4096, cost)
    assert sorted((g.degree, g.sequences.tolist()) for g in plain) == [(1, [0]), (1, [1])]
    sched = cp_schedule(lengths, 4, 4096, cost, encoder_seconds=[0.0, 6000.0])
    assert sorted((g.degree, g.sequences.tolist()) for g in sched) == [(1, [0]), (3, [1])]
    # 1000/3 linear + 1000 * 2/3 ring + 6000/3 encoding, against 7000 on one rank
    assert sched.makespan == pytest.approx(3000.0)
    assert sched.makespan == pytest.approx(exact_optimum(lengths, np.array([0.0, 6000.0]), 4, 4096, cost))


def test_zero_share_is_the_plan_without_it():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(7.0, 1.2, 300).astype(np.int64) + 1
    a = cp_schedule(lengths, 64, 16384)
    b = cp_schedule(lengths, 64, 16384, encoder_seconds=np.zeros(lengths.size))
    assert len(a) > 1
    assert [(g.degree, g.ranks, g.sequences.tolist(), g.time) for g in a] == [
        (g.degree, g.ranks, g.sequences.tolist(), g.time) for g in b
    ]
    assert a.info == b.info


@pytest.mark.parametrize("fn", [transformer_per_sequence, degree_penalty], ids=["transformer", "penalty"])
def test_callable_costs_add_the_share_too(fn):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 2400, 40)
    enc = rng.random(40)
    for kind in ("vectorized", "group"):
        if kind == "vectorized":
            cost, group = fn, (lambda ls, d: float(fn(ls, d).sum()))
        else:
            group = cost = lambda ls, d: float(fn(np.asarray(ls, dtype=np.int64), d).sum())
        sched = cp_schedule(lengths, 12, 4096, cost, encoder_seconds=enc)
        for g in sched:
            want = group(lengths[g.sequences], g.degree) + float(enc[g.sequences].sum()) / g.degree
            assert g.time == pytest.approx(want, rel=1e-9)
        assert sorted(np.concatenate([g.sequences for g in sched]).tolist()) == list(range(40))


@pytest.mark.parametrize(
    "enc, err, match",
    [
        ([1.0], ValueError, r"encoder_seconds must be 1-D with 3 entries"),
        ([1.0, -1.0, 0.0], ValueError, r"encoder_seconds\[1\] = -1.0"),
        ([1.0, np.nan, 0.0], ValueError, r"encoder_seconds\[1\]"),
        ([1.0, np.inf, 0.0], ValueError, r"encoder_seconds\[1\]"),
        ("abc", TypeError, "encoder_seconds"),
        (["a", "b", "c"], TypeError, "encoder_seconds"),
        ([[1.0, 2.0, 3.0]], ValueError, "encoder_seconds"),
    ],
)
def test_bad_encoder_seconds_are_refused_by_name(enc, err, match):
    with pytest.raises(err, match=match):
        cp_schedule([100, 200, 300], 4, 1024, encoder_seconds=enc)
    with pytest.raises(err, match=match):
        cp_schedule([100, 200, 300], 4, 1024, transformer_per_sequence, encoder_seconds=enc)
