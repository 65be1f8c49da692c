"""``mmbalance bench gdn`` (``bench/cp/gdn.py``) runs end to end on 2 gloo ranks and reports, per
layer, the Gated DeltaNet state hand-off against gathering the sequence: bytes and times from one
run, the hand-off's bytes independent of the length; and the maps' backward memory, the fused
kernel's buffers against what autograd keeps through the reference."""

from __future__ import annotations

import json
import sys

from tests import procs


def test_the_quick_sweep_reports_the_handoff_against_the_gather(tmp_path):
    out = tmp_path / "rows.jsonl"
    done = procs.run(
        [sys.executable, "-m", "mmbalance.bench.cp.gdn", "--quick", "--json", str(out)], timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    back, row = [json.loads(line) for line in out.read_text().splitlines()]
    assert back["op"] == "gdn_maps_backward" and back["piece"] == 512, back
    # the fused kernel as compiled (a GPU's blocks): checkpoints and one segment of 23 states (sqrt 512
    # rounded up) a program, 8 heads x 2 column blocks of 64 x 64, and the partial sums (2 blocks)
    segs = 23 + (512 + 22) // 23
    assert back["fused_MB"] == 4 * (16 * segs * 64 * 64 + 2 * 512 * 8 * 66) / 1e6, back
    # autograd keeps at least one state (8 x 64 x 128 floats) a token through the reference
    assert back["reference_MB"] >= 512 * 8 * 64 * 128 * 4 / 1e6 and back["memory_ratio"] > 5, back
    assert row["op"] == "gdn_cp_handoff" and row["degree"] == 2 and row["length"] == 1024, row
    # 8 heads of 64: maps 8 x 64 x 128 floats, the window 3 x (2 x 512 + 512); the gather 512 tokens of 1552
    assert row["handoff_KB"] == (8 * 64 * 128 + 3 * 1536) * 4 / 1e3, row
    assert row["gather_KB"] == 512 * (1536 + 16) * 4 / 1e3, row
    assert row["time_ms"] > 0 and row["gather_ms"] > 0 and row["bytes_ratio"] > 1, row
