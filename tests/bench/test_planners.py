"""The planner benchmark: verl through its own environment (or a recorded reason why not), the
real-path table, the plot, and the reference next-fit plan."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mmbalance.balancing import lower_bound, post_balance
from mmbalance.bench.harness import Row
from mmbalance.bench.planners import peers
from mmbalance.bench.planners import post_balancing as planners

# A stand-in for verl's balancer module: the same function name and signature, round robin.
FAKE_BALANCER = """
def karmarkar_karp(seqlen_list, k_partitions, equal_size):
    {body}
"""
ROUND_ROBIN = "return [list(range(r, len(seqlen_list), k_partitions)) for r in range(k_partitions)]"


def fake_verl(tmp_path, body: str = ROUND_ROBIN) -> str:
    """A directory holding an importable ``verl`` (version 0.0.1) whose balancer runs ``body``."""
    root = tmp_path / "fake_peer"
    (root / "verl" / "utils").mkdir(parents=True)
    (root / "verl" / "__init__.py").write_text("")
    (root / "verl" / "utils" / "__init__.py").write_text("")
    (root / "verl" / "utils" / "seqlen_balancing.py").write_text(FAKE_BALANCER.format(body=body))
    meta = root / "verl-0.0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.0.1\n")
    return str(root)


@pytest.fixture
def peer_env(tmp_path, monkeypatch):
    """This interpreter as the peers' Python, with the fake verl importable in its subprocesses."""
    monkeypatch.setenv(peers.PEERS_PYTHON_VAR, sys.executable)
    monkeypatch.setenv("PYTHONPATH", fake_verl(tmp_path))
    return tmp_path


def test_run_verl_returns_the_peers_partition(peer_env):
    lengths = np.arange(10, dtype=np.int64)
    out = peers.run_verl(sys.executable, lengths, 3, reps=2)
    assert out["dst"].tolist() == [i % 3 for i in range(10)]
    assert out["version"] == "0.0.1" and out["time_ms"] >= 0.0


def test_speed_table_runs_the_peer_in_a_subprocess(peer_env):
    rows = planners.bench_speed([64], full=False)
    kk = [r for r in rows if r.provider == "verl-kk" and r.op == "post_balance[sum]"]
    assert len(kk) == 1
    # the keys every consumer of these rows reads, plus the peer's version
    assert {"makespan/lb", "ours_speedup", "peer_version"} <= set(kk[0].metrics)
    assert kk[0].metrics["makespan/lb"] >= 1.0
    (status,) = [r for r in rows if r.op == "peers"]
    assert status.metrics["available"] is True and status.metrics["python"] == sys.executable


def test_missing_peer_is_said_and_recorded(monkeypatch, capsys):
    monkeypatch.setenv(peers.PEERS_PYTHON_VAR, "/nonexistent/python")
    rows = planners.bench_speed([64], full=False)
    assert not [r for r in rows if r.provider == "verl-kk" and r.op != "peers"]
    (status,) = [r for r in rows if r.op == "peers"]
    assert status.metrics["available"] is False
    assert peers.PEERS_PYTHON_VAR in status.metrics["reason"]
    assert "verl-kk not run" in capsys.readouterr().out


def test_failing_peer_is_said_and_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peers.PEERS_PYTHON_VAR, sys.executable)
    monkeypatch.setenv("PYTHONPATH", fake_verl(tmp_path, "raise RuntimeError('peer broke')"))
    rows = planners.bench_speed([64], full=False)
    (status,) = [r for r in rows if r.op == "peers"]
    assert status.metrics["available"] is False and "peer broke" in status.metrics["reason"]
    assert "peer broke" in capsys.readouterr().out


def test_no_peers_environment_outside_a_source_tree(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.PEERS_PYTHON_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        peers, "__file__", str(tmp_path / "site-packages" / "mmbalance" / "bench" / "planners" / "peers.py")
    )
    python, why = peers.peer_python()
    # a wheel user is told what they can do (the variable and the pip lines), not about make targets
    assert python is None and peers.PEERS_PYTHON_VAR in why and "verl==0.9.1" in why and "make" not in why
    env = tmp_path / ".venv-peers" / "bin"
    env.mkdir(parents=True)
    (env / "python").symlink_to(sys.executable)
    assert peers.peer_python() == (str(env / "python"), "")


