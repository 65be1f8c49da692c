"""Ending a distributed run without the gloo teardown deadlock: :func:`shutdown`, and what the
integrations arrange for programs that do not call it.

The deadlock (a torch bug of the pytorch#56297 kind). gloo runs every collective on a worker thread
of its process group. Once a collective is done, the worker drops its work object, and with it the
collective's tensors; a tensor that has a Python object gives that object's reference back then,
which needs the GIL. The worker does this a moment *after* ``wait()`` has returned. If in that moment
the main thread frees the last owner of the process group, most often DDP's ``Reducer`` (the
process group outlives ``destroy_process_group`` inside every DDP model), ``~ProcessGroupGloo``
joins the worker threads while the main thread holds the GIL (pybind11 frees the reducer without
releasing it), and the worker waits for the GIL forever: the program hangs after its work is done.
The same late release, when the interpreter has started to finalize, aborts the process instead
(a thread that takes the GIL then is terminated, inside a destructor: SIGABRT).

The way out is an order that cannot deadlock: nothing may free a group while one of its workers
still owes a release. So

* :func:`wait_for_backend_threads` waits, with the GIL released, until every gloo worker thread of
  the process is idle: on Linux it reads the threads' states from ``/proc/self/task`` (idle means
  blocked in an untimed wait, and not woken for a few milliseconds; a worker that waits for the GIL
  is in a timed wait, one that runs is runnable). Elsewhere it releases the GIL for a grace period;
* :func:`release_at_exit` keeps a group alive, so that whatever drops a DDP model never runs the
  group's destructor; the exit hook below lets go of it once the workers are idle;
* :func:`shutdown` (collective) does all of it at once: every rank agrees it is shutting down, a
  barrier on every group (gloo's barrier also waits for the group's earlier works), CUDA
  synchronized, every group destroyed while still kept, then the workers idle, a collection and
  the groups let go. A model that still holds a group frees it later with idle workers: safe.

The exit hook (registered on import, it runs before the interpreter finalizes) does the local part
in any process that used ``torch.distributed`` through this package: wait for idle workers, collect,
wait again, then release the groups kept by :func:`release_at_exit`. Groups whose workers never
become idle (a peer died inside a collective) are kept for good: the process then exits without
joining a thread that may never return.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import math
import os
import platform
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from . import inflight
from .agreement import Entry
from .group import initialized

__all__ = ["release_at_exit", "shutdown", "wait_for_backend_threads"]

# gloo's worker threads, as torch names them (c10::setThreadName, at most 15 characters)
_WORKER_NAME = "pt_gloo_runloop"
# the futex system call, by machine: a blocked worker is in it (idle: without a timeout)
_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_POLL_S = 0.002  # between two looks at the threads (the GIL is released meanwhile)
_GRACE_S = 0.2  # where the threads cannot be observed: how long the GIL is released instead
_SHUTDOWN_WAIT_S = 30.0
_EXIT_WAIT_S = 5.0
_TASKS = "/proc/self/task"

_HELD: list = []  # process groups kept alive by release_at_exit


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended, or /proc is not readable here
        return None


def _observable() -> bool:
    return (
        _FUTEX_SYSCALL is not None
        and os.path.isdir(_TASKS)
        and _read(f"{_TASKS}/{os.getpid()}/syscall") is not None
    )


def _idle_state(tid: str) -> tuple[int, int] | None:
    """The context-switch counts of thread ``tid`` if it is blocked in an untimed futex wait
    (``None`` if it runs, waits with a timeout, e.g. for the GIL, or is in another call)."""
    stat = _read(f"{_TASKS}/{tid}/stat")
    call = _read(f"{_TASKS}/{tid}/syscall")
    status = _read(f"{_TASKS}/{tid}/status")
    if stat is None or call is None or status is None:
        return None
    state = stat[stat.rindex(")") + 2 :].split(maxsplit=1)[0]
    fields = call.split()
    # "nr arg0 .. arg5 sp pc": futex(uaddr, op, val, timeout, ...); a blocked idle worker waits on
    # its group's condition variable without a timeout
    if state != "S" or len(fields) < 5 or not fields[0].isdigit() or int(fields[0]) != _FUTEX_SYSCALL:
        return None
    if int(fields[4], 16) != 0:
        return None
    switches = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            switches[key] = int(value)
    if len(switches) != 2:
        return None
    return switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]


def _snapshot() -> dict[str, tuple[int, int]] | None:
    """Every gloo worker thread's context-switch counts if all of them are idle, else ``None``."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    out = {}
    for tid in tids:
        name = _read(f"{_TASKS}/{tid}/comm")
        if name is None or name.strip() != _WORKER_NAME:
            continue
        state = _idle_state(tid)
        if state is None:
            return None
        out[tid] = state
    return out


