"""``mmbalance bench sampler --quick``: one row per sampler and configuration, JSON rows, and the
modelled micro-batch costs against a float64 reference written here."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers", minversion="5.6")

from mmbalance import cli  # noqa: E402
from mmbalance.balancing import DEFAULT_BETA  # noqa: E402
from mmbalance.bench.planners import sampler  # noqa: E402


def test_quick_run_through_the_command_line(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "sampler", "--quick", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == len(sampler.DATASETS) * 2 * 2  # data x G x mode at 8 ranks, batch 4
    assert len(rows) == 3 * len(shapes)
    for r in rows:
        assert r["op"] == "sampler" and r["provider"] in sampler.PROVIDERS
        assert r["step"] > 0 and r["slot_max_mean"] >= 1.0 and 0 <= r["empty"] <= 1 and r["iter_s"] > 0
    ours = [r for r in rows if r["provider"] == "mmbalance"]
    assert all(r["empty"] == 0 for r in ours)
    assert "| data | mode | G |" in capsys.readouterr().out


def test_micro_costs_against_a_reference():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 5000, 300)
    steps, g, d = 3, 2, 4
    step, slot, rank = rng.integers(0, steps, 300), rng.integers(0, g, 300), rng.integers(0, d, 300)
    for padded in (False, True):
        cost, count = sampler.micro_costs(lengths, step, slot, rank, steps, g, d, padded)
        for s in range(steps):
            for k in range(g):
                for r in range(d):
                    l = lengths[(step == s) & (slot == k) & (rank == r)].astype(np.float64)
                    if padded:
                        want = l.size * (l.max() + DEFAULT_BETA * l.max() ** 2) if l.size else 0.0
                    else:
                        want = float((l + DEFAULT_BETA * l * l).sum())
                    assert cost[s, k, r] == pytest.approx(want, rel=1e-12)
                    assert count[s, k, r] == l.size
