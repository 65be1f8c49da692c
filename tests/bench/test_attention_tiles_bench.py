"""The tile sweep (``python -m mmbalance.bench.attention.tiles``): its candidates, its check, its
command on CPU (the interpreter, small shapes) and its audit for sm_90.

The GPU timings need a GPU; here the same code path runs under Triton's interpreter, so the sweep
that a GPU session runs once has run end to end before: candidates checked against the reference,
a wrong one dropped, rows written, winners printed, the budget and the parallel warm-up honoured.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from mmbalance.bench.attention import tiles
from mmbalance.bench.kernel_audit import audit as kernel_audit
from mmbalance.kernels.attention_common import bwd_config, fwd_config
from tests import procs

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], interpret: bool = True, code: str | None = None, timeout: int = 300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "mmbalance.bench.attention.tiles"]
    return procs.run(cmd + args, cwd=REPO, env=env, timeout=timeout)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------ candidates
@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,softcap", [(128, False), (128, True), (64, False)])
def test_candidates_start_with_the_table_and_repeat_nothing(capability, dtype, head_dim, softcap):
    f = fwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap)
    b = bwd_config(head_dim, torch.device("cuda"), dtype, capability=capability, softcap=softcap)
    fwd = tiles.fwd_candidates(head_dim, dtype, capability, softcap=softcap)
    assert fwd[0] == {k: f[k] for k in tiles.FWD_KEYS}
    bwd = tiles.bwd_candidates(head_dim, dtype, capability, softcap=softcap)
    assert set(bwd) == {"dq", "kv"}
    for pass_, keys in tiles.PASS_KEYS.items():
        assert bwd[pass_][0] == {k: b[k] for k in keys}
    for cands in (fwd, bwd["dq"], bwd["kv"]):
        assert len(cands) > 4
        labels = [tuple(sorted(c.items())) for c in cands]
        assert len(set(labels)) == len(labels)
        for c in cands:
            m, n, w, s = c.values()
            assert m in (16, 32, 64, 128) and n in (16, 32, 64, 128) and w in (4, 8) and s in (1, 2, 3)


def test_the_sweeps_shapes_are_the_ones_of_the_acceptance():
    gpu = {n: s for n, s in tiles.SHAPES.items() if not n.startswith("smoke")}
    assert {(s.n_seqs, s.seqlen, s.head_dim, s.causal) for s in gpu.values()} == {
        (8, 2048, 128, False), (8, 2048, 128, True), (32, 512, 64, True)}  # fmt: skip
    assert gpu["d128-causal-softcap"].softcap > 0 and gpu["d128-causal-sinks"].sinks
    for s in tiles.SHAPES.values():
        assert s.plain is None or (tiles.SHAPES[s.plain].softcap == 0 and not tiles.SHAPES[s.plain].sinks)


def test_acceptance_rule():
    eps = torch.finfo(torch.bfloat16).eps
    assert tiles.accepted(0.0, 0.0, torch.bfloat16)
    assert tiles.accepted(2 * 0.01 + eps, 0.01, torch.bfloat16)
    assert not tiles.accepted(2 * 0.01 + 2 * eps, 0.01, torch.bfloat16)
    assert not tiles.accepted(math.nan, 0.0, torch.float32)
    assert not tiles.accepted(1e-5, 1e-7, torch.float32)
    tol = tiles.TABLE_TOLERANCE[torch.bfloat16]
    # a table that is NaN or itself off the reference: half the tolerance, never more than all of it
    assert tiles.accepted(0.9 * tol, math.nan, torch.bfloat16)
    assert not tiles.accepted(1.1 * tol, math.nan, torch.bfloat16)
    assert not tiles.accepted(0.2, 0.3, torch.bfloat16)


def test_row_error_sees_an_error_confined_to_a_few_rows():
    """The sweep's second check: a kernel that skips keys for the last queries of a causal
    sequence (whose outputs are small) is far off in those rows, yet within any tolerance scaled
    by the largest output."""
    g = torch.Generator().manual_seed(0)
    n, d = 2048, 128
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    s = (q @ k.T) / math.sqrt(d)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    good = torch.softmax(s, 1) @ v
    dropped = s.clone()
    dropped[-64:, 100:108] = -math.inf  # 8 keys lost for the last 64 queries
    bad = torch.softmax(dropped, 1) @ v
    rel_to_max = ((bad - good).abs().max() / good.abs().max()).item()
    assert rel_to_max < tiles.CONSISTENCY_TOLERANCE[torch.bfloat16] < 0.1  # diluted by the first rows
    assert tiles.row_error(bad[:, None], good[:, None]) > 5 * tiles.CONSISTENCY_TOLERANCE[torch.bfloat16]
    assert tiles.row_error(good[:, None], good[:, None]) == 0.0
    # each LSE value is a row of its own; equal infinities agree; NaN where the reference is finite
    lse = torch.tensor([[1.0, -math.inf, 3.0]])
    assert tiles.row_error(lse, lse) == 0.0
    assert tiles.row_error(lse + torch.tensor([[0.0, 0.0, 0.03]]), lse) == pytest.approx(0.01)
    assert math.isnan(tiles.row_error(torch.tensor([[math.nan, 1.0, 3.0]]), lse))
    assert tiles.row_error(torch.empty(0, 2, 4), torch.empty(0, 2, 4)) == 0.0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--warm-jobs", "-1"], "--warm-jobs must be at least 0"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--budget-s", "0"], "--budget-s must be positive"),
        (["--shapes", "d128-causal", "bogus"], "--shapes: unknown ['bogus']"),
        (["--device", "tpu"], "--device must be cuda or cpu"),
        (["--arch", "hopper", "--audit-only"], "--arch must look like sm_90"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    assert tiles.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_process_with_the_compiled_kernels_loaded_is_told_to_start_afresh(capsys):
    import mmbalance.kernels.dispatch  # noqa: F401 - loaded as the test process has them
    from mmbalance.kernels.dispatch import INTERPRET

    argv = ["--audit-only"] if INTERPRET else ["--device", "cpu"]
    assert tiles.main(argv) == 2
    assert "run in a fresh process" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the command
@pytest.mark.slow
def test_the_sweep_runs_end_to_end_under_the_interpreter(tmp_path):
    out = tmp_path / "tiles.jsonl"
    # --warm-jobs: the pool of spawned processes a GPU run compiles in, here through `python -m`
    proc = _run(["--device", "cpu", "--shapes", "smoke-mini", "smoke-mini-sinks", "--limit", "2",
                 "--warm-jobs", "2", "--json", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    for shape in ("smoke-mini", "smoke-mini-sinks"):
        mine = [r for r in rows if r["shape"] == shape]
        for op in ("tiles_fwd", "tiles_bwd_dq", "tiles_bwd_kv"):
            ran = [r for r in mine if r["op"] == op]
            assert [r["provider"] for r in ran] == ["table", "candidate"], (shape, op)
            assert ran[0]["tiles"] == "M16 N16 w4 s1"  # the interpreter's table
            for r in ran:
                assert r["status"] == "unaudited" and r["rel_err"] < 1e-5 and r["time_ms"] > 0
                assert r["vs_table"] > 0 and r["tflops"] > 0
        together = {r["provider"]: r for r in mine if r["op"] == "tiles_fwd_bwd"}
        assert set(together) == (
            {"table", "best", "torch_sdpa"} if shape == "smoke-mini" else {"table", "best"}
        )
        assert together["best"]["tiles"].startswith("fwd M")
    sinks = {
        r["provider"]: r for r in rows if r["shape"] == "smoke-mini-sinks" and r["op"] == "tiles_fwd_bwd"
    }
    assert sinks["best"]["vs_plain"] > 0 and "vs_sdpa" not in sinks["best"]
    assert "== winners" in proc.stdout and "smoke-mini-sinks: fwd {'BLOCK_M'" in proc.stdout


_CORRUPT = """
import os, sys
import mmbalance.bench.attention.tiles as T
fwd, bwd = T.Case.fwd, T.Case.bwd
def bad_fwd(self, cfg, out=None, lse=None):
    o, l = fwd(self, cfg, out, lse)
    if cfg["BLOCK_N"] == 32:
        o[5, 0, 3] += 0.01  # one element of one row
    return o, l