def _gloo_groups_exist() -> bool:
    try:
        backends = [str(dist.get_backend(g)) for g in _live_groups()]
    except Exception:  # noqa: BLE001 - a group half torn down: assume the worst
        return True
    return bool(_HELD) or any("gloo" in b for b in backends)


def wait_for_backend_threads(timeout: float = 10.0) -> bool | None:
    """Wait, with the GIL released, until every gloo worker thread of this process is idle: every
    collective that ran is done and has released its tensors. Local (not collective).

    Returns ``True`` once they are idle (also when there are none), ``False`` if ``timeout``
    seconds passed first (a worker is inside a collective that waits for a peer), ``None`` where
    the threads cannot be observed (not Linux, ``/proc`` unreadable, or a torch that does not name
    gloo's threads while gloo groups exist): then the GIL was released for a short grace period.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    if not _observable():
        time.sleep(_GRACE_S)
        return None
    deadline = time.monotonic() + timeout
    before = _snapshot()
    if before == {} and _gloo_groups_exist():
        time.sleep(_GRACE_S)  # gloo groups, but no thread by that name: this torch does not name them
        return None
    while True:
        time.sleep(_POLL_S)  # releases the GIL: a worker that waits for it gets it now
        now = _snapshot()
        # idle twice, and not woken in between (the counts would have moved): a worker that
        # was only passing through a wait in between is caught
        if now is not None and now == before:
            return True
        if time.monotonic() > deadline:
            return False
        before = now


def _live_groups() -> list:
    """This process's groups in creation order (the default group first)."""
    if not initialized():
        return []
    world = dist.distributed_c10d._world
    groups = [g for g in getattr(world, "pg_map", {}) if g is not None]
    default = dist.group.WORLD
    if default is not None and default not in groups:
        groups.insert(0, default)
    return groups


def _group_name(group) -> str:
    if group is dist.group.WORLD:
        return "the default group"
    try:
        return f"group {dist.distributed_c10d._world.pg_names[group]!r}"
    except (AttributeError, KeyError):
        return "a group"


