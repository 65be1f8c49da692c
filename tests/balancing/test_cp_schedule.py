"""Dynamic CP groups: validity, never worse than static degrees or the paper, exact degrees, errors."""

from __future__ import annotations

import itertools
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmbalance.balancing import CostModel, cp_schedule
from mmbalance.balancing._core_api import core
from mmbalance.balancing.cp_schedule import DEFAULT_COST
from mmbalance.balancing.paper import paper_cp_schedule
from tests import procs
from tests.balancing.cp_refs import (
    SETTINGS,
    PerSequence,
    batches,
    check_valid,
    models,
    paper_makespan,
    static_groups_additive,
    static_makespan,
    transformer_per_sequence,
)


@SETTINGS
@given(batch=batches(), cost=models)
def test_schedule_is_valid(batch, cost):
    lengths, num_ranks, mem = batch
    sched = cp_schedule(lengths, num_ranks, mem, cost)
    check_valid(sched, lengths, num_ranks, mem, cost)


@SETTINGS
@given(batch=batches(), cost=models)
def test_never_worse_than_the_best_static_degree(batch, cost):
    lengths, num_ranks, mem = batch
    sched = cp_schedule(lengths, num_ranks, mem, cost)
    statics = [static_makespan(lengths, num_ranks, mem, cost, c) for c in range(1, num_ranks + 1)]
    feasible = [s for s in statics if s is not None]
    if feasible:
        assert sched.makespan <= min(feasible) * (1 + 1e-9) + 1e-12
        assert sched.info["static_makespan"] == pytest.approx(min(feasible), rel=1e-9)


@SETTINGS
@given(batch=batches(), cost=models)
def test_never_worse_than_the_paper(batch, cost):
    lengths, num_ranks, mem = batch
    paper = paper_makespan(lengths, num_ranks, mem, cost)
    sched = cp_schedule(lengths, num_ranks, mem, cost)
    if paper is not None:
        assert sched.makespan <= paper * (1 + 1e-9) + 1e-12
        ref = paper_cp_schedule(lengths, num_ranks, mem, cost)
        assert ref.makespan == pytest.approx(paper, rel=1e-9)
    assert sched.makespan >= sched.info["lower_bound"] * (1 - 1e-9) - 1e-12


@SETTINGS
@given(
    times=st.lists(st.lists(st.floats(0.0, 100.0), min_size=7, max_size=7), min_size=1, max_size=4),
    dmin=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    num_ranks=st.integers(1, 6),
)
def test_optimal_degrees_is_exact(times, dmin, num_ranks):
    g = len(times)
    dmin = np.array(dmin[:g], dtype=np.int64)
    if dmin.max() > num_ranks:
        return
    table = np.array([row[: num_ranks + 1] for row in times], dtype=np.float64)
    degree, ms = core().optimal_degrees(table, dmin, num_ranks)
    options = [range(int(dmin[k]), num_ranks + 1) for k in range(g)]
    brute = min(
        (max(table[k, d[k]] for k in range(g)) for d in itertools.product(*options) if sum(d) <= num_ranks),
        default=None,
    )
    if brute is None:
        assert degree.size == 0
        return
    assert ms == brute and degree.sum() <= num_ranks and np.all(degree >= dmin)
    assert max(table[k, degree[k]] for k in range(g)) == brute
    pdeg, pms = core().paper_dp_degrees(table, dmin, num_ranks)  # all ranks used: never better
    if pdeg.size:
        assert pms >= ms


@SETTINGS
@given(batch=batches())
def test_callable_cost(batch):
    lengths, num_ranks, mem = batch

    def cost(ls, d):
        return float(ls.sum() / d + 1e-3 * (ls.astype(np.float64) ** 2).sum() / d + 7.0 * (d - 1))

    sched = cp_schedule(lengths, num_ranks, mem, cost)
    assert sorted(np.concatenate([g.sequences for g in sched]).tolist() if len(sched) else []) == list(
        range(len(lengths))
    )
    for g in sched:
        assert g.time == pytest.approx(cost(np.asarray(lengths)[g.sequences], g.degree))
        assert np.asarray(lengths)[g.sequences].sum() <= g.degree * mem

    class Wrapped:  # the same cost, as a plain callable object, through the paper's solver
        def time(self, ls, d):
            return cost(np.asarray(ls), d)

    paper = paper_makespan(lengths, num_ranks, mem, Wrapped())
    if paper is not None:
        assert sched.makespan <= paper * (1 + 1e-9)