def bad_bwd(self, cfg, out, lse):
    g = bwd(self, cfg, out, lse)
    if cfg["kv_BLOCK_N"] == 64:
        g[1][7, 0, 1] += 0.01
    return g
T.Case.fwd, T.Case.bwd = bad_fwd, bad_bwd
if os.environ.get("NO_REFERENCE_CHECK"):  # the row-by-row check against the table alone
    import mmbalance.bench.attention.tiles.sweep as S
    S.accepted = lambda *args: True
sys.exit(T.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("check", ["reference", "table"])
def test_a_candidate_off_the_reference_or_the_table_is_dropped(tmp_path, monkeypatch, check):
    if check == "table":
        monkeypatch.setenv("NO_REFERENCE_CHECK", "1")
    out = tmp_path / "tiles.jsonl"
    proc = _run(["--device", "cpu", "--shapes", "smoke-mini", "--limit", "2", "--json", str(out)],
                code=_CORRUPT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["op"], r["provider"]): r for r in _rows(out)}
    says = "check: error" if check == "reference" else "check: a row"
    dropped = rows[("tiles_fwd", "candidate")]
    assert dropped["tiles"] == "M16 N32 w4 s1" and dropped["status"].startswith(says), dropped
    assert math.isnan(dropped["time_ms"])
    assert rows[("tiles_bwd_kv", "candidate")]["status"].startswith(says)
    kept = rows[("tiles_bwd_dq", "candidate")]
    assert kept["status"] == "unaudited" and kept["time_ms"] > 0  # untouched: kept and timed
    best = rows[("tiles_fwd_bwd", "best")]["tiles"]
    # the dropped candidates are never the best; the kept dq candidate competes on its time
    assert "fwd M16 N16" in best and "kv M16 N16" in best
    assert ("dq M16 N32" in best) == (kept["time_ms"] < rows[("tiles_bwd_dq", "table")]["time_ms"]), (
        best,
        rows,
    )


