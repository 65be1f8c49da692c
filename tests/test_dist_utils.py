"""The multi-process test helpers fail a test whose ranks passed but whose processes then died."""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_distributed
from tests.faults.harness import run_ranks

pytestmark = pytest.mark.distributed


def _value(rank: int, world: int) -> int:
    return 10 * rank + world


def _abort_at_exit(rank: int, world: int) -> int:
    import atexit

    if rank == 1:
        atexit.register(os.abort)  # the body passes; the process aborts while it shuts down
    return rank


def test_run_distributed_returns_values_by_rank():
    assert run_distributed(_value, 2) == [2, 12]


def test_run_distributed_fails_when_a_rank_aborts_after_passing():
    with pytest.raises(RuntimeError, match="rank 1's process was killed by SIGABRT"):
        run_distributed(_abort_at_exit, 2)


def test_run_ranks_reports_how_each_process_ended():
    outcomes = run_ranks(_abort_at_exit, 2)
    assert [o.value for o in outcomes] == [0, 1]
    assert outcomes[0].exited_cleanly
    assert not outcomes[1].exited_cleanly and outcomes[1].exit_status == -6