def test_deterministic_across_processes():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 30000, 200).tolist()
    a = cp_schedule(lengths, 32, 131072)
    b = cp_schedule(lengths, 32, 131072)
    sig = [(g.degree, g.ranks, g.sequences.tolist()) for g in a]
    assert sig == [(g.degree, g.ranks, g.sequences.tolist()) for g in b]
    code = (
        "import numpy as np; from mmbalance.balancing import cp_schedule; "
        f"s = cp_schedule({lengths!r}, 32, 131072); "
        "print([(g.degree, g.ranks, g.sequences.tolist()) for g in s])"
    )
    out = procs.run([sys.executable, "-c", code], timeout=300)
    assert out.stdout.strip() == str(sig)


def test_large_plans_on_two_threads_are_the_same_however_the_threads_run():
    # 1500 sequences x 512 ranks: the fills, solves and searches run two at a time (on the helper
    # thread, or on threads of their own while other callers hold it); every decision is taken in
    # one order, so every call, concurrent or not, in this process or another, gives one plan
    rng = np.random.default_rng(11)
    lengths = rng.lognormal(7.0, 1.0, 1500).astype(np.int64) + 1
    rare = rng.random(1500) < 0.01
    lengths[rare] = rng.integers(20_000, 60_000, int(rare.sum()))
    args = (lengths, 512, 16384)
    kwargs = {"ranks_per_node": 8}

    def sig(s):
        return ([(g.degree, g.ranks, g.sequences.tolist(), g.time) for g in s], s.makespan, s.info)

    want = sig(cp_schedule(*args, **kwargs))
    check_valid(cp_schedule(*args, **kwargs), lengths, 512, 16384, DEFAULT_COST)
    assert want[1] <= want[2]["static_makespan"] and want[1] <= want[2]["paper_makespan"]
    with ThreadPoolExecutor(4) as pool:
        for got in pool.map(lambda _: sig(cp_schedule(*args, **kwargs)), range(12)):
            assert got == want
    code = (
        "import numpy as np, sys; from mmbalance.balancing import cp_schedule; "
        "l = np.array(sys.stdin.read().split(), dtype=np.int64); "
        "s = cp_schedule(l, 512, 16384, ranks_per_node=8); "
        "print(repr([(g.degree, g.ranks, g.sequences.tolist(), g.time) for g in s]))"
    )
    out = procs.run([sys.executable, "-c", code], input=" ".join(map(str, lengths.tolist())), timeout=480)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(want[0])


