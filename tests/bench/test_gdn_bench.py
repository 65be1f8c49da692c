"""``mmbalance bench gdn`` (``bench/cp/gdn.py``) runs end to end on 2 gloo ranks and reports, per
layer, the Gated DeltaNet state hand-off against gathering the sequence: bytes and times from one
run, the hand-off's bytes independent of the length."""

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
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["op"] == "gdn_cp_handoff" and row["degree"] == 2 and row["length"] == 1024, row
    # 8 heads of 64: maps 8 x 64 x 128 floats, the window 3 x (2 x 512 + 512); the gather 512 tokens of 1552
    assert row["handoff_KB"] == (8 * 64 * 128 + 3 * 1536) * 4 / 1e3, row
    assert row["gather_KB"] == 512 * (1536 + 16) * 4 / 1e3, row
    assert row["time_ms"] > 0 and row["gather_ms"] > 0 and row["bytes_ratio"] > 1, row
