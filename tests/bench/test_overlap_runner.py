"""``bench overlap``'s runner: rank 0 streams its rows, a dead rank stops the run quickly with how it
ended, and a process that fails after the last rows still fails the run (fake workers, no torch)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import time

import pytest

from mmbalance.bench.moves.overlap import _collect
from mmbalance.bench.processes import send_report, start_processes


def _streams(rank: int, queue, items: int, then: str) -> None:
    if rank == 0:
        for k in range(items):
            queue.put((f"cfg{k}", [k]))
        send_report(queue, (None, None))
        if then == "abort":
            faulthandler.disable()  # pytest's handler would print this process's stack
            os.abort()
    elif then == "die":
        os._exit(3)
    elif then == "hang":
        time.sleep(600)


def _waits_forever(rank: int, queue, items: int, then: str) -> None:
    if rank == 0:
        queue.put(("cfg0", [0]))
        time.sleep(600)  # never sends the end marker: its peer died
    else:
        time.sleep(0.5)
        os._exit(3)


def _run(target, then: str, items: int = 3):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, queue, items, then), daemon=True) for r in range(2)]
    start_processes(procs)
    got: list = []
    try:
        _collect(queue, procs, lambda cfg, rows: got.append((cfg, rows)), exit_grace=3.0)
    finally:
        for p in procs:
            p.kill()
            p.join()
    return got


def test_rows_arrive_in_order_and_every_rank_exits_0():
    got = _run(_streams, "ok")
    assert got == [("cfg0", [0]), ("cfg1", [1]), ("cfg2", [2])]


def test_a_dead_rank_stops_the_run_within_seconds_naming_it():
    t0 = time.monotonic()
    with pytest.raises(
        SystemExit, match=r"ended before the run finished: rank 1's process exited with code 3"
    ):
        _run(_waits_forever, "die")
    assert time.monotonic() - t0 < 20  # not the 600 s the survivor would sleep


@pytest.mark.parametrize(
    ("then", "words"),
    [
        ("abort", "rank 0's process was killed by SIGABRT"),
        ("hang", "rank 1's process did not exit within 3s"),
    ],
)
def test_a_process_that_fails_after_the_rows_fails_the_run(then, words):
    with pytest.raises(SystemExit, match=f"the benchmark finished, but then {words}"):
        _run(_streams, then)
