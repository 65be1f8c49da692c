"""The tile sweep's warm-up: spawned processes that launch each candidate once, so Triton's compiles
run in parallel and the timing process finds them in its cache."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ...processes import die_with_parent, lifeline
from .check import make_case, table_config
from .shapes import SHAPES

# ------------------------------------------------------------------------------------ warm-up
_WARM: dict[str, Any] = {}
_DEAD_WORKER = 70  # a worker's exit status after a sticky device error


def warm_one(job: tuple[str, str, str, str, dict]) -> str | None:
    """In a worker: launch one candidate once on its shape's inputs (compiling it into Triton's
    cache); the error in words, or None. After an error that leaves the device unusable (an
    illegal address) the worker exits: a process in that state can launch nothing more."""
    shape_name, dtype_name, device, pass_, cfg = job
    try:
        key = f"{shape_name}:{dtype_name}:{device}"
        if key not in _WARM:
            _WARM.clear()
            case = make_case(SHAPES[shape_name], device, getattr(torch, dtype_name), with_reference=False)
            _WARM[key] = (case, case.fwd(table_config(case, "fwd")))
        case, (out, lse) = _WARM[key]
        if pass_ == "fwd":
            case.fwd(cfg, out=torch.empty_like(out), lse=torch.empty_like(lse))
        else:
            case.bwd(cfg, out, lse)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported as the candidate's row
        if device.startswith("cuda"):
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - sticky: this process is done
                os._exit(_DEAD_WORKER)
        return f"{type(e).__name__}: {e}"[:200]


class Warmer:
    """Processes (spawned: each with a device context of its own) that launch candidates once, so
    their compiles run in parallel and the timing process finds them in Triton's cache."""

    def __init__(self, workers: int, fn=None):
        self.workers = workers
        self.fn = fn or warm_one  # what a worker runs per job (a module-level function)
        self.pool: Any = None

    def close(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.kill()  # a compile in flight is not waited for
            self.pool = None

    def run(self, jobs: list[tuple], deadline: float) -> dict[int, str]:
        """Each job once; ``{index: error}`` of those that failed. Jobs left when ``deadline``
        passes are neither warmed nor failed (the timing process compiles what it still runs). A
        worker that dies (a sticky device error) breaks the pool: it is rebuilt once for the jobs
        left; if it breaks again, those jobs fail (one of them kills its process)."""
        from concurrent.futures import TimeoutError as FutureTimeout
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        errors: dict[int, str] = {}
        pending = set(range(len(jobs)))
        for _attempt in range(2):
            if not pending:
                break
            if self.pool is None:
                import concurrent.futures
                import multiprocessing

                # the workers end with this process, however it ends (processes.die_with_parent)
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=die_with_parent,
                    initargs=lifeline(),
                )
            futures = {self.pool.submit(self.fn, jobs[i]): i for i in sorted(pending)}
            try:
                for fut in as_completed(futures, timeout=max(0.0, deadline - time.monotonic())):
                    err = fut.result()
                    pending.discard(futures[fut])
                    if err:
                        errors[futures[fut]] = err
                return errors
            except FutureTimeout:
                for fut in futures:
                    fut.cancel()
                return errors
            except BrokenProcessPool:
                for fut, i in futures.items():  # what finished before the break
                    if fut.done() and not fut.cancelled() and fut.exception() is None:
                        pending.discard(i)
                        if fut.result():
                            errors[i] = fut.result()
                self.close()
        for i in pending:
            errors[i] = "a warm-up process died twice on this shape's remaining candidates"
        return errors
