"""``collectives.shutdown`` and the teardown order behind it (``collectives/teardown.py``): a gloo
worker that still owes the release of a collective's tensor is waited for, with the GIL released,
before anything may free its group; ``shutdown`` leaves no group and no worker thread behind, is
idempotent and works without a process group; programs that end a DDP run with a collective exit
with code 0 every time."""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Imported before any group exists (the workers import this module before they join one), as
# transformers does: imported later, the defaults of its functions keep the default group alive for
# good, and DDP's reducer would never be the group's last owner.
import torch.distributed.nn.functional  # noqa: F401, E402, I001

from mmbalance.collectives import RankMismatchError, shutdown, teardown
from tests.dist_utils import launch, run_distributed

PROGRAM = Path(__file__).with_name("teardown_program.py")
observable = pytest.mark.skipif(not teardown._observable(), reason="thread states are read from Linux /proc")


def _gloo_workers() -> int:
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names.count(teardown._WORKER_NAME)


# ----------------------------------------------------------------------------- one process
def test_shutdown_without_a_process_group_is_idempotent():
    assert not dist.is_initialized()
    shutdown()
    shutdown()
    assert not dist.is_initialized() and not teardown._HELD


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", True])
def test_shutdown_names_a_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout"):
        shutdown(timeout=bad)


@pytest.mark.parametrize("bad", [-1, math.nan, "1", None])
def test_wait_for_backend_threads_names_a_bad_timeout(bad):
    with pytest.raises(ValueError, match="timeout"):
        teardown.wait_for_backend_threads(bad)


def test_release_at_exit_names_a_bad_group():
    with pytest.raises(TypeError, match="group"):
        teardown.release_at_exit("world")
    teardown.release_at_exit()  # no process group: nothing to keep
    assert not teardown._HELD


def _named_thread(name: str, body, ready: threading.Event):
    """A thread whose OS name is ``name`` (as gloo names its workers) running ``body()``."""

    def run():
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: this thread's /proc comm
        ready.set()
        body()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(5)
    return t


@observable
def test_idle_busy_and_gil_waiting_workers_are_told_apart(monkeypatch):
    monkeypatch.setattr(teardown, "_WORKER_NAME", "mmb_test_wkr")
    assert teardown.wait_for_backend_threads(1) is True  # none: idle at once

    stop = threading.Event()
    # idle: blocked without a timeout, as a gloo worker waits for its next collective
    idle = _named_thread("mmb_test_wkr", stop.wait, threading.Event())
    t0 = time.monotonic()
    assert teardown.wait_for_backend_threads(5) is True
    assert time.monotonic() - t0 < 1.0

    # a worker in a timed wait (as for the GIL, or a peer's data) is not idle
    def poll():
        while not stop.wait(0.001):
            pass

    polling = _named_thread("mmb_test_wkr", poll, threading.Event())
    assert teardown.wait_for_backend_threads(0.3) is False
    stop.set()
    idle.join(5)
    polling.join(5)
    assert teardown.wait_for_backend_threads(1) is True

    # a worker that runs is not idle
    done = threading.Event()

    def spin():
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            pass
        done.set()

    _named_thread("mmb_test_wkr", spin, threading.Event())
    assert teardown.wait_for_backend_threads(0.2) is False
    assert done.wait(10)


# ----------------------------------------------------------------------------- ranks
def _owed_release(rank: int, world: int) -> tuple[bool, bool | None, int]:
    # The main thread keeps the GIL (a thread that waits for it asks for it only after 1000 s) while
    # a gloo worker finishes an all-reduce whose work nobody else holds: the worker has let go of
    # the tensor in C++ and waits for the GIL to give back the Python reference the tensor held.
    # wait_for_backend_threads must see it and release the GIL until the reference is back.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        t = torch.ones(3)
        base = sys.getrefcount(t)
        dist.all_reduce(t, async_op=True)  # the work is dropped at once: the worker holds the last reference
        deadline = time.monotonic() + 20
        while t._use_count() > 1 and time.monotonic() < deadline:  # no GIL release in this loop
            pass
        owed = sys.getrefcount(t) > base
        idle = teardown.wait_for_backend_threads(20)
        back = sys.getrefcount(t) - base
    finally:
        sys.setswitchinterval(old)
    assert float(t[0]) == world
    return owed, idle, back


