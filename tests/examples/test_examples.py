"""Every script in examples/ runs as its docstring says (torchrun on CPU), with the promised output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(REPO / "examples" / script), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # its own session, so a timeout can take down torchrun and its workers together
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{script} {' '.join(args)} did not finish in 300 s:\n{out[-2000:]}{err[-2000:]}"
        ) from None
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def test_hf_qwen2vl_balances_and_keeps_the_losses():
    pytest.importorskip("transformers", minversion="5.18")
    balanced = _torchrun("hf_qwen2vl.py", "--steps", "3")
    plain = _torchrun("hf_qwen2vl.py", "--steps", "3", "--no-balance")
    pattern = re.compile(r"step (\d+)\s+loss ([0-9.]+)\s+(.*)")
    rows_b = [pattern.match(line).groups() for line in balanced.splitlines() if line.startswith("step")]
    rows_p = [pattern.match(line).groups() for line in plain.splitlines() if line.startswith("step")]
    assert len(rows_b) == len(rows_p) == 3
    for (sb, lb, vb), (sp, lp, vp) in zip(rows_b, rows_p):
        assert sb == sp and abs(float(lb) - float(lp)) <= 2e-6 * abs(float(lp))
        before, after = map(float, re.search(r"vision max/mean ([0-9.]+) -> ([0-9.]+)", vb).groups())
        assert before > 1.5 and after < 1.1
        assert "not balanced" in vp
