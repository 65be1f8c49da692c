"""Dynamic CP groups: validity, never worse than static degrees or the paper, exact degrees, errors."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing import CostModel, cp_schedule
from mmbalance.balancing._core_api import core
from mmbalance.balancing.cp_schedule import DEFAULT_COST
from mmbalance.balancing.paper import paper_cp_schedule

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

models = st.sampled_from(
    [
        DEFAULT_COST,
        CostModel(linear=1.0, attention=1e-4, ring=0.5),
        CostModel(linear=1.0, attention=2e-4, ring=0.2, ring_latency=50.0, fixed=10.0, mask="full"),
        CostModel(linear=1.0, attention=1e-4, ring=0.3, overlap=False),
        CostModel(linear=1.0),
    ]
)


@st.composite
def batches(draw):
    num_ranks = draw(st.integers(1, 12))
    mem = draw(st.integers(64, 4096))
    n = draw(st.integers(0, 40))
    short = st.integers(0, mem)
    long = st.integers(mem, mem * num_ranks)
    lengths = draw(st.lists(st.one_of(short, short, long), min_size=n, max_size=n))
    # keep the batch within the total memory (else the schedule must refuse it)
    total, kept = 0, []
    for x in lengths:
        if total + x <= mem * num_ranks:
            kept.append(x)
            total += x
    return kept, num_ranks, mem


def check_valid(sched, lengths, num_ranks, mem, cost):
    lengths = np.asarray(lengths, dtype=np.int64)
    seen = np.concatenate([g.sequences for g in sched]) if len(sched) else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(seen), np.arange(lengths.size))  # every sequence exactly once
    assert sum(g.degree for g in sched) <= num_ranks
    ranks = [r for g in sched for r in g.ranks]
    assert len(ranks) == len(set(ranks)) and all(0 <= r < num_ranks for r in ranks)
    for g in sched:
        assert g.degree >= 1 and len(g.ranks) == g.degree and list(g.ranks) == sorted(g.ranks)
        assert g.sequences.dtype == np.int64 and g.sequences.size > 0
        assert lengths[g.sequences].sum() <= g.degree * mem  # memory of every rank respected
        assert g.time == pytest.approx(cost.time(lengths[g.sequences], g.degree), rel=1e-9)
    assert sched.makespan == pytest.approx(max((g.time for g in sched), default=0.0), rel=1e-12)


# --- references written plainly -------------------------------------------------------------------


def static_makespan(lengths, num_ranks, mem, cost, c):
    """A static uniform degree c: N // c groups, longest first to the group that stays fastest."""
    groups = static_groups(lengths, num_ranks, mem, cost, c)
    if groups is None:
        return None
    return max((cost.time([lengths[j] for j in g], c) for g in groups), default=0.0)


def paper_makespan(lengths, num_ranks, mem, cost):
    """DHP section 4.3: best-fit-decreasing atomic groups, then algorithm 1 (the 2-D DP over degrees)."""
    bins = []  # [free tokens, dmin, members]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in bins if b[0] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (b[0], bins.index(b)))
        else:
            dmin = max(1, -(-lengths[i] // mem))
            b = [dmin * mem, dmin, []]
            bins.append(b)
        b[0] -= lengths[i]
        b[2].append(i)
    dmin = [b[1] for b in bins]
    if not bins:
        return 0.0
    if sum(dmin) > num_ranks:
        return None
    inf = float("inf")
    dp = [[inf] * (num_ranks + 1) for _ in range(len(bins) + 1)]
    dp[0][0] = 0.0
    for k, b in enumerate(bins, start=1):
        members = [lengths[j] for j in b[2]]
        for j in range(num_ranks + 1):
            for d in range(b[1], j + 1):
                if dp[k - 1][j - d] < inf:
                    dp[k][j] = min(dp[k][j], max(dp[k - 1][j - d], cost.time(members, d)))
    return dp[len(bins)][num_ranks]


# --- properties -------------------------------------------------------------------------------------


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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(sig)


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


# --- callable costs: per-sequence (vectorized) and per-group ------------------------------------


def _transformer_per_sequence(ls, d):
    x = ls.astype(np.float64)
    return DEFAULT_COST.predict(x, x * x, np.float64(d))


def _degree_penalty(ls, d):  # not convex in d: degrees divisible by 3 pay extra
    x = ls.astype(np.float64)
    return 1e-3 * x / d + 1e-7 * x * x / d + 0.3 * (d % 3 == 0) + 0.05 * (d - 1)


def _scrambled(ls, d):  # not monotone in the length either
    return ((ls * 7919) % 101 + 1.0) / np.sqrt(d) + 2.0 * (ls > 0) * (d > 4)


def _free(ls, d):  # every time 0: ties everywhere
    return np.zeros(ls.shape)


per_sequence_costs = st.sampled_from([_transformer_per_sequence, _degree_penalty, _scrambled, _free])


class PerSequence:
    """A per-sequence cost as a group cost: the sum over the group (for the references above)."""

    def __init__(self, fn):
        self.fn = fn

    def time(self, ls, d):
        return float(self.fn(np.asarray(ls, dtype=np.int64), d).sum())


def static_groups_additive(lengths, num_ranks, mem, fn, c):
    """Static degree c under per-sequence times: the group with the least time after adding wins."""
    lengths = np.asarray(lengths, dtype=np.int64)
    t = fn(lengths, c)
    times, tokens = np.zeros(num_ranks // c), np.zeros(num_ranks // c, dtype=np.int64)
    for i in sorted(range(lengths.size), key=lambda i: (-lengths[i], i)):
        after = np.where(tokens + lengths[i] <= c * mem, times + t[i], np.inf)
        k = int(np.argmin(after))
        if after[k] == np.inf:
            return None
        times[k], tokens[k] = after[k], tokens[k] + lengths[i]
    return times.max(initial=0.0)


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


def static_groups(lengths, num_ranks, mem, cost, c):
    """The non-empty groups (indices) of the static degree c, or None if a sequence fits nowhere."""
    groups = [[] for _ in range(num_ranks // c)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best, best_t = None, None
        for k, g in enumerate(groups):
            if sum(lengths[j] for j in g) + lengths[i] > c * mem:
                continue
            t = cost.time([lengths[j] for j in g] + [lengths[i]], c)
            if best is None or t < best_t:
                best, best_t = k, t
        if best is None:
            return None
        groups[best].append(i)
    return [g for g in groups if g]


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
    sched = cp_schedule(lengths, 4096, 16384, _transformer_per_sequence)
    check_valid(sched, lengths, 4096, 16384, PerSequence(_transformer_per_sequence))
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
