"""Shared by the dynamic-CP schedule tests: hypothesis settings, the batches and cost models drawn,
the validity check, and plain references (static degrees, the DHP paper's schedule)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mmbalance.balancing import CostModel
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


def static_groups(lengths, num_ranks, mem, cost, c, group_time=None):
    """The non-empty groups (indices) of the static degree c, or None if a sequence fits nowhere.
    ``group_time(indices, c)``: a group's time from its sequences' indices, in place of
    ``cost.time`` of their lengths."""
    groups = [[] for _ in range(num_ranks // c)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best, best_t = None, None
        for k, g in enumerate(groups):
            if sum(lengths[j] for j in g) + lengths[i] > c * mem:
                continue
            if group_time is not None:
                t = group_time(g + [i], c)
            else:
                t = cost.time([lengths[j] for j in g] + [lengths[i]], c)
            if best is None or t < best_t:
                best, best_t = k, t
        if best is None:
            return None
        groups[best].append(i)
    return [g for g in groups if g]


# --- callable costs: per-sequence (vectorized) and per-group ------------------------------------


def transformer_per_sequence(ls, d):
    x = ls.astype(np.float64)
    return DEFAULT_COST.predict(x, x * x, np.float64(d))


def degree_penalty(ls, d):  # not convex in d: degrees divisible by 3 pay extra
    x = ls.astype(np.float64)
    return 1e-3 * x / d + 1e-7 * x * x / d + 0.3 * (d % 3 == 0) + 0.05 * (d - 1)


def scrambled(ls, d):  # not monotone in the length either
    return ((ls * 7919) % 101 + 1.0) / np.sqrt(d) + 2.0 * (ls > 0) * (d > 4)


def free(ls, d):  # every time 0: ties everywhere
    return np.zeros(ls.shape)


per_sequence_costs = st.sampled_from([transformer_per_sequence, degree_penalty, scrambled, free])


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
