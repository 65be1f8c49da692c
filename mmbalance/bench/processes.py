"""The benchmarks' worker processes: starting them so that they end with the command however it
ends (their lifeline to the parent), collecting each one's report, telling how each exited, and
``spawn``, which runs a function on N gloo ranks and fails when a rank dies, hangs or fails at exit.

Imports only the standard library at import time (torch where ``spawn`` needs it), as the harness
does, so the command line starts quickly.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def describe_exit(code: int | None) -> str:
    """A process exit code in words (negative codes are signals)."""
    import signal

    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# ------------------------------------------------------------------------------ workers' lifeline
# Every worker process a command starts ends when the command does, however the command ends: a
# worker watches its parent (a thread that polls ``os.getppid``) and, where the process that started
# it was started by the main thread, also asks Linux to signal it at the parent's death
# (``PR_SET_PDEATHSIG``), which acts at once even while the worker holds the GIL in native code (a
# Triton compile). The kernel sends that signal when the *thread* that started the process exits,
# hence the main-thread condition: a pool started from a helper thread relies on the watch alone.
_PR_SET_PDEATHSIG = 1


def _libc_prctl():
    """libc's ``prctl`` (Linux), or ``None``; looked up before any fork so a child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def lifeline() -> tuple[int, bool]:
    """What a worker needs to end with this process: ``(pid, started by the main thread)``; pass it
    to the worker and call :func:`die_with_parent` with it there."""
    return os.getpid(), threading.current_thread() is threading.main_thread()


def die_with_parent(parent: int, main_thread: bool, sig: int | None = None, interval: float = 0.5) -> None:
    """Make this worker end when its parent ``parent`` (a pid from :func:`lifeline`) does: with
    ``sig`` (default SIGKILL) from the kernel at once where the parent started it from its main
    thread (Linux), and from a watch thread within ``interval`` seconds everywhere. A parent
    already gone ends this process now."""
    import signal

    sig = int(signal.SIGKILL if sig is None else sig)
    if main_thread and _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), sig)
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                time.sleep(10)
                os._exit(1)

    threading.Thread(target=watch, name="mmbalance-lifeline", daemon=True).start()


