"""Every script in examples/ runs as its docstring says (on CPU ranks, as torchrun starts them), with the
promised output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    script: str,
    *args: str,
    nproc: int = 2,
    timeout: float = float(os.environ.get("MMB_EXAMPLE_TIMEOUT", 300)),
) -> str:
    """Run ``script`` on ``nproc`` ranks with the environment ``torchrun`` gives its workers.

    The workers are started here rather than through torchrun, whose workers live in sessions of
    their own: a timeout here kills every worker, so a hung example fails the test instead of
    leaving the suite waiting on pipes that a stray worker holds open. Returns rank 0's stdout.
    """
    port = str(_free_port())
    procs, logs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for rank in range(nproc):
                env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
                logs.append(open(os.path.join(tmp, f"rank{rank}.log"), "w+"))  # noqa: SIM115 - closed below
                procs.append(subprocess.Popen([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO,
                                              env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True))  # fmt: skip
            deadline, timed_out = time.monotonic() + timeout, False
            for proc in procs:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            outs = []
            for log in logs:
                log.seek(0)
                outs.append(log.read())
                log.close()
    if timed_out:
        tails = "".join(f"--- rank {r}\n{out[-2000:]}" for r, out in enumerate(outs))
        raise AssertionError(f"{script} {' '.join(args)} did not finish in {timeout:.0f} s:\n{tails}")
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{out[-3000:]}"
    return outs[0]


def test_hf_qwen2vl_balances_and_keeps_the_losses():
    pytest.importorskip("transformers", minversion="5.18")
    balanced = _launch("hf_qwen2vl.py", "--steps", "3")
    plain = _launch("hf_qwen2vl.py", "--steps", "3", "--no-balance")
    pattern = re.compile(r"step (\d+)\s+loss ([0-9.]+)\s+(.*)")
    rows_b = [pattern.match(line).groups() for line in balanced.splitlines() if line.startswith("step")]
    rows_p = [pattern.match(line).groups() for line in plain.splitlines() if line.startswith("step")]
    assert len(rows_b) == len(rows_p) == 3
    for (sb, lb, vb), (sp, lp, vp) in zip(rows_b, rows_p):
        assert sb == sp and abs(float(lb) - float(lp)) <= 2e-6 * abs(float(lp))
        before, after = map(float, re.search(r"vision max/mean ([0-9.]+) -> ([0-9.]+)", vb).groups())
        assert before > 1.5 and after < 1.1
        assert "not balanced" in vp
