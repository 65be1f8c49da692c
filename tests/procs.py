"""Processes of the tests: the one way a test runs a command under a time limit, and what a process
left behind looks like.

``run(cmd, timeout=...)`` runs a command in a session of its own (its own process group) and
returns its ``CompletedProcess``. When the limit fires it reports what was still running (every
process of the session and below the command, with its state and, for Python processes, the stack
of every thread: faulthandler on SIGABRT) and kills them all, so no worker the command started
outlives the test. ``descendants``, ``session`` and ``alive`` read Linux ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence

__all__ = ["run", "stat", "session", "descendants", "alive", "describe", "kill_session"]


def stat(pid: int) -> tuple[str, str, int, int]:
    """``pid``'s name, state, parent and session (``("", "", -1, -1)`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return "", "", -1, -1
    fields = text[text.rfind(")") + 2 :].split()
    return text[text.find("(") + 1 : text.rfind(")")], fields[0], int(fields[1]), int(fields[3])


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def session(pid: int) -> list[int]:
    """The processes of the session ``pid`` leads, ``pid`` first."""
    return [pid, *sorted(p for p in _pids() if p != pid and stat(p)[3] == pid)]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children ...)."""
    parents = {p: stat(p)[2] for p in _pids()}
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier and p not in found}
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a zombie has ended; only its exit status waits)."""
    return stat(pid)[1] not in ("", "Z")


def describe(pids) -> str:
    """One line per process: pid, name, state and command line."""
    lines = []
    for pid in sorted(pids):
        name, state, parent, _ = stat(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = ""
        lines.append(f"  pid {pid} ({name or 'gone'}, state {state or '-'}, parent {parent}): {cmd[:300]}")
    return "\n".join(lines)


def kill_session(pid: int) -> None:
    """SIGKILL every process of the session ``pid`` leads (nothing when it is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _stacks(pids: list[int], grace: float = 5.0) -> None:
    """Each process of ``pids`` writes its threads' Python stacks to its stderr (faulthandler on
    SIGABRT, enabled by ``PYTHONFAULTHANDLER=1`` in ``run``), one at a time."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        end = time.monotonic() + grace
        while time.monotonic() < end and alive(pid):
            time.sleep(0.05)


def run(
    cmd: Sequence[str],
    *,
    timeout: float,
    cwd=None,
    env: dict | None = None,
    check: bool = False,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end in a session of its own, its output captured as text.

    Past ``timeout`` seconds the command is a failure: ``AssertionError`` with what was still
    running (every process of its session, then the end of the output, which holds the Python
    stacks of each), after every process of the session was killed. ``check``: a non-zero exit is
    an ``AssertionError`` with the output's end too. ``input``: text on its standard input."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.TemporaryFile("w+") as stdin,
    ):
        stdin.write(input or "")
        stdin.seek(0)
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # its session, and what it started in sessions of their own (torchrun's workers)
            running = sorted({p for p in [*session(proc.pid), *descendants(proc.pid)] if alive(p)})
            listing = describe(running)
            _stacks(running)
            kill_session(proc.pid)
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)
            out.seek(0)
            err.seek(0)
            raise AssertionError(
                f"{' '.join(map(str, cmd))[:500]}\ndid not finish in {timeout:.0f} s; still running then:\n"
                f"{listing}\n--- stdout (end)\n{out.read()[-6000:]}\n--- stderr (end, with the stacks)\n"
                f"{err.read()[-12000:]}"
            ) from None
        finally:
            if proc.poll() is None:  # an exception here (KeyboardInterrupt): nothing stays behind
                kill_session(proc.pid)
                proc.wait(timeout=30)
        # what the command left in its session after it ended is killed too (and is its own defect,
        # which the process tests look for)
        kill_session(proc.pid)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(list(cmd), code, out.read(), err.read())
    if check and code != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))[:500]} exited with {code}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-6000:]}")  # fmt: skip
    return done