def child_dies_with_parent(sig: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess`` that has the child (any program) signalled with ``sig``
    (default SIGKILL; SIGTERM for a program that stops its own workers on it, as torchrun does) when
    this process ends; ``None`` where that is not available (not Linux) or the caller is not the main
    thread (the kernel would signal at that thread's end)."""
    import signal

    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    sig = int(signal.SIGKILL if sig is None else sig)
    parent, prctl = os.getpid(), _PRCTL

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


# ``multiprocessing`` is not thread-safe about its children: ``Process.start`` polls every child of
# this process (``process._cleanup``), and when two threads poll one forkserver child at once, both
# read its exit status from one pipe; the one that reads second gets end-of-file and records exit
# code 255 for a process that exited 0. Tests that run several process groups from threads (the
# fault tests) met it about once in a few hundred processes. Starting and polling under one lock
# keeps each child's status read once.
_CHILDREN = threading.Lock()


def start_processes(procs) -> None:
    """Start every process of ``procs`` (thread-safe; see ``_CHILDREN``)."""
    with _CHILDREN:
        for p in procs:
            p.start()


def exit_code(proc) -> int | None:
    """``proc.exitcode``, read under the lock that ``start_processes`` holds."""
    with _CHILDREN:
        return proc.exitcode


def send_report(queue, message: tuple) -> None:
    """Put ``message`` on a multiprocessing ``queue`` and wait until it is written to the pipe.

    ``queue.put`` hands the message to a feeder thread; a process that goes on to die in its exit
    handlers (an abort at exit, the very failure the callers look for) would take an unsent report
    with it, and the parent would wait for it until its timeout. The queue is closed afterwards:
    one report per process."""
    queue.put(message)
    queue.close()
    queue.join_thread()


def await_reports(
    queue, procs, timeout: float, *, stop: Callable[[tuple], bool] | None = None, past_deaths: bool = False
):
    """Collect one report (a tuple whose first item is the rank) from each of ``procs`` until every
    one reported, ``stop(report)`` is true for one, a process died without reporting (unless
    ``past_deaths``: then until every process reported or died), or ``timeout`` seconds pass.

    Returns ``(reports, died)``: the reports by rank, and the exit codes of the processes that
    ended without reporting (a crash, a signal, ``os._exit``). The queue is polled, so a dead
    process is noticed within a second or so, not at the timeout."""
    import queue as queue_mod

    reports: dict[int, tuple] = {}
    died: dict[int, int] = {}
    deadline = time.monotonic() + timeout

    def take(wait: float) -> bool:
        try:
            message = queue.get(timeout=wait) if wait > 0 else queue.get_nowait()
        except queue_mod.Empty:
            return False
        except Exception as exc:
            raise RuntimeError(
                "could not receive a rank's report (return numpy arrays or Python values, not tensors: "
                "tensors travel as shared-memory handles that die with the process)"
            ) from exc
        reports[message[0]] = message
        return stop is not None and stop(message)

    while len(reports) + len(died) < len(procs) and time.monotonic() < deadline:
        if take(min(0.5, max(0.01, deadline - time.monotonic()))):
            break
        codes = {r: exit_code(p) for r, p in enumerate(procs) if r not in reports}
        gone = {r: code for r, code in codes.items() if code is not None}
        if gone:
            # a report is in the pipe before its process exits (send_report): drain, then the
            # processes still without one died without reporting
            while take(0):
                pass
            died.update({r: code for r, code in gone.items() if r not in reports})
            if died and not past_deaths:
                break
    return reports, died


def died_without_report(died: dict[int, int]) -> str:
    """Words for the processes that ended before they reported (``await_reports``'s ``died``)."""
    return "; ".join(
        f"rank {r}'s process {describe_exit(code)} before it reported" for r, code in sorted(died.items())
    )


def settle(procs, grace: float) -> set[int]:
    """Give ``procs`` ``grace`` seconds in all to exit, kill the ones that do not; their ranks."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + grace
    hung = set()
    for r, p in enumerate(procs):
        # wait on the sentinel outside the lock; then ``join`` under it. The sentinel is ready when
        # the process has closed its files, a moment before it can be reaped: ``join`` then waits
        # for that moment (a non-blocking poll could still find it running)
        if not wait([p.sentinel], timeout=max(0.1, deadline - time.monotonic())):
            hung.add(r)
            p.kill()
            wait([p.sentinel], timeout=5)
        with _CHILDREN:
            p.join(timeout=5)
    return hung


def exits_in_words(bad: list[tuple[int, int | None]], hung: set[int], grace: float) -> str:
    """How each ``(rank, exit code)`` in ``bad`` ended, in words; ``hung`` ranks had to be killed."""
    return "; ".join(
        f"rank {r}'s process " + (f"did not exit within {grace:.0f}s" if r in hung else describe_exit(code))
        for r, code in bad
    )


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args,
    timeout: float = 600.0,
    backend: str | None = None,
    pg_timeout: float = 300.0,
    exit_grace: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes joined in one process group;
    return what each rank returned, by rank. ``fn`` must be a module-level function (the
    processes are spawned) and return picklable values (no tensors).

    ``backend``: ``"gloo"``, ``"nccl"``, or ``None`` for NCCL when every rank can have a GPU of its
    own and gloo otherwise; with NCCL, rank ``r`` runs on ``cuda:r``. A rank that raises fails the
    call with its traceback; so does a process that finished its work but then did not exit with
    code 0 within ``exit_grace`` seconds (an abort at exit is a failure, not a detail), and any rank
    that has not reported within ``timeout`` seconds."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(
                target=_spawned,
                args=(r, world, init, backend, pg_timeout, fn, args, queue, lifeline()),
                daemon=True,
            )
            for r in range(world)
        ]
        start_processes(procs)
        out: dict[int, Any] = {}
        try:
            reports, died = await_reports(queue, procs, timeout, stop=lambda message: bool(message[2]))
            for rank, (_, value, err) in sorted(reports.items()):
                if err:
                    raise RuntimeError(f"rank {rank} failed:\n{err}")
                out[rank] = value
            if died:
                raise RuntimeError(died_without_report(died))
            if len(out) < world:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout:.0f}s"
                )
        finally:
            hung = settle(procs, exit_grace if len(out) == world else 5.0)
        bad = [(r, code) for r, code in enumerate(map(exit_code, procs)) if code != 0]
        if bad:
            raise RuntimeError(
                f"every rank finished its work, but then {exits_in_words(bad, hung, exit_grace)}"
            )
    return [out[r] for r in range(world)]


def _spawned(rank, world, init, backend, pg_timeout, fn, args, queue, parent):
    import traceback
    from datetime import timedelta

    die_with_parent(*parent)
    import torch
    import torch.distributed as dist

    try:
        from mmbalance.collectives.teardown import wait_for_backend_threads

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init}", rank=rank, world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )  # fmt: skip
        try:
            value = fn(rank, world, *args)
        finally:
            # local (a rank that failed must not wait for the others): gloo's workers first let go of
            # what fn's last collectives held, or the release can land in the interpreter's
            # finalization and abort the process (collectives/teardown.py)
            wait_for_backend_threads(10)
            dist.destroy_process_group()
        send_report(queue, (rank, value, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        send_report(queue, (rank, None, traceback.format_exc()))
