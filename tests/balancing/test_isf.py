"""ISF mini-batches, Pad Ratio and Dist Ratio (OmniBal section 4.1, eqs. 1-2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing import batch_stats, dist_ratio, isf_batches, isf_limits, pad_ratio
from mmbalance.balancing._core_api import core

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def ref_ratio(t):
    """Eqs. 1 and 2 have the same form: sum(max - t_i) / (max * count)."""
    t = [float(x) for x in t]
    if not t or max(t) == 0:
        return 0.0
    return sum(max(t) - x for x in t) / (max(t) * len(t))


def ref_isf(v, t, qv, qt, mv, mt, iterations, seed):
    """Algorithms 1-2 of OmniBal written plainly (the leftovers: one more sampling pass, as the
    paper's code), with the library's seeded permutation as the only shared piece."""
    n = len(v)
    groups, pool = [], []
    for i in range(n):
        (groups.append([i]) if (v[i] > qv or t[i] > qt) else pool.append(i))
    for it in range(iterations):
        if not pool:
            break
        perm = core().permutation(len(pool), (seed * 0x100000001B3 + it) % 2**64)
        cands, cur = [], []
        for q in perm:
            i = pool[q]
            if cur and (sum(v[j] for j in cur) + v[i] > qv or sum(t[j] for j in cur) + t[i] > qt):
                cands.append(cur)
                cur = []
            cur.append(i)
        if cur:
            cands.append(cur)
        back = []
        for g in cands:  # filtering: keep the groups that reach a target
            if sum(v[j] for j in g) >= mv or sum(t[j] for j in g) >= mt:
                groups.append(g)
            else:
                back += g
        pool = sorted(back)
    if pool:
        perm = core().permutation(len(pool), (seed * 0x100000001B3 + 0xFFFF) % 2**64)
        cur = []
        for q in perm:
            i = pool[q]
            if cur and (sum(v[j] for j in cur) + v[i] > qv or sum(t[j] for j in cur) + t[i] > qt):
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
    return sorted(sorted(g) for g in groups)


samples = st.integers(0, 60).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 6), min_size=n, max_size=n),
        st.lists(st.integers(1, 900), min_size=n, max_size=n),
    )
)


@SETTINGS
@given(t=st.lists(st.integers(0, 10**6), max_size=30))
def test_ratios_match_the_equations(t):
    assert pad_ratio(t) == pytest.approx(ref_ratio(t))
    assert dist_ratio(t) == pytest.approx(ref_ratio(t))


@SETTINGS
@given(
    data=samples,
    qv=st.integers(1, 12),
    qt=st.integers(100, 3000),
    it=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_paper_variant_is_the_written_algorithm(data, qv, qt, it, seed):
    v, t = data
    b = isf_batches(v, t, max_vision=qv, max_text=qt, iterations=it, seed=seed, pack_leftovers=False)
    got = sorted(sorted(x.tolist()) for x in b)
    assert got == ref_isf(v, t, qv, qt, qv, max(0, qt - 128), it, seed)


@SETTINGS
@given(
    data=samples,
    qv=st.integers(1, 12),
    qt=st.integers(100, 3000),
    it=st.integers(0, 5),
    seed=st.integers(0, 99),
    pack=st.booleans(),
    devices=st.one_of(st.none(), st.integers(1, 8)),
)
def test_every_sample_once_within_caps(data, qv, qt, it, seed, pack, devices):
    v, t = np.array(data[0], dtype=np.int64), np.array(data[1], dtype=np.int64)
    b = isf_batches(
        v, t, max_vision=qv, max_text=qt, iterations=it, seed=seed, pack_leftovers=pack, num_devices=devices
    )
    flat = np.concatenate(b) if len(b) else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(flat), np.arange(v.size))
    for x in b:
        assert x.size >= 1
        assert (v[x].sum() <= qv and t[x].sum() <= qt) or x.size == 1  # only an oversized sample breaks a cap
    again = isf_batches(
        v, t, max_vision=qv, max_text=qt, iterations=it, seed=seed, pack_leftovers=pack, num_devices=devices
    )
    assert [x.tolist() for x in b] == [x.tolist() for x in again]  # deterministic


def test_kept_groups_reach_a_target():
    rng = np.random.default_rng(0)
    v, t = rng.integers(1, 5, 2000), rng.integers(50, 800, 2000)
    b = isf_batches(v, t, max_vision=12, max_text=3000, iterations=10, pack_leftovers=False)
    reached = sum(1 for x in b if v[x].sum() >= 12 or t[x].sum() >= 3000 - 128)
    assert reached >= len(b) - b.num_leftover  # every group but those of the last pass


def test_real_data_dist_ratio_beats_the_paper_variant():
    from mmbalance.balancing.datasets import load_sizes

    s = load_sizes()
    tiles = s["image_tiles"].astype(np.int64)[:20000]
    llm = 256 * tiles + s["image_text_tokens"].astype(np.int64)[:20000]
    kw = dict(max_vision=18, max_text=5152, iterations=10, seed=1)
    paper = isf_batches(tiles, llm, pack_leftovers=False, balance_steps=False, num_devices=8, **kw)
    ours = isf_batches(tiles, llm, num_devices=8, **kw)
    sp, so = batch_stats(paper, tiles, llm, 8), batch_stats(ours, tiles, llm, 8)
    assert so.vision_dist_ratio < sp.vision_dist_ratio and so.text_dist_ratio < sp.text_dist_ratio
    assert sp.pad_ratio == so.pad_ratio == 0.0


def test_batch_stats_of_padded_batches():
    v, t = np.array([1, 1, 1, 1]), np.array([10, 20, 30, 40])
    st_ = batch_stats([np.array([0, 1]), np.array([2, 3])], v, t, 2, packed=False)
    assert st_.pad_ratio == pytest.approx((10 + 10) / (40 + 80))
    assert st_.text_dist_ratio == pytest.approx((80 - 40) / (80 * 2))
    assert st_.mean_batch_size == 2.0 and st_.steps == 1


def test_limits_from_statistics():
    assert isf_limits([1, 2, 1, 4], [300, 500, 200, 1000]) == (4, 1000)
    rng = np.random.default_rng(1)
    v, t = rng.integers(1, 5, 3000), rng.integers(100, 1500, 3000)
    qv, qt = isf_limits(v, t, target_batch_size=3.0, iterations=5)
    b = isf_batches(v, t, max_vision=qv, max_text=qt, iterations=5)
    assert 3.0 <= len(v) / len(b) <= 4.0


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: isf_batches([1, 2], [3], max_vision=4, max_text=10), ValueError, "one entry per sample"),
        (lambda: isf_batches([1, -2], [3, 3], max_vision=4, max_text=10), ValueError, "vision"),
        (lambda: isf_batches([1], [3], max_vision=0, max_text=10), ValueError, "max_vision"),
        (lambda: isf_batches([1], [3], max_vision=4, max_text=10.0), TypeError, "max_text"),
        (lambda: isf_batches([1], [3], max_vision=4, max_text=10, iterations=-1), ValueError, "iterations"),
        (lambda: isf_batches([1], [3], max_vision=4, max_text=10, num_devices=0), ValueError, "num_devices"),
        (lambda: dist_ratio([1, -1]), ValueError, "tokens_per_device"),
        (lambda: pad_ratio("abc"), TypeError, "lengths_of_one_batch"),
        (lambda: isf_limits([0, 0], [1, 2]), ValueError, "vision"),
    ],
    ids=[
        "length-mismatch",
        "negative",
        "zero-cap",
        "float-cap",
        "iterations",
        "devices",
        "dist",
        "pad",
        "no-vision",
    ],
)
def test_errors_name_the_argument(call, err, match):
    with pytest.raises(err, match=match):
        call()