def test_groups_stay_inside_nodes():
    lengths = [30000, 20000, 20000, 9000, 8000, 500, 400]
    sched = cp_schedule(lengths, 16, 8192, CostModel(linear=1.0, attention=1e-4, ring=0.5), ranks_per_node=4)
    for g in sched:
        if g.degree <= 4:
            assert len({r // 4 for r in g.ranks}) == 1


def test_empty_batch():
    sched = cp_schedule([], 4, 100)
    assert list(sched) == [] and sched.makespan == 0.0


@pytest.mark.parametrize(
    "args, kwargs, err, match",
    [
        (
            ([10, 9000], 4, 1000),
            {},
            ValueError,
            r"lengths\[1\] = 9000 exceeds the memory of all ranks together",
        ),
        (([900, 900, 900, 900, 900], 4, 1000), {}, ValueError, "split the micro-batch"),
        (([10, -1], 4, 1000), {}, ValueError, "lengths"),
        (([10.5], 4, 1000), {}, ValueError, "lengths"),
        (([10], 0, 1000), {}, ValueError, "num_ranks"),
        (([10], 2.0, 1000), {}, TypeError, "num_ranks"),
        (([10], 2, 0), {}, ValueError, "memory_per_rank"),
        (([10], 2, 100), {"cost": "fast"}, TypeError, "cost"),
        (([10], 2, 100), {"cost": CostModel(padded=True)}, ValueError, "cost"),
        (([10], 2, 100), {"cost": lambda ls, d: -1.0}, ValueError, "cost"),
        (([10], 2, 100), {"ranks_per_node": 0}, ValueError, "ranks_per_node"),
        (([10], 6, 100), {"ranks_per_node": 4}, ValueError, "ranks_per_node"),
    ],
    ids=[
        "too-long",
        "too-much",
        "negative",
        "float",
        "zero-ranks",
        "float-ranks",
        "zero-memory",
        "bad-cost",
        "padded-cost",
        "negative-cost",
        "zero-ranks-per-node",
        "ranks-per-node-divides",
    ],
)
def test_errors_name_the_argument(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        cp_schedule(*args, **kwargs)


@pytest.mark.slow
def test_real_data_512_sequences_64_ranks():
    from mmbalance.balancing.datasets import mixture

    for seed in range(3):
        lengths = mixture(512, seed).llm
        mem = 32768
        sched = cp_schedule(lengths, 64, mem)
        check_valid(sched, lengths, 64, mem, DEFAULT_COST)
        assert (
            sched.makespan <= sched.info["static_makespan"] and sched.makespan <= sched.info["paper_makespan"]
        )


def greedy_reference(lengths, num_ranks, mem, cost, c):
    """cp_static_groups's greedy, plainly: sums in insertion order, the first smallest wins."""
    g = num_ranks // c
    s1, s2, tokens, count = np.zeros(g), np.zeros(g), np.zeros(g, dtype=np.int64), np.zeros(g, dtype=np.int64)
    group_of = np.full(len(lengths), -1)
    dd = float(c)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        x = float(lengths[i])
        a1, a2 = s1 + x, s2 + x * x
        a = cost.attention * (1.0 + cost.eta) * a2 / dd
        ring = cost.ring * a1 * (dd - 1.0) / dd + cost.ring_latency * (dd - 1.0) if c > 1 else np.zeros(g)
        t = cost.fixed + cost.linear * a1 / dd + (np.maximum(a, ring) if cost.overlap else a + ring)
        t = np.where(tokens + lengths[i] <= c * mem, t, np.inf)
        k = int(np.argmin(t))
        if t[k] == np.inf:
            return None
        s1[k], s2[k], tokens[k], count[k], group_of[i] = a1[k], a2[k], tokens[k] + lengths[i], count[k] + 1, k
    return group_of


@pytest.mark.parametrize("model", range(4), ids=["default", "ring", "latency-full", "no-overlap"])
@pytest.mark.parametrize("kind", ["lognormal", "equal", "few-distinct"])
def test_ordered_greedy_matches_the_plain_one(model, kind):
    cost = [
        DEFAULT_COST,
        CostModel(linear=1.0, attention=1e-4, ring=0.5),
        CostModel(linear=1.0, attention=2e-4, ring=0.2, ring_latency=50.0, fixed=10.0, mask="full"),
        CostModel(linear=1.0, attention=1e-4, ring=0.3, overlap=False),
    ][model]
    rng = np.random.default_rng(model)
    lengths = {
        "lognormal": rng.lognormal(7, 1.3, 700).astype(np.int64) + 1,
        "equal": np.full(700, 1000, dtype=np.int64),
        "few-distinct": rng.choice([0, 300, 1000, 5000], 700),
    }[kind]
    num_ranks, mem = 600, 16384
    degrees = np.array([1, 2, 3, 5, 7, 9, 40, 600])  # 600 .. 1 groups: the ordered path and the scan
    groups, makespan = core().cp_static_groups(
        lengths,
        num_ranks,
        mem,
        cost.linear,
        cost.attention * (1 + cost.eta),
        cost.ring,
        cost.ring_latency,
        cost.fixed,
        cost.overlap,
        degrees,
    )
    for row, ms, c in zip(groups, makespan, degrees):
        ref = greedy_reference(lengths, num_ranks, mem, cost, int(c))
        if ref is None:
            assert row[0] == -1 and ms == -1.0
            continue
        assert np.array_equal(row, ref)
        times = [cost.time(lengths[row == k], int(c)) for k in np.unique(row)]
        assert ms == pytest.approx(max(times), rel=1e-12)


@pytest.mark.parametrize(
    "num_ranks, n", [(10_000, 512), (100_000, 512), (100_000, 5_000)], ids=["1e4x512", "1e5x512", "1e5x5000"]
)
def test_many_ranks(num_ranks, n):
    from mmbalance.balancing.datasets import mixture

    lengths = mixture(n, 1).llm
    mem = 32768
    sched = cp_schedule(lengths, num_ranks, mem, ranks_per_node=8)
    check_valid(sched, lengths, num_ranks, mem, DEFAULT_COST)
    assert sched.makespan <= sched.info["static_makespan"] and sched.makespan <= sched.info["paper_makespan"]
    assert sched.makespan >= sched.info["lower_bound"] * (1 - 1e-9)


@pytest.mark.slow
def test_many_sequences_and_ranks():
    rng = np.random.default_rng(5)
    lengths = rng.lognormal(7, 1.2, 100_000).astype(np.int64) + 1
    sched = cp_schedule(lengths, 100_000, 32768)
    check_valid(sched, lengths, 100_000, 32768, DEFAULT_COST)
    assert sched.makespan <= sched.info["static_makespan"]


def test_vectorized_many_ranks_and_sequences():
    rng = np.random.default_rng(6)
    lengths = rng.integers(1, 20000, 2000)
    sched = cp_schedule(lengths, 4096, 16384, transformer_per_sequence)
    check_valid(sched, lengths, 4096, 16384, PerSequence(transformer_per_sequence))
    assert sched.makespan <= sched.info["static_makespan"] * (1 + 1e-12)


def _static_closed_form(lengths, num_ranks, mem, cost, c):
    """Static degree c (numpy): longest first to the group whose time after adding is least (ties:
    lowest group), among the groups with memory left; the slowest group's time, or None."""
    g = num_ranks // c
    s1, s2 = np.zeros(g), np.zeros(g)
    tokens = np.zeros(g, dtype=np.int64)
    dd = float(c)
    for i in sorted(range(lengths.size), key=lambda i: (-lengths[i], i)):
        x = float(lengths[i])
        a = cost.attention * (1.0 + cost.eta) * (s2 + x * x) / dd
        r = cost.ring * (s1 + x) * (dd - 1.0) / dd + cost.ring_latency * (dd - 1.0) if c > 1 else 0.0 * a
        after = cost.fixed + cost.linear * (s1 + x) / dd + (np.maximum(a, r) if cost.overlap else a + r)
        after = np.where(tokens + lengths[i] <= c * mem, after, np.inf)
        k = int(np.argmin(after))
        if after[k] == np.inf:
            return None
        s1[k], s2[k], tokens[k] = s1[k] + x, s2[k] + x * x, tokens[k] + lengths[i]
    a = cost.attention * (1.0 + cost.eta) * s2 / dd
    r = cost.ring * s1 * (dd - 1.0) / dd + cost.ring_latency * (dd - 1.0) if c > 1 else 0.0 * a
    t = cost.fixed + cost.linear * s1 / dd + (np.maximum(a, r) if cost.overlap else a + r)
    return float(np.where(tokens > 0, t, 0.0).max())


def _one_over_degree(ls, d):  # every sequence the same: static makespans are ceil(n / groups) / d
    return np.full(ls.shape, 1.0 / d)


@pytest.mark.parametrize("form", ["closed", "vectorized"])
def test_pruned_static_sweep_still_finds_the_best_static_degree(form):
    # 700 sequences on 128 ranks: the static sweep would fill more than 2**16 sequences, so degrees
    # are filled in ascending order of a lower bound and left out once it cannot beat the best
    # found. In both cases the degree with the least bound is not the best static degree (per-group
    # constants, or whole sequences per group), so a bound that is too high loses the best.
    rng = np.random.default_rng(11)
    lengths = np.clip(rng.lognormal(np.log(900), 1.0, 700), 16, 20000).astype(np.int64)
    num_ranks = 128
    if form == "closed":
        mem = 12000
        cost = CostModel(linear=1.0, attention=2e-4, ring=0.2, ring_latency=50.0, fixed=10.0, mask="full")
        sched = cp_schedule(lengths, num_ranks, mem, cost)
        statics = [_static_closed_form(lengths, num_ranks, mem, cost, c) for c in range(1, num_ranks + 1)]
    else:
        mem = 20000
        sched = cp_schedule(lengths, num_ranks, mem, _one_over_degree)
        statics = [
            static_groups_additive(lengths, num_ranks, mem, _one_over_degree, c)
            for c in range(1, num_ranks + 1)
        ]
    feasible = [s for s in statics if s is not None]
    assert sched.info["static_makespan"] == pytest.approx(min(feasible), rel=1e-9)
    assert sched.info["static_degree"] == 1 + statics.index(min(feasible))
    assert sched.makespan <= min(feasible) * (1 + 1e-12)
