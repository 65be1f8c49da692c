"""The one helper for multi-rank tests: spawn N processes on gloo, fail loudly on timeout.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
fresh processes joined by a file rendezvous into a gloo process group, and returns the list of the
values ``fn`` returned, by rank. An exception in any rank is re-raised here with that rank's
traceback; a rank that does not finish within ``timeout`` seconds makes the whole call fail (no
hangs).
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _worker(rank, world_size, init_file, fn, args, queue, pg_timeout):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, init_file, fn, args, queue, pg_timeout), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(world_size):
                try:
                    rank, ok, value = queue.get(timeout=timeout)
                except queue_mod.Empty as exc:
                    raise TimeoutError(
                        f"distributed test did not finish within {timeout:.0f}s; finished ranks: {sorted(results)}"
                    ) from exc
                except Exception as exc:
                    raise RuntimeError(
                        "could not receive a rank's result (return numpy arrays or Python values, not "
                        "tensors: tensors travel as shared-memory handles that die with the worker)"
                    ) from exc
                (results if ok else errors)[rank] = value
                if errors:
                    break
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
        return [results[r] for r in range(world_size)]