@observable
@pytest.mark.distributed
def test_a_worker_that_owes_a_release_is_waited_for():
    for owed, idle, back in run_distributed(_owed_release, 2):
        assert idle is True
        assert back == 0  # the Python reference is back: nothing of the worker needs the GIL any more
        del owed  # True in most runs (the worker lost the race for the GIL); both outcomes must end idle


def _ddp_then_shutdown(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    sub = dist.new_group([0, 1])
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
    shutdown()
    out = {
        "initialized": dist.is_initialized(),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "held": len(teardown._HELD),
        "workers with the model alive": _gloo_workers(),
        "sum": float(t[0]),
    }
    shutdown()  # idempotent
    del model, sub
    import gc

    gc.collect()
    out["workers after the model"] = _gloo_workers()
    return out


@observable
@pytest.mark.distributed
def test_shutdown_leaves_no_group_and_no_worker():
    for out in run_distributed(_ddp_then_shutdown, 2):
        assert out["initialized"] is False and out["groups"] == 0 and out["held"] == 0
        assert out["sum"] == 4.0
        assert out["workers with the model alive"] >= 1  # DDP's reducer still holds the default group
        assert out["workers after the model"] == 0  # freed with the model, its workers joined


def _one_rank_elsewhere(rank: int, world: int) -> str:
    from mmbalance.collectives import gather_lengths

    try:
        if rank == 0:
            shutdown()
        else:
            gather_lengths(torch.tensor([3, 4]))
    except RankMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_ranks_that_are_not_all_in_shutdown_raise_on_every_rank():
    on_0, on_1 = run_distributed(_one_rank_elsewhere, 2)
    assert on_0.startswith("shutdown refused") and on_1.startswith("gather_lengths refused")
    assert "different collective" in on_0 and "different collective" in on_1


def _barrier_fails_on_rank_1(rank: int, world: int) -> str:
    if rank == 1:  # as if this rank's connection broke at the barrier
        real = teardown.dist.barrier

        def broken(*args, **kwargs):
            raise RuntimeError("injected: connection closed")

        teardown.dist.barrier = broken
    try:
        t0 = time.monotonic()
        shutdown(timeout=3)
        return "no error"
    except RuntimeError as exc:
        return f"{exc} after {time.monotonic() - t0:.0f}s; initialized={dist.is_initialized()}"
    finally:
        if rank == 1:
            teardown.dist.barrier = real


@pytest.mark.distributed
def test_a_failed_barrier_raises_on_every_rank_and_hangs_nowhere():
    on_0, on_1 = run_distributed(_barrier_fails_on_rank_1, 2, timeout=120)
    # rank 1's barrier broke; rank 0 waited for it for the timeout given
    assert on_1.startswith("shutdown: rank 1: the barrier of the default group failed") and "injected" in on_1
    assert on_0.startswith("shutdown: rank 0: the barrier of the default group failed")
    for msg in (on_0, on_1):
        assert msg.endswith("initialized=False")  # destroyed all the same
        assert float(msg.rsplit(" after ", 1)[1].split("s;")[0]) < 30


# ----------------------------------------------------------------------------- whole programs
@pytest.mark.distributed
@pytest.mark.parametrize("pattern", ["last-all-reduce", "late-peer"])
def test_programs_that_end_ddp_with_a_collective_exit_cleanly(pattern):
    # DDP training, a last collective of the program's own, shutdown(), then the model is freed,
    # run to the interpreter's end. "late-peer" is the order in which ~ProcessGroupGloo deadlocked
    # (with dist.destroy_process_group() in place of shutdown(), rank 0 hangs there). Every rank
    # must exit with code 0, in time (fresh interpreters: their finalization is what is tested).
    out = launch(PROGRAM, pattern, nproc=2, timeout=300, preloaded=False)
    assert "rank 0 done: sum 2.0" in out
