"""Every script in examples/ runs as its docstring says (on CPU ranks, as torchrun starts them), with the
promised output."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.dist_utils import launch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch(
    script: str,
    *args: str,
    nproc: int = 2,
    timeout: float = float(os.environ.get("MMB_EXAMPLE_TIMEOUT", 300)),
) -> str:
    # fresh interpreters, as a user runs them: the examples' ends are the interpreter's own
    return launch(REPO / "examples" / script, *args, nproc=nproc, timeout=timeout, preloaded=False)


def test_hf_qwen2vl_balances_and_keeps_the_losses():
    pytest.importorskip("transformers", minversion="5.6")
    balanced = _launch("hf_qwen2vl.py", "--steps", "3")
    plain = _launch("hf_qwen2vl.py", "--steps", "3", "--no-balance")
    pattern = re.compile(r"step (\d+)\s+loss ([0-9.]+)\s+([0-9.]+) ms\s+(.*)")
    rows_b = [pattern.match(line).groups() for line in balanced.splitlines() if line.startswith("step")]
    rows_p = [pattern.match(line).groups() for line in plain.splitlines() if line.startswith("step")]
    assert len(rows_b) == len(rows_p) == 3
    for (sb, lb, tb, vb), (sp, lp, tp, vp) in zip(rows_b, rows_p):
        assert float(tb) > 0 and float(tp) > 0  # every step says how long it took
        assert sb == sp and abs(float(lb) - float(lp)) <= 2e-6 * abs(float(lp))
        before, after = map(float, re.search(r"vision max/mean ([0-9.]+) -> ([0-9.]+)", vb).groups())
        assert before > 1.5 and after < 1.1
        assert "not balanced" in vp
    assert "median step time" in balanced and "(balanced)" in balanced
    assert "median step time" in plain and "(not balanced)" in plain


def test_hf_trainer_balances_the_padded_micro_batches():
    pytest.importorskip("transformers", minversion="5.6")
    pytest.importorskip("accelerate")
    pattern = re.compile(r"padded tokens per step \(slowest rank per micro-batch, summed\): ([0-9.]+)")
    per_step = {}
    for flag in ((), ("--no-balance",)):
        out = _launch("hf_trainer.py", *flag)
        assert "examples trained: 96 of 96 x 1 epoch(s)" in out
        assert re.search(r"last loss: [0-9.]+", out)
        per_step[bool(flag)] = float(pattern.search(out).group(1))
    assert per_step[False] < 0.6 * per_step[True]


_LONG = re.compile(
    r"step (\d+)  degrees \[([0-9, ]+)\]  largest shard (\d+) of (\d+) tokens  "
    r"max/mean ([0-9.]+) -> ([0-9.]+)  loss ([0-9.]+)  images and frames split over ranks (\d+)"
)


def _long_losses(*flag: str) -> list[float]:
    """``hf_qwen2vl_long.py`` on 4 ranks for 2 steps: every step splits the video and keeps the
    budget; the steps' losses."""
    out = _launch("hf_qwen2vl_long.py", "--steps", "2", *flag, nproc=4)
    rows = [_LONG.match(line) for line in out.splitlines() if line.startswith("step")]
    assert len(rows) == 2 and all(rows), out[-2000:]
    for m in rows:
        degrees = [int(d) for d in m.group(2).split(",")]
        assert max(degrees) >= 3 and sum(degrees) <= 4  # the video over 3 ranks or more
        assert int(m.group(3)) <= int(m.group(4)) == 128  # no shard over the budget
        assert float(m.group(6)) < float(m.group(5))  # max/mean as planned below as drawn
        assert int(m.group(8)) >= 1  # some image or frame straddles shards
    return [float(m.group(7)) for m in rows]


@pytest.fixture(scope="module")
def long_plain_losses():
    pytest.importorskip("transformers", minversion="5.6")
    return _long_losses()


@pytest.mark.parametrize(
    "flag", ["", "--encoder-balance", "--fsdp2"], ids=["plain", "encoder-balance", "fsdp2"]
)
def test_hf_qwen2vl_long_splits_the_video_and_keeps_the_losses(long_plain_losses, flag):
    """Encoder balancing moves the encoding, and FSDP2 the weights and the encoding, not the result
    (one launch a test, each under a minute on the 2-core machine; the plain run is shared)."""
    if not flag:
        assert len(long_plain_losses) == 2
        return
    assert _long_losses(flag) == pytest.approx(long_plain_losses, rel=1e-5)