_BUDGET = """
import time, torch
import mmbalance.bench.attention.tiles as T
shape = T.SHAPES["smoke-mini"]
cands = {"fwd": T.fwd_candidates(16, torch.float32, 0, interpret=True)[:3],
         **{p: c[:3] for p, c in T.bwd_candidates(16, torch.float32, 0, interpret=True).items()}}
rows, winners = T.sweep_shape(shape, "cpu", torch.float32, cands, {}, deadline=time.monotonic() - 1)
by = {}
for r in rows:
    by.setdefault((r.op, r.provider), []).append(r.metrics.get("status"))
print(sorted(by.items()))
assert by[("tiles_fwd", "table")] == ["unaudited"] and by[("tiles_fwd", "candidate")] == ["budget"] * 2
assert by[("tiles_bwd_dq", "candidate")] == ["budget"] * 2 and by[("tiles_bwd_kv", "candidate")] == ["budget"] * 2
assert set(winners) == {"fwd", "dq", "kv", "fwd_bwd_ms"}
print("budget ok")
"""


@pytest.mark.slow
def test_past_the_budget_only_the_tables_run_and_no_shape_starts(tmp_path):
    proc = _run([], code=_BUDGET)
    assert proc.returncode == 0 and "budget ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "none.jsonl"
    proc = _run(["--device", "cpu", "--shapes", "smoke-full", "--budget-s", "1e-9", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not started, past --budget-s: smoke-full" in proc.stdout and not out.exists()


_WARM = """
import os, time, torch
import mmbalance.bench.attention.tiles as T
shape = T.SHAPES["smoke-mini"]
good = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
bad = dict(BLOCK_M=48, BLOCK_N=16, num_warps=4, num_stages=1)  # not a power of two
table = T.table_config(T.make_case(shape, "cpu", torch.float32, with_reference=False), "bwd")
job = lambda p, cfg: (shape.name, "float32", "cpu", p, cfg)
warmer = T.Warmer(2)
errors = warmer.run([job("fwd", good), job("fwd", bad), job("dq", table)], time.monotonic() + 120)
assert list(errors) == [1] and "power of 2" in errors[1], errors
print("warm errors:", errors)
# a worker that dies (as after a sticky device error) breaks the pool: rebuilt once, then the jobs fail
from tests.bench.test_attention_tiles_bench import die_or_pass
dying = T.Warmer(2, fn=die_or_pass)
t0 = time.monotonic()
errors = dying.run([job("fwd", good), job("fwd", dict(good, die=True)), job("fwd", good)], t0 + 120)
print("dying:", errors)
assert errors[1] == "a warm-up process died twice on this shape's remaining candidates", errors
assert time.monotonic() - t0 < 60
dying.close()
# past the deadline nothing is waited for
t0 = time.monotonic()
assert warmer.run([job("fwd", good)] * 4, time.monotonic() - 1) == {}
assert time.monotonic() - t0 < 5
warmer.close()
print("warmer ok")
"""


def die_or_pass(job):
    """A warm-up worker's job that kills its process when its configuration says ``die``."""
    if job[-1].get("die"):
        os._exit(70)
    return None


@pytest.mark.slow
def test_the_warm_up_launches_each_candidate_in_the_pool_and_survives_a_dying_worker():
    proc = _run([], code=_WARM)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "warm errors: {1: " in proc.stdout and "warmer ok" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(kernel_audit.ptxas_path(90) is None, reason="no ptxas (Triton's bundled one or on PATH)")
def test_audit_only_compiles_the_candidates_for_sm90(tmp_path):
    out = tmp_path / "audit.jsonl"
    proc = _run(["--audit-only", "--arch", "sm_90", "--shapes", "d64-causal-short", "--limit", "2", "--jobs", "2",
                 "--json", str(out)], interpret=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["op"] for r in rows] == ["tiles_audit_fwd"] * 2 + ["tiles_audit_dq"] * 2 + [
        "tiles_audit_kv"
    ] * 2
    assert [r["provider"] for r in rows] == ["table", "candidate"] * 3
    for r in rows:
        assert r["registers"] > 0 and r["tensor_cores"] == "wgmma", r
        assert r["status"] == "ok" or r["status"].startswith("audit: spill"), r
    assert all(r["status"] == "ok" for r in rows if r["provider"] == "table")
