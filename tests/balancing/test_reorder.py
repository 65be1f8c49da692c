"""1F1B simulation and microbatch reordering: exact simulation, never worse than the paper, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mmbalance.balancing import inter_reorder, intra_reorder, reorder, simulate_1f1b
from mmbalance.balancing.paper import paper_inter_reorder, paper_intra_reorder

SETTINGS = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


# --- references written plainly -------------------------------------------------------------------


def ref_simulate(f, b):
    """1F1B by recursion: each op ends at max(previous op on its stage, its dependency) + duration."""
    f, b = np.asarray(f, float), np.asarray(b, float)
    l, p = f.shape
    if l == 0:
        return 0.0, {}, {}
    ops = {}  # stage -> list of ("F"|"B", microbatch)
    for s in range(p):
        w = min(p - 1 - s, l)
        seq = [("F", i) for i in range(w)]
        for k in range(l - w):
            seq += [("F", w + k), ("B", k)]
        seq += [("B", i) for i in range(l - w, l)]
        ops[s] = seq
    pos = {(s, op): k for s in range(p) for k, op in enumerate(ops[s])}
    end = {}

    def finish(s, op):
        key = (s, op)
        if key in end:
            return end[key]
        k = pos[key]
        prev = finish(s, ops[s][k - 1]) if k > 0 else 0.0
        kind, i = op
        if kind == "F":
            dep = finish(s - 1, ("F", i)) if s > 0 else 0.0
            dur = f[i, s]
        else:
            dep = finish(s + 1, ("B", i)) if s < p - 1 else finish(s, ("F", i))
            dur = b[i, s]
        end[key] = max(prev, dep) + dur
        return end[key]

    ms = max(finish(s, ops[s][-1]) for s in range(p))
    fend = {(i, s): finish(s, ("F", i)) for i in range(l) for s in range(p)}
    bend = {(i, s): finish(s, ("B", i)) for i in range(l) for s in range(p)}
    return ms, fend, bend


def ref_alg3(f, b):
    """DistTrain algorithm 3: smallest first, p-1 smallest last, intervals filled by closest."""
    f, b = np.asarray(f, float), np.asarray(b, float)
    l, p = f.shape
    if l == 0 or p <= 1:
        return list(range(l))
    size = f[:, 0]
    asc = sorted(range(l), key=lambda i: (size[i], i))
    ret, used = [asc[0]], {asc[0]}
    rear = asc[1 : 1 + min(p - 1, l - 1)][::-1]
    used |= set(rear)
    filler = l - 1 - len(rear)
    i = 1
    while len(ret) < 1 + filler:
        _, fe, be = ref_simulate(f[ret], b[ret])
        interval = be[(0, 1)] - fe[(0, 0)] if i == 1 else be[(i - 1, 1)] - be[(i - 2, 0)]
        k = min(p - 1, filler) if i == 1 else 1
        left = max(0.0, interval)
        for j in range(k):
            aim = left / (k - j)
            best = min((x for x in range(l) if x not in used), key=lambda x: (abs(size[x] - aim), x))
            used.add(best)
            ret.append(best)
            left -= size[best]
        i += 1
    return ret + rear


def ref_alg2(w, m):
    """DistTrain algorithm 2 as written: ascending, least-loaded group, groups concatenated."""
    groups, load = [[] for _ in range(m)], [0.0] * m
    for i in sorted(range(len(w)), key=lambda i: (w[i], i)):
        k = min(range(m), key=lambda k: (load[k], k))
        groups[k].append(i)
        load[k] += w[i]
    return [i for g in groups for i in g]


def blocks(n, m):
    sizes = [n // m + (1 if k < n % m else 0) for k in range(m)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(int)


def max_block_load(w, order, m):
    off = blocks(len(w), m)
    return max(sum(w[i] for i in order[off[k] : off[k + 1]]) for k in range(m))


def plan_makespan(f, b, order, m):
    off = blocks(f.shape[0], m)
    return max(
        ref_simulate(f[order[off[k] : off[k + 1]]], b[order[off[k] : off[k + 1]]])[0] for k in range(m)
    )


times = st.integers(1, 6).flatmap(
    lambda p: st.integers(0, 9).flatmap(
        lambda l: hnp.arrays(np.float64, (l, p), elements=st.floats(0.0, 10.0, allow_nan=False))
    )
)


# --- properties -------------------------------------------------------------------------------------


@SETTINGS
@given(f=times, ratio=st.floats(0.5, 3.0))
def test_simulation_is_exact(f, ratio):
    b = f * ratio
    assert simulate_1f1b(f, b) == pytest.approx(ref_simulate(f, b)[0], rel=1e-12, abs=1e-12)
    if f.shape[0]:
        ms, fs, bs = simulate_1f1b(f, b, return_schedule=True)
        _, fe, be = ref_simulate(f, b)
        for (i, s), e in fe.items():
            assert fs[i, s] + f[i, s] == pytest.approx(e)
            assert bs[i, s] + b[i, s] == pytest.approx(be[(i, s)])


@pytest.mark.parametrize("l, p", [(1, 1), (4, 4), (8, 4), (16, 3), (3, 6)], ids=lambda x: str(x))
def test_uniform_pipeline_closed_form(l, p):
    # equal microbatches: (l + p - 1) * (t_f + t_b)
    assert simulate_1f1b(np.ones((l, p))) == pytest.approx((l + p - 1) * 3.0)


@SETTINGS
@given(f=times)
def test_paper_inter_matches_the_written_algorithm(f):
    assert paper_inter_reorder(f).tolist() == ref_alg3(f, 2 * f)


@SETTINGS
@given(f=times, ratio=st.floats(0.5, 3.0))
def test_inter_never_slower_than_original_or_paper(f, ratio):
    b = f * ratio
    order = inter_reorder(f, b)
    assert sorted(order.tolist()) == list(range(f.shape[0]))
    ours = ref_simulate(f[order], b[order])[0]
    assert ours <= ref_simulate(f, b)[0] + 1e-9
    paper = ref_alg3(f, b)
    assert ours <= ref_simulate(f[paper], b[paper])[0] + 1e-9


@SETTINGS
@given(w=st.lists(st.floats(0.0, 100.0), max_size=40), m=st.integers(1, 8))
def test_intra_never_worse_than_original_or_paper(w, m):
    order = intra_reorder(w, m)
    assert sorted(order.tolist()) == list(range(len(w)))
    assert paper_intra_reorder(w, m).tolist() == ref_alg2(w, m)
    if w:
        ours = max_block_load(w, order, m)
        assert ours <= max_block_load(w, list(range(len(w))), m) + 1e-9
        assert ours <= max_block_load(w, ref_alg2(w, m), m) + 1e-9


@SETTINGS
@given(f=times, m=st.integers(1, 4))
def test_reorder_never_slower_than_original_or_paper(f, m):
    b = 2 * f
    plan = reorder(f, m)
    n = f.shape[0]
    assert sorted(plan.order.tolist()) == list(range(n))
    assert plan.offsets.tolist() == blocks(n, m).tolist()
    ours = plan_makespan(f, b, plan.order, m) if n else 0.0
    assert plan.makespan == pytest.approx(ours, rel=1e-12, abs=1e-12)
    if n:
        assert ours <= plan_makespan(f, b, list(range(n)), m) + 1e-9
        # the paper's plan: algorithm 2 for the groups, algorithm 3 inside each
        w = (f + b).sum(axis=1)
        order2, off = ref_alg2(w.tolist(), m), blocks(n, m)
        paper = []
        for k in range(m):
            blk = order2[off[k] : off[k + 1]]
            paper += [blk[j] for j in ref_alg3(f[blk], b[blk])]
        assert ours <= plan_makespan(f, b, paper, m) + 1e-9
        assert plan.info["paper"] == pytest.approx(plan_makespan(f, b, paper, m), rel=1e-9)


def test_reorder_is_deterministic_and_balances_real_data():
    from mmbalance.balancing.datasets import mixture

    s = mixture(480, 5)
    enc = 1e-3 * s.vision + 1e-7 * s.vision.astype(float) ** 2
    llm = (1e-3 * s.llm + 1e-8 * s.llm.astype(float) ** 2) / 3
    f = np.stack([enc, llm, llm, llm], axis=1)
    a, b = reorder(f, 30), reorder(f, 30)
    assert np.array_equal(a.order, b.order)
    assert a.makespan <= min(a.info["original"], a.info["paper"])
    assert a.makespan < a.info["original"]


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: simulate_1f1b([1.0, 2.0]), ValueError, "stage_times"),
        (lambda: simulate_1f1b([[1.0, -2.0]]), ValueError, "stage_times"),
        (lambda: simulate_1f1b([[1.0]], [[1.0, 2.0]]), ValueError, "backward_times"),
        (lambda: simulate_1f1b("x"), TypeError, "stage_times"),
        (lambda: reorder([[1.0]], 0), ValueError, "num_groups"),
        (lambda: reorder([[1.0]], 1, max_evals=-1), ValueError, "max_evals"),
        (lambda: intra_reorder([[1.0]], 2), ValueError, "costs"),
        (lambda: intra_reorder([1.0, float("inf")], 2), ValueError, "costs"),
        (lambda: inter_reorder([[float("nan")]]), ValueError, "stage_times"),
    ],
    ids=["1d", "negative", "shape", "string", "zero-groups", "evals", "2d-costs", "inf-costs", "nan"],
)
def test_errors_name_the_argument(call, err, match):
    with pytest.raises(err, match=match):
        call()
