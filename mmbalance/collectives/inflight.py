"""Collectives that leave nothing behind: a call returns once the backend has let go of its tensors.

Why: gloo runs each collective on a worker thread that keeps the call's work object, and with it
the call's tensors, until it moves on to the next one, which can be a little after ``wait()``
returned. If Python dropped those tensors first, the worker's final release frees their Python
objects and needs the GIL. When that happens while the interpreter finalizes (the call was the
program's last collective), the worker thread is stopped inside a destructor while it waits for
the GIL, and the process aborts ("terminate called without an active exception", SIGABRT), after
a run whose results were fine.

So every CPU collective of this package runs on *aliases* of its tensors (``t.detach()``: the same
storage, a handle nobody else holds), waits for the work, and then waits until the backend has
dropped its references to every alias, with the GIL released in between so the worker can finish.
"Dropped" takes two observations. While the backend holds a tensor whose Python object exists, the
tensor keeps that object alive (one extra Python reference); when the backend lets go, the C++ count
falls first and the Python reference is returned a moment later, under the GIL, on the worker
thread. So a call waits until both the C++ use count and the Python reference count of every alias
are back to what they were before the call. Only then are the aliases dropped, on the calling
thread. The wait is a few microseconds in the
common case. CUDA tensors (NCCL) are not treated this way: NCCL's watchdog keeps a work until the
device has finished it, and waiting for that would turn every call into a device sync.
"""

from __future__ import annotations

import atexit
import pickle
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .group import comm_device

__all__ = [
    "Inflight", "any_rank", "distributed_seen", "gather_objects", "mark_distributed_run", "release_parked", "run",
]  # fmt: skip

# How long a release may take before the aliases are parked (kept alive, released at exit) instead
# of waited for: a worker this late is stuck elsewhere, and the caller must not hang on it.
_RELEASE_TIMEOUT_S = 5.0
_PARKED: list[tuple[torch.Tensor, int]] = []
_PARKED_LOCK = threading.Lock()


def _held_elsewhere(aliases: list[tuple[torch.Tensor, int]]) -> bool:
    # An alias is referenced by its Python object (C++ use count 1) and by the backend's work while
    # it lives; while it does, the tensor holds a Python reference of its own, returned after the
    # use count has fallen (under the GIL, on the backend's thread).
    for alias, refs in aliases:
        # getrefcount counts this loop's variable and its own argument too: 2 more than the holders
        if alias._use_count() > 1 or sys.getrefcount(alias) - 2 > refs:  # type: ignore[attr-defined]
            return True
    return False


def _release(aliases: list[tuple[torch.Tensor, int]], timeout: float = _RELEASE_TIMEOUT_S) -> None:
    """Wait until the backend holds none of ``aliases`` (GIL released while waiting), then drop them."""
    if not aliases:
        return
    deadline = None
    pause = 0.0
    while _held_elsewhere(aliases):
        now = time.monotonic()
        if deadline is None:
            deadline = now + timeout
        elif now > deadline:
            with _PARKED_LOCK:
                _PARKED.extend(aliases)
            break
        time.sleep(pause)  # sleep(0) still releases the GIL
        pause = min(max(pause * 2, 1e-5), 1e-3)
    aliases.clear()


@atexit.register
def release_parked() -> None:
    # atexit runs before the interpreter finalizes: a worker may still take the GIL here.
    with _PARKED_LOCK:
        parked = list(_PARKED)
        _PARKED.clear()
    _release(parked, timeout=1.0)  # parks again what is still held: never freed late


# Collectives this package does not run (DDP's all-reduces, Trainer's and accelerate's gathers) keep
# the same hazard, and a worker that still owes a release when the group is destroyed deadlocks the
# destructor: collectives/teardown.py (``shutdown()`` and the exit hook) covers both.
_DISTRIBUTED_SEEN = False


def distributed_seen() -> bool:
    """Whether this process has marked itself as part of a distributed run (:func:`mark_distributed_run`)."""
    return _DISTRIBUTED_SEEN


def mark_distributed_run() -> None:
    """Note that this process runs torch.distributed collectives: the exit hook of
    ``collectives/teardown.py`` then runs even if the process group is destroyed before the program
    ends (integrations call it; so does every collective of this package)."""
    global _DISTRIBUTED_SEEN
    _DISTRIBUTED_SEEN = True


class Inflight:
    """Works in flight and the aliases they run on.

    ``alias(t)`` gives the tensor to pass to a ``torch.distributed`` call (``t`` itself for CUDA
    tensors); ``add(work)`` registers the returned work(s); ``wait()`` waits for every work and then
    for the backend to let go of every alias. Until ``wait()`` returns the caller must not read the
    outputs (as with any async collective).
    """

    __slots__ = ("_works", "_aliases")

    def __init__(self) -> None:
        mark_distributed_run()
        self._works: list[dist.Work] = []
        self._aliases: list[tuple[torch.Tensor, int]] = []

    def alias(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            return t
        a = t.detach()
        # this list's reference: what the alias's Python object is held by once the call is over
        self._aliases.append((a, 1))
        return a

    def add(self, work) -> None:
        if work is None:
            return
        if isinstance(work, (list, tuple)):
            self._works.extend(w for w in work if w is not None)
        else:
            self._works.append(work)

    def wait(self) -> None:
        works, self._works = self._works, []
        try:
            while works:
                works.pop(0).wait()  # our reference goes right away: the backend's may be the last
        finally:
            works.clear()
            _release(self._aliases)

    def __len__(self) -> int:
        return len(self._works)


def _alias_args(flight: Inflight, value):
    if isinstance(value, torch.Tensor):
        return flight.alias(value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [flight.alias(v) for v in value]
    return value


def run(collective: Callable, *args, **kwargs) -> None:
    """Call a ``torch.distributed`` collective (``dist.all_gather_single``, ``dist.all_to_all_single``
    ...) synchronously on aliases of its tensor arguments; returns once the backend has released them.
    Outputs are written in place, as with the plain call."""
    flight = Inflight()
    args = tuple(_alias_args(flight, a) for a in args)
    kwargs = {k: _alias_args(flight, v) for k, v in kwargs.items()}
    flight.add(collective(*args, async_op=True, **kwargs))
    del args, kwargs
    flight.wait()


def gather_objects(obj, group=None) -> list:
    """``dist.all_gather_object`` through :func:`run` (pickled bytes in two small gathers)."""
    world = dist.get_world_size(group)
    device = comm_device(group)
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    run(dist.all_gather_single, sizes, size, group=group)
    width = int(sizes.max())
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = torch.empty(world * width, dtype=torch.uint8, device=device)
    run(dist.all_gather_single, out, buf, group=group)
    raw = out.cpu().numpy().tobytes()
    return [pickle.loads(raw[r * width : r * width + int(n)]) for r, n in enumerate(sizes.tolist())]


def any_rank(flags: list[bool], group=None) -> list[bool]:
    """Each of ``flags`` or-ed over the ranks of ``group`` (one small all-reduce, through
    :func:`run`); every rank passes as many flags."""
    flag = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int64, device=comm_device(group))
    run(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in flag.tolist()]
