"""Dynamic CP groups under callable costs: per-sequence (vectorized) and per-group forms against
static degrees and the paper, how often the cost is called, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from mmbalance.balancing import CostModel, cp_schedule
from tests.balancing.cp_refs import (
    SETTINGS,
    PerSequence,
    batches,
    check_valid,
    paper_makespan,
    per_sequence_costs,
    static_groups,
    static_groups_additive,
)


@SETTINGS
@given(batch=batches(), fn=per_sequence_costs)
def test_vectorized_never_worse_than_static_or_paper(batch, fn):
    lengths, num_ranks, mem = batch
    sched = cp_schedule(lengths, num_ranks, mem, fn)
    check_valid(sched, lengths, num_ranks, mem, PerSequence(fn))
    statics = [static_groups_additive(lengths, num_ranks, mem, fn, c) for c in range(1, num_ranks + 1)]
    feasible = [s for s in statics if s is not None]
    if feasible:
        assert sched.makespan <= min(feasible) * (1 + 1e-9) + 1e-12
        assert sched.info["static_makespan"] == pytest.approx(min(feasible), rel=1e-9, abs=1e-12)
    paper = paper_makespan(lengths, num_ranks, mem, PerSequence(fn))
    if paper is not None:
        assert sched.makespan <= paper * (1 + 1e-9) + 1e-12
    assert sched.makespan >= sched.info["lower_bound"] * (1 - 1e-9) - 1e-12


@SETTINGS
@given(batch=batches(), fn=per_sequence_costs)
def test_group_callable_never_worse_than_static(batch, fn):
    # A per-group callable: static degrees are grouped under the form fitted to it, timed by it.
    from mmbalance.balancing.cp_schedule import _probe_fit

    lengths, num_ranks, mem = batch

    def cost(ls, d):
        return float(fn(ls, d).sum()) + 0.01 * (d > 1)  # a per-group constant too

    sched = cp_schedule(lengths, num_ranks, mem, cost)
    if not lengths:
        return
    proxy = _probe_fit(cost, np.asarray(lengths, dtype=np.int64), num_ranks, mem)
    statics = []
    for c in range(1, num_ranks + 1):
        groups = static_groups(lengths, num_ranks, mem, proxy, c)
        if groups is not None:
            statics.append(max(cost(np.asarray(lengths, dtype=np.int64)[g], c) for g in groups))
    for g in sched:
        assert g.time == pytest.approx(cost(np.asarray(lengths, dtype=np.int64)[g.sequences], g.degree))
    if statics:
        assert sched.makespan <= min(statics) * (1 + 1e-9) + 1e-12
        assert sched.info["static_makespan"] == pytest.approx(min(statics), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("n", [50, 800], ids=["n50", "n800"])
def test_vectorized_cost_is_called_once_per_degree(n):
    calls = []

    def cost(ls, d):
        calls.append((ls.shape, d))
        return 1e-4 * ls / d + 1e-9 * ls.astype(np.float64) ** 2 / d + 1e-3 * (d - 1)

    lengths = np.random.default_rng(n).integers(1, 2000, n)
    sched = cp_schedule(lengths, 16, 65536, cost)
    assert [d for _, d in calls] == list(range(1, 17))  # independent of the number of sequences
    assert all(shape == (n,) for shape, _ in calls)
    assert sched.info["method"] != "empty"
    calls.clear()
    cp_schedule(lengths, 16, 65536, cost, vectorized=True)
    assert len(calls) == 16


def test_vectorized_cost_sees_read_only_lengths():
    def cost(ls, d):
        ls[0] = 0  # must not corrupt the schedule
        return ls / d

    with pytest.raises(ValueError, match="read-only"):
        cp_schedule([5, 6], 2, 8, cost)


def test_explicit_group_form_is_not_probed():
    sizes = []

    def cost(ls, d):
        sizes.append(ls.size)
        return float(ls.sum()) / d

    cp_schedule([5, 6, 7], 2, 100, cost, vectorized=False)
    assert sizes[0] == 1  # the fit's probes come first, not a call with all the sequences


@pytest.mark.parametrize(
    "cost, kwargs, err, match",
    [
        (lambda ls, d: ls[:-1] / d, {}, ValueError, r"cost\(lengths, 1\) returned shape \(2,\)"),
        (
            lambda ls, d: np.where(d == 2, np.nan, ls / d),
            {},
            ValueError,
            r"cost\(lengths, 2\) must return finite",
        ),
        (lambda ls, d: ls / d - 6.0, {}, ValueError, r"cost\(lengths, 1\) .* lengths\[0\] = 5"),
        (
            lambda ls, d: np.array(["a"] * ls.size),
            {},
            TypeError,
            r"cost\(lengths, 1\) must return real numbers",
        ),
        (lambda ls, d: ls > 0, {}, TypeError, "cost.*bool"),
        (lambda ls, d: ls * 1j, {}, TypeError, "cost.*complex"),
        (lambda ls, d: float(ls.sum()), {"vectorized": True}, ValueError, r"shape \(\)"),
        (lambda ls, d: np.nan, {}, ValueError, r"cost\(lengths, 1\) must return a finite number"),
        (lambda ls, d: "fast", {}, TypeError, r"cost\(lengths, 1\) must return a number"),
        (lambda ls, d: [[1.0], [1.0, 2.0]], {}, TypeError, r"cost\(lengths, 1\) must return a number"),
        (lambda ls, d: ls / d, {"vectorized": "yes"}, TypeError, "vectorized"),
        (CostModel(), {"vectorized": True}, ValueError, "vectorized"),
    ],
    ids=[
        "short",
        "nan",
        "negative",
        "strings",
        "bools",
        "complex",
        "scalar-vectorized",
        "nan-group",
        "string-group",
        "ragged",
        "vectorized-type",
        "vectorized-model",
    ],
)
def test_callable_errors_name_the_argument(cost, kwargs, err, match):
    with pytest.raises(err, match=match):
        cp_schedule([5, 6, 7], 4, 100, cost, **kwargs)


def test_negative_zero_times():
    sched = cp_schedule([5, 6, 7], 4, 100, lambda ls, d: -0.0 * ls)
    assert sched.makespan == 0.0 and sorted(np.concatenate([g.sequences for g in sched]).tolist()) == [
        0,
        1,
        2,
    ]


def test_callable_size_limits():
    with pytest.raises(ValueError, match="num_ranks = 5000"):
        cp_schedule([5, 6], 5000, 100, lambda ls, d: ls / d)
    with pytest.raises(ValueError, match=r"lengths: .* 4096 \* 4096"):
        cp_schedule(np.ones(4096, dtype=np.int64), 4096, 100, lambda ls, d: ls / d)


# --- size: the greedy fill's ordered path against a plain one, and large inputs -----------------
