"""The what-if simulator: hand-computed costs, strategies, and clear errors on bad data files."""

from __future__ import annotations

import numpy as np
import pytest

from mmbalance.balancing.datasets import ExampleSizes
from mmbalance.bench.planners import simulate as sim


def test_phase_times_by_hand():
    tower = sim.Tower(layers=1, hidden=1, ffn=1)  # alpha = 6 * (4 + 2) = 36, beta = 12
    assert tower.alpha == 36 and tower.beta == 12
    lengths = np.array([2, 3, 0])
    dst = np.array([0, 0, 1])
    packed = sim.phase_times(lengths, dst, 2, tower, padded=False) * sim.PEAK_FLOPS
    np.testing.assert_allclose(packed, [36 * 5 + 12 * (4 + 9), 0.0])
    padded = sim.phase_times(lengths, dst, 2, tower, padded=True) * sim.PEAK_FLOPS
    np.testing.assert_allclose(padded, [36 * 2 * 3 + 12 * 2 * 9, 0.0])  # the empty example is not a row
    causal = sim.Tower(layers=1, hidden=1, ffn=1, causal=True)
    assert causal.beta == 6


def test_small_case_by_hand():
    # two ranks, two examples each; LLM-only text, no encoders
    model = sim.ModelConfig(sim.Tower(1, 1, 1, True), sim.Tower(1, 1, 1), sim.Tower(1, 1, 1), 1, 1)
    z = np.zeros(4, dtype=np.int64)
    s = ExampleSizes(z, z, z, z, np.array([10, 10, 1, 1]), z)
    plans = sim.plan_step(s, 2, model)
    assert plans["none"]["llm"].tolist() == [0, 0, 1, 1]
    for st in ("llm-only", "per-phase", "ours"):
        assert sorted(np.bincount(plans[st]["llm"], weights=s.text).tolist()) == [11, 11]
    # no balancing: rank 0 has [10, 10]: 36 * 20 + 6 * 200 = 1920 FLOPs; balanced: [10, 1]: 36 * 11 + 6 * 101
    t_none = sim.phase_times(s.text, plans["none"]["llm"], 2, model.llm, False).max() * sim.PEAK_FLOPS
    t_ours = sim.phase_times(s.text, plans["ours"]["llm"], 2, model.llm, False).max() * sim.PEAK_FLOPS
    assert t_none == pytest.approx(1920) and t_ours == pytest.approx(36 * 11 + 6 * 101)


def test_simulate_rows_and_speedups():
    from mmbalance.balancing.datasets import mixture

    rows = sim.simulate(mixture(5000, 1), [8], sim.MODELS["mllm-10b"], per_rank=20, steps=2)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == set(sim.STRATEGIES)
    assert by["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert by["ours"]["step_s"] <= by["none"]["step_s"]
    assert by["ours"]["llm_imb"] <= by["none"]["llm_imb"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.csv", "vision,audio,text\n10,0,5\n3,x,4\n", "line 3: 'audio'"),
        ("neg.csv", "vision,audio,text\n-1,0,5\n", "line 2: 'vision'"),
        ("nohdr.csv", "1,2,3\n", "line 1"),
        ("bad.jsonl", '{"vision": 1, "audio": 0, "text": 3}\n{"vision": 2,\n', "line 2"),
        ("frac.jsonl", '{"vision": 1.5, "audio": 0, "text": 3}\n', "line 1: 'vision'"),
        ("empty.csv", "vision,audio,text\n", "no examples"),
    ],
)
def test_bad_data_files_name_the_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        sim.load_table(str(path))


def test_cli_reports_bad_file(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("vision,audio,text\n1,2,three\n")
    assert sim.main(["--data", str(path), "--ranks", "2"]) == 2
    assert "line 2" in capsys.readouterr().err


def test_user_file_runs(tmp_path):
    path = tmp_path / "mine.jsonl"
    rng = np.random.default_rng(0)
    path.write_text(
        "".join(
            f'{{"vision": {int(v)}, "audio": {int(a)}, "text": {int(t)}}}\n'
            for v, a, t in zip(rng.integers(0, 3000, 64), rng.integers(0, 500, 64), rng.integers(1, 900, 64))
        )
    )
    assert sim.main(["--data", str(path), "--ranks", "2,4", "--per-rank", "8", "--steps", "2"]) == 0
