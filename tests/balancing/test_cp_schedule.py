"""Dynamic CP groups: validity, never worse than static degrees or the paper, exact degrees, errors."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing import CostModel, cp_schedule, paper_cp_schedule
from mmbalance.balancing._core_api import core
from mmbalance.balancing.cp_schedule import DEFAULT_COST

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
    return max((cost.time([lengths[j] for j in g], c) for g in groups if g), default=0.0)


def paper_makespan(lengths, num_ranks, mem, cost):
    """dhp.txt 4.3: best-fit-decreasing atomic groups, then algorithm 1 (the 2-D DP over degrees)."""
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