def test_no_peers_environment_in_a_source_tree_points_at_make_peers(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.PEERS_PYTHON_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "checkout"
    (root / "mmbalance" / "bench" / "planners").mkdir(parents=True)
    (root / "Makefile").write_text("peers:\n")
    (root / "pyproject.toml").write_text("")
    monkeypatch.setattr(peers, "__file__", str(root / "mmbalance" / "bench" / "planners" / "peers.py"))
    python, why = peers.peer_python()
    assert python is None and "make peers" in why


def test_quick_run_keeps_the_old_rows_and_adds_the_real_path(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.PEERS_PYTHON_VAR, "/nonexistent/python")
    out = tmp_path / "rows.jsonl"
    assert planners.main(["--quick", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["op"], r["provider"]): r for r in rows}
    for key in [
        ("post_balance[sum]", "mmbalance"),
        ("post_balance[sum]", "python-lpt"),
        ("locality[sum]", "mmbalance"),
    ]:
        assert {"op", "provider", "shape", "dtype", "device", "time_ms", "sha", "makespan/lb"} <= set(by[key])
    assert by[("peers", "verl-kk")]["available"] is False  # --quick never starts the peer
    for policy in ("sum", "quadratic", "padded", "conv"):
        for mode in planners.REAL_PATH_MODES:
            r = by[(f"real_path[{policy}]", mode)]
            assert r["shape"] == "64x60" and r["time_ms"] > 0
            assert r["makespan/lb"] >= 1.0 - 1e-9
            assert 0.0 <= r["moved%"] <= 100.0
    # the located plans move far fewer tokens than the plain one
    assert by[("real_path[sum]", "src_ranks+rpn8")]["moved%"] < by[("real_path[sum]", "plain")]["moved%"] / 4


def test_plot_has_the_scaling_panel(tmp_path):
    rows = [
        Row("post_balance[sum]", prov, f"{d}x60", "int64", "cpu", t * d, {"makespan/lb": 1.0})
        for d in (64, 256)
        for prov, t in (("mmbalance", 0.01), ("python-lpt", 0.1))
    ]
    rows += [
        Row(f"real_path[{p}]", mode, f"{d}x60", "int64", "cpu", 0.01 * d, {"makespan/lb": 1.1})
        for d in planners.SERIES_RANKS
        for p in ("sum", "conv")
        for mode in planners.REAL_PATH_MODES
    ]
    path = tmp_path / "sub" / "planners.png"
    planners.plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_target_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(planners, "bench_speed", lambda *a, **k: pytest.fail("ran before checking --plot"))
    assert planners.main(["--quick", "--plot", str(tmp_path)]) == 2
    assert "--plot" in capsys.readouterr().err


def test_real_path_ranks():
    ns = lambda **kw: type("A", (), {"quick": False, "full": False, "plot": None, **kw})  # noqa: E731
    assert planners.real_path_ranks(ns(quick=True)) == [64]
    assert planners.real_path_ranks(ns()) == [2560, 16384]
    assert planners.real_path_ranks(ns(plot="p.png")) == planners.SERIES_RANKS
    assert planners.real_path_ranks(ns(full=True)) == [64, 256, 1024, 2560, 4096, 16384]


@pytest.mark.parametrize("policy", ["padded", "conv", "padded_quadratic"])
def test_next_fit_is_a_valid_plan_between_the_bound_and_the_cost_of_one_batch(policy):
    rng = np.random.default_rng(3)
    for d in (1, 3, 8):
        lengths = np.where(rng.random(200) < 0.3, 0, rng.integers(1, 900, 200))
        dst = planners.next_fit(lengths, d, policy, 1.0, 1.0 / 64)
        assert dst.shape == lengths.shape and dst.min() >= 0 and dst.max() < d
        got = float(post_balance(lengths, d, policy, alpha=1.0, beta=1.0 / 64).batch_costs(dst).max())
        assert got >= lower_bound(lengths, d, policy, alpha=1.0, beta=1.0 / 64) * (1 - 1e-12)
        if policy == "padded":  # contiguous next-fit is optimal there, as is post_balance
            assert got == post_balance(lengths, d, "padded").makespan
