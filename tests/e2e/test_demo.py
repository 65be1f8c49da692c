"""The end-to-end demo at a tiny size: balanced and unbalanced training agree, balance improves."""

from __future__ import annotations

import json

import pytest

from mmbalance.bench.demo import train as demo

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_two_ranks_float64(tmp_path):
    out = tmp_path / "demo.json"
    args = demo.parser().parse_args(
        [
            "--ranks",
            "2",
            "--steps",
            "2",
            "--per-rank",
            "6",
            "--dtype",
            "float64",
            "--timeout",
            "120",
            "--ranks-per-node",
            "1",
            "--json",
            str(out),
        ]
    )
    rep = demo.run(args)
    assert rep["max_relative_loss_difference"] <= 1e-6
    data = json.loads(out.read_text())
    assert len(data["losses"]) == 2 and set(data["phases"]) == {"vision", "audio", "llm"}
    for name in ("vision", "audio"):
        ph = data["phases"][name]
        assert ph["after"] < ph["before"], (name, ph)
        assert ph["moved_tokens"] > 0


def test_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ranks"):
        demo.run(demo.parser().parse_args(["--ranks", "3"]))