def release_at_exit(group=None) -> None:
    """Keep ``group`` (default: every group of this process) alive until this process exits: a DDP
    model, or whatever else holds the group last, then no longer runs its destructor when it is
    freed. The exit hook lets go of it once its worker threads are idle. Local (not collective).

    Raises:
        TypeError: ``group`` is not a process group.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    inflight.mark_distributed_run()
    groups = _live_groups() if group is None else [group]
    for g in groups:
        if g is None or g is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        if not any(g is h for h in _HELD):
            _HELD.append(g)


def _let_go(idle: bool | None) -> None:
    """Release the groups kept by :func:`release_at_exit`: now if their workers were seen idle (or
    cannot be observed), for good otherwise (a worker stuck in a collective must not be joined)."""
    held = list(_HELD)
    _HELD.clear()
    if idle is False:
        for g in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))
    del held


def shutdown(timeout: float | None = None) -> None:
    """End this process's use of ``torch.distributed`` in an order that cannot hang (collective:
    every rank calls it; idempotent; without a process group it only does the local part).

    1. every rank agrees it is in ``shutdown`` (a rank that is still in another collective makes
       every rank raise, instead of pairing the barrier with that collective);
    2. a barrier on every group of the process (creation order, the default group first): gloo's
       barrier also waits for the group's earlier works; CUDA is synchronized first;
    3. every group is destroyed (``dist.destroy_process_group()``) while this call still keeps
       them, so none is freed yet;
    4. every gloo worker thread finishes releasing what the last collectives held (the GIL is
       released while this waits), a collection frees what reference cycles kept, and the groups
       are let go: one nobody else holds is freed now, one a model still holds (DDP's reducer) when
       the model is freed, with idle workers either way.

    Call it where the program would call ``dist.destroy_process_group()``; models may stay alive.

    Args:
        timeout: seconds each barrier may take (default: the group's own timeout).

    Raises:
        ValueError: ``timeout`` is not a positive number (on every rank).
        RankMismatchError: ranks that are not all in ``shutdown``.
        RuntimeError: a barrier failed or timed out (a rank that died or never calls ``shutdown``);
            the groups are destroyed all the same, and their worker threads are left to exit.
    """
    inflight.mark_distributed_run()
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (timeout > 0 and math.isfinite(timeout))
    ):
        problem = ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
    else:
        problem = None
    if not initialized():
        if problem is not None:
            raise problem
        _settle(_SHUTDOWN_WAIT_S)
        return
    release_at_exit()  # nothing frees a group before its workers are seen idle
    rank = dist.get_rank()
    with Entry("shutdown") as e:  # every rank is here, or every rank raises
        if problem is not None:
            raise problem
    e.agree()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    failed = None
    for g in _live_groups():
        try:
            work = dist.barrier(group=g, async_op=True)
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=timeout))
            del work
        except Exception as exc:  # noqa: BLE001 - reported below, after the local teardown
            failed = (g, exc)
            break
    if failed is not None:
        # a worker may stay inside the failed barrier: nothing waits for it, and no group is joined
        name = _group_name(failed[0])
        gc.collect()
        dist.destroy_process_group()
        _let_go(False)
        raise RuntimeError(
            f"shutdown: rank {rank}: the barrier of {name} failed ({type(failed[1]).__name__}: "
            f"{failed[1]}); a rank died or does not call shutdown(). The groups are destroyed; their "
            "worker threads are left to the process's exit"
        ) from failed[1]
    inflight.release_parked()
    dist.destroy_process_group()  # the groups are held: none is freed here
    _settle(_SHUTDOWN_WAIT_S)


def _settle(wait_s: float) -> bool | None:
    """The local part: idle workers, a collection, idle workers again, then release the groups kept
    by :func:`release_at_exit` (for good when the workers never became idle)."""
    idle = wait_for_backend_threads(wait_s)
    gc.collect()  # groups and works in reference cycles go now, while nothing of theirs needs the GIL
    idle = wait_for_backend_threads(wait_s) if idle is not False else False
    if idle is False and _HELD:
        warnings.warn(
            f"gloo worker threads were still busy after {wait_s:.0f} s (a collective that waits for a peer, "
            "or an async work nobody waited for): their process groups are kept, never destroyed, so that "
            "nothing joins a thread that may not return",
            RuntimeWarning,
            stacklevel=3,
        )
    _let_go(idle)
    return idle


@atexit.register
def _at_exit() -> None:
    # atexit runs before the interpreter finalizes: a worker may still take the GIL here
    try:
        used = inflight.distributed_seen() or bool(_HELD) or initialized()
    except Exception:  # noqa: BLE001 - a half torn-down package at exit
        used = bool(_HELD)
    if not used:
        return
    if not (_HELD or initialized()):
        # nothing alive to free here: the workers only have to be done before finalization starts
        wait_for_backend_threads(_EXIT_WAIT_S)
        return
    idle = _settle(_EXIT_WAIT_S)
    if idle is False and initialized():
        # workers stuck in a collective: the groups torch still keeps must not be joined either
        for g in _live_groups():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))
