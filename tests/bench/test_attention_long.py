"""The long-sequence CPU case of ``bench attention`` runs end to end at a tiny size and reports
time and peak memory for both variants with the ratios (the numbers themselves are not asserted:
performance is what the benchmark measures)."""

from __future__ import annotations

import math

from mmbalance.bench.attention import long as bench


def test_long_case_reports_time_memory_and_ratios():
    rows = bench.bench_long(96, heads=2, head_dim=16, rounds=1)
    assert [r.provider for r in rows] == ["mmbalance", "torch_sdpa"]
    for r in rows:
        assert r.op == "attention_long_fwd_bwd" and r.time_ms > 0
        assert r.metrics["peak_mib"] > 0 and r.metrics["added_mib"] >= 0
    ours = rows[0].metrics
    for key in ("time_vs_sdpa", "peak_vs_sdpa"):
        assert math.isfinite(ours[key]) and ours[key] > 0
    assert "added_vs_sdpa" in ours
