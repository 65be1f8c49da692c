"""Fault injection on gloo ranks: every rank's outcome, including ranks that die.

``run_ranks(fn, world, *args, pg_timeout=...)`` starts ``world`` fresh processes joined into one gloo
group with the given (short) timeout and runs ``fn(rank, world, *args)`` in each. Unlike
``tests.dist_utils.run_distributed`` it never stops at the first error: it waits for every rank and
returns one :class:`Outcome` per rank, with whatever the rank returned, or the exception it raised
and how long after the start, or the exit code of a process that died without reporting (a signal
such as SIGABRT shows as a negative code). Every outcome also carries ``exit_status``: how the
process ended after it reported (0, a failure code, a negative signal number, or ``KILLED`` when it
had to be killed because it would not exit), so a rank that passed and then aborted at exit is seen.

Scenarios call :func:`attempt` for each injected fault: it runs the call, records whether it raised
(type, message, seconds), and then re-synchronises the healthy group with a barrier, so many faults
that the agreement step catches can run one after another in one process group.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp  # noqa: F401 - the workers' module resolves tensors through it

from mmbalance.bench.processes import await_reports, exit_code, send_report, settle, start_processes
from tests.dist_utils import end_like_a_program, worker_context


@dataclasses.dataclass
class Outcome:
    rank: int
    value: object = None  # what fn returned
    error: str | None = None  # a traceback if fn itself raised
    exitcode: int | None = None  # the process's exit code if it never reported
    exit_status: int | None = None  # how the process ended, reported or not (KILLED: would not exit)

    @property
    def reported(self) -> bool:
        return self.exitcode is None

    @property
    def exited_cleanly(self) -> bool:
        return self.exit_status == 0


KILLED = -999  # exit_status of a process that had to be killed after the run


def attempt(call, *, barrier: bool = True) -> dict:
    """Run ``call()``; return ``{"raised": bool, "type", "message", "seconds", "value"}``."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        value = portable(call())
        out = {"raised": False, "type": None, "message": "", "value": value}
    except Exception as exc:  # noqa: BLE001 - the outcome is the point
        out = {"raised": True, "type": type(exc).__name__, "message": str(exc), "value": None}
        out["bases"] = [c.__name__ for c in type(exc).__mro__]
    out["seconds"] = time.perf_counter() - t0
    if barrier:
        dist.barrier()
    return out


def portable(value):
    """``value`` as something a multiprocessing queue can carry: tensors become numpy arrays,
    containers are converted item by item, anything else unpicklable becomes its type's name."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(portable(v) for v in value)
    try:
        ForkingPickler.dumps(value)
    except Exception:  # noqa: BLE001 - a module, a process group ...: only its type travels
        return f"<{type(value).__name__}>"
    return value


def _worker(rank, world, init_file, fn, args, queue, pg_timeout):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args)
        ForkingPickler.dumps(value)  # fail here, loudly, rather than silently in the queue's feeder thread
        send_report(queue, (rank, value, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        send_report(queue, (rank, None, traceback.format_exc()))
        return
    end_like_a_program()
    # no destroy_process_group: after a fault the group may be broken, and tearing it down can
    # block on peers that are gone; the process exits and the OS closes its sockets


def run_ranks(
    fn, world: int, *args, pg_timeout: float = 20.0, timeout: float = 120.0, exit_grace: float = 30.0
) -> list[Outcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's :class:`Outcome`.

    After every rank reported, each process gets ``exit_grace`` seconds to exit on its own."""
    ctx = worker_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, fn, args, queue, pg_timeout), daemon=True)
            for r in range(world)
        ]
        start_processes(procs)
        outcomes: dict[int, Outcome] = {}
        try:
            reports, died = await_reports(queue, procs, timeout, past_deaths=True)
            outcomes.update({r: Outcome(r, value, error) for r, (_, value, error) in reports.items()})
            outcomes.update({r: Outcome(r, exitcode=code) for r, code in died.items()})
        finally:
            hung = settle(procs, exit_grace if len(outcomes) == world else 2.0)
        statuses = [KILLED if r in hung else exit_code(p) for r, p in enumerate(procs)]
        for r in range(world):
            if r not in outcomes:
                raise TimeoutError(f"rank {r} neither reported nor exited within {timeout:.0f}s: a hang")
            outcomes[r].exit_status = statuses[r]
        return [outcomes[r] for r in range(world)]
