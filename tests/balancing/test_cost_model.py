"""CostModel: the formula, fitting (exact recovery, reported error), validation, the profiler."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmbalance.balancing import CostModel, FitReport, Measurement, cp_schedule
from tests import procs

SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def plain_time(m: CostModel, lengths, d: int) -> float:
    """DHP eqs. 8-10 written out: compute + ring - min(attention compute, ring comm)."""
    if len(lengths) == 0:
        return 0.0
    if m.padded:
        lengths = [max(lengths)] * len(lengths)
    eta = 1.0 if m.mask == "full" else 0.0
    s1 = float(sum(lengths))
    s2 = float(sum(x * x for x in lengths))
    t_attn = m.attention * (1 + eta) * s2 / d
    t_ring = (m.ring * s1 * (d - 1) / d + m.ring_latency * (d - 1)) if d > 1 else 0.0
    t_cp = m.fixed + m.linear * s1 / d + t_attn
    return t_cp + t_ring - (min(t_attn, t_ring) if m.overlap else 0.0)


coef = st.floats(0.0, 10.0, allow_nan=False)
models = st.builds(
    CostModel,
    linear=coef,
    attention=st.floats(0.0, 1e-3),
    ring=st.floats(0.0, 1.0),
    ring_latency=coef,
    fixed=coef,
    mask=st.sampled_from(["causal", "full"]),
    overlap=st.booleans(),
    padded=st.booleans(),
)


@SETTINGS
@given(m=models, lengths=st.lists(st.integers(0, 5000), max_size=8), d=st.integers(1, 9))
def test_time_matches_the_papers_formula(m, lengths, d):
    assert m.time(lengths, d) == pytest.approx(plain_time(m, lengths, d), rel=1e-12, abs=1e-12)


def test_orchmllm_eq2_both_forms():
    m = CostModel.orchmllm(2.0, 0.5)
    assert m.time([1, 2, 3]) == 2.0 * 6 + 0.5 * 14
    p = CostModel.orchmllm(2.0, 0.5, padded=True)
    assert p.time([1, 2, 3]) == 2.0 * 9 + 0.5 / 3 * 9**2  # alpha L + beta / b * L^2, L = b * max


def test_memory_and_token_budget():
    m = CostModel(memory_per_token=4.0, memory_static=100.0)
    assert m.memory([10, 20], degree=3) == pytest.approx(4.0 * 30 / 3 + 100.0)
    assert m.tokens_per_rank(500.0) == 100
    with pytest.raises(ValueError, match="memory_bytes"):
        m.tokens_per_rank(50.0)


@SETTINGS
@given(
    linear=st.floats(1e-6, 1e-3),
    attention=st.floats(1e-10, 1e-7),
    ring=st.floats(0.0, 1e-4),
    latency=st.floats(0.0, 1e-2),
    fixed=st.floats(0.0, 1e-1),
    overlap=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fit_recovers_noiseless_coefficients(linear, attention, ring, latency, fixed, overlap, seed):
    true = CostModel(
        linear=linear, attention=attention, ring=ring, ring_latency=latency, fixed=fixed, overlap=overlap
    )
    rng = np.random.default_rng(seed)
    meas = []
    for _ in range(40):
        lengths = rng.integers(64, 40000, rng.integers(1, 4)).tolist()
        d = int(rng.integers(1, 9))
        meas.append(Measurement(tuple(lengths), d, true.time(lengths, d)))
    fit = CostModel.fit(meas, overlap=overlap)
    assert isinstance(fit.fit_report, FitReport)
    assert fit.fit_report.max_error < 1e-6
    if not overlap:
        # additive: every coefficient is identifiable, so unseen groups are predicted too (with the
        # overlap max, a branch no measurement is on leaves its coefficients free)
        probe = [(rng.integers(64, 40000, 2).tolist(), int(rng.integers(1, 9))) for _ in range(20)]
        for lengths, d in probe:
            assert fit.time(lengths, d) == pytest.approx(true.time(lengths, d), rel=1e-4)


def test_fit_reports_error_on_noisy_data():
    true = CostModel.transformer()
    rng = np.random.default_rng(7)
    meas = []
    for _ in range(80):
        lengths = rng.integers(500, 60000, rng.integers(1, 4))
        d = int(rng.integers(1, 9))
        meas.append((lengths, d, true.time(lengths, d) * (1 + 0.03 * rng.standard_normal())))
    fit = CostModel.fit(meas)
    assert 0.0 < fit.fit_report.mean_error < 0.05
    assert fit.fit_report.count == 80
    held_out = [(x[0], x[1], true.time(x[0], x[1])) for x in meas[:20]]
    assert fit.error(held_out).mean_error < 0.05
    assert "mean" in str(fit.fit_report)


def test_fit_single_rank_only_fits_no_ring_terms():
    true = CostModel(linear=2.0, attention=1e-3, fixed=5.0)
    meas = [([n], true.time([n])) for n in (10, 100, 400, 1000, 3000)]
    fit = CostModel.fit(meas)
    assert (fit.ring, fit.ring_latency) == (0.0, 0.0)
    assert (
        fit.linear == pytest.approx(2.0)
        and fit.attention == pytest.approx(1e-3)
        and fit.fixed == pytest.approx(5.0)
    )


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"linear": -1.0}, ValueError, "linear"),
        ({"attention": float("nan")}, ValueError, "attention"),
        ({"ring": "1"}, TypeError, "ring"),
        ({"mask": "sliding"}, ValueError, "mask"),
        ({"memory_per_token": 0.0}, ValueError, "memory_per_token"),
    ],
    ids=["negative", "nan", "string", "mask", "zero-memory"],
)
def test_invalid_coefficients(kwargs, err, match):
    with pytest.raises(err, match=match):
        CostModel(**kwargs)


@pytest.mark.parametrize(
    "meas, err, match",
    [
        ([([10], 0.0)] * 5, ValueError, r"measurements\[0\].seconds"),
        ([([10], 1.0)], ValueError, "at least"),
        ([], ValueError, "empty"),
        ([([-1], 1.0)] * 5, ValueError, r"measurements\[0\].lengths"),
        ([([10], 0, 1.0)] * 5, ValueError, r"measurements\[0\].degree"),
        (["x"] * 5, TypeError, r"measurements\[0\]"),
    ],
    ids=["zero-time", "too-few", "empty", "negative-length", "zero-degree", "not-a-measurement"],
)
def test_invalid_measurements(meas, err, match):
    with pytest.raises(err, match=match):
        CostModel.fit(meas)


def test_time_validates_arguments():
    m = CostModel()
    with pytest.raises(ValueError, match="degree"):
        m.time([1, 2], degree=0)
    with pytest.raises(ValueError, match="lengths"):
        m.time([1, -2])


def test_balancing_import_stays_torch_free():
    code = (
        "import sys; import mmbalance.balancing as b; assert 'torch' not in sys.modules; "
        "b.cp_schedule([5, 6], 2, 8); assert 'torch' not in sys.modules; print('ok')"
    )
    out = procs.run([sys.executable, "-c", code], timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sum", "overlap"])
def test_predict_is_time_from_aggregates(rng, padded, overlap):
    model = CostModel(
        linear=1e-3, attention=2e-7, ring=3e-4, ring_latency=0.01, fixed=0.5, overlap=overlap, padded=padded
    )
    groups = [rng.integers(1, 4000, size=int(rng.integers(1, 6))) for _ in range(7)]
    x = [g.astype(np.float64) for g in groups]
    s1 = np.array([g.size * g.max() if padded else g.sum() for g in x])
    s2 = np.array([g.size * g.max() ** 2 if padded else (g * g).sum() for g in x])
    for d in (1, 2, 3, 8):
        got = model.predict(s1, s2, np.float64(d))
        want = [model.time(g, degree=d) for g in groups]
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("overlap", [True, False])
def test_with_encoder_is_each_sequence_alone_plus_its_encoder_share(overlap):
    rng = np.random.default_rng(3)
    model = CostModel(linear=1e-4, attention=1e-8, ring=2e-5, ring_latency=1e-3, fixed=0.01, overlap=overlap)
    lengths = np.array([0, 1, 7, 300, 4096, 20000])
    enc = rng.random(lengths.size) * (lengths > 0)
    cost = model.with_encoder(enc)
    for d in (1, 2, 3, 7):
        want = [model.time([n], d) + e / d if n else 0.0 for n, e in zip(lengths.tolist(), enc.tolist())]
        np.testing.assert_allclose(cost(lengths, d), want, rtol=1e-12, atol=0)
    sched = cp_schedule(lengths, 8, 4096, cost)  # the planner takes it as a per-sequence cost
    assert sorted(np.concatenate([g.sequences for g in sched]).tolist()) == list(range(lengths.size))


def test_with_encoder_refuses_bad_input():
    with pytest.raises(ValueError, match="encoder_seconds"):
        CostModel().with_encoder([1.0, -1.0])
    with pytest.raises(ValueError, match="encoder_seconds"):
        CostModel().with_encoder([np.nan])
    with pytest.raises(ValueError, match="made for 2 sequences"):
        CostModel().with_encoder([1.0, 2.0])(np.array([1, 2, 3]), 1)


def test_step_with_encoders_is_the_busiest_encoder_share_plus_the_slowest_group():
    rng = np.random.default_rng(5)
    model = CostModel(linear=1e-4, attention=1e-8, ring=2e-5, ring_latency=1e-3, fixed=0.01)
    for _ in range(20):
        lengths = rng.integers(1, 5000, int(rng.integers(1, 14)))
        enc = rng.random(lengths.size)
        sched = cp_schedule(lengths, 8, 8192, model.with_encoder(enc))
        encode = max(sum(enc[i] for i in g.sequences) / g.degree for g in sched)
        llm = max(model.time([lengths[i] for i in g.sequences], g.degree) for g in sched)
        assert model.step_with_encoders(sched, lengths, enc) == pytest.approx(encode + llm, rel=1e-12)
    with pytest.raises(ValueError, match="encoder_seconds has 1 entries for 2 sequences"):
        model.step_with_encoders(sched, [1, 2], [0.5])
