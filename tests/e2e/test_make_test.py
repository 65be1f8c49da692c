"""``make test``'s steps (``scripts/make_test.sh``): every step runs even when one before it failed,
each reports its time, and the end names the steps that failed (exit 1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests import procs

REPO = Path(__file__).resolve().parents[2]


def _fake(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _steps(tmp: Path, fail: set[str], *steps: str):
    """Run the step script with stand-ins: a Python that fails the suite or an audit as asked."""
    log = tmp / "calls"
    py = _fake(tmp / "python", f'echo "python $*" >> {log}\n'
               + "".join(f'case "$*" in *{word}*) exit 3;; esac\n' for word in fail))  # fmt: skip
    (tmp / "venv" / "bin").mkdir(parents=True, exist_ok=True)
    _fake(
        tmp / "venv" / "bin" / "mypy", f'echo "mypy" >> {log}\n' + ("exit 4" if "mypy" in fail else "exit 0")
    )
    make = _fake(tmp / "make", f'echo "make $*" >> {log}')
    env = dict(os.environ, PY=str(py), VENV=str(tmp / "venv"), MAKE=str(make), PYTHON=sys.executable)
    done = procs.run([str(REPO / "scripts" / "make_test.sh"), *steps], cwd=REPO, env=env, timeout=120)
    return done, (log.read_text().splitlines() if log.exists() else [])


def test_a_failing_first_step_lets_the_others_run_and_names_it(tmp_path):
    done, calls = _steps(
        tmp_path, {"pytest", "sm_80"}, "suite", "matrix", "mypy", "audit-sm_90", "audit-sm_80"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # every step ran, in order, though the first failed
    assert [c.split()[0] for c in calls] == ["python", "make", "mypy", "python", "python"], calls
    assert "pytest" in calls[0] and "test-matrix" in calls[1] and "sm_90" in calls[3] and "sm_80" in calls[4]
    out = done.stdout
    assert "suite: FAILED (exit 3)" in out and "audit-sm_80: FAILED (exit 3)" in out, out
    assert "matrix: passed in" in out and "mypy: passed in" in out and "audit-sm_90: passed in" in out, out
    assert out.strip().splitlines()[-1] == "make test: 2 step(s) failed: suite audit-sm_80", out


def test_every_step_passing_is_exit_0_and_unknown_steps_are_refused(tmp_path):
    done, calls = _steps(tmp_path, set(), "suite", "mypy")
    assert done.returncode == 0 and done.stdout.strip().endswith("make test: every step passed"), done.stdout
    assert len(calls) == 2
    done, _ = _steps(tmp_path, set(), "suite", "lint")
    assert done.returncode == 2 and "unknown step 'lint'" in done.stdout, done.stdout
