"""The multi-process test helpers fail a test whose ranks passed but whose processes then died."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.dist_utils import REPO, launch, run_distributed
from tests.faults.harness import run_ranks

pytestmark = pytest.mark.distributed


def _value(rank: int, world: int) -> int:
    return 10 * rank + world


def _abort_at_exit(rank: int, world: int) -> int:
    import atexit

    if rank == 1:
        atexit.register(os.abort)  # the body passes; the process aborts while it shuts down
    return rank


def _die_in_body(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.barrier()  # both ranks are connected: rank 0 then needs nothing more from rank 1
    if rank == 1:
        os._exit(3)  # no report, no exception: the process just ends
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


def test_a_rank_that_dies_without_reporting_fails_at_once():
    # rank 0 passes; rank 1's process ends in the body: the call must say so as soon as the
    # process is gone, not after waiting out its timeout for a report that never comes
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1's process exited with code 3 before it reported"):
        run_distributed(_die_in_body, 2, timeout=60.0)
    assert time.monotonic() - t0 < 30.0


def _sleep_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_rank_still_running_at_the_limit_says_where():
    """At its time limit a run fails naming the ranks that finished, and the error holds the
    Python stacks of the others' threads (the guard reports what was still running)."""
    with pytest.raises(TimeoutError, match=r"did not finish within 12s; finished ranks: \[0\]") as err:
        run_distributed(_sleep_on_rank_1, 2, timeout=12.0)
    text = str(err.value)
    assert "rank 1's threads" in text and "in _sleep_on_rank_1" in text, text  # faulthandler's lines
    assert "rank 0's threads" not in text


def test_run_ranks_waits_past_a_death_for_every_outcome():
    outcomes = run_ranks(_die_in_body, 2)
    assert outcomes[0].value == 0 and outcomes[0].exited_cleanly
    assert not outcomes[1].reported and outcomes[1].exitcode == 3


def test_exit_codes_are_right_when_threads_start_and_poll_processes_at_once():
    """Process groups started from several threads at once (as the fault tests run them): every
    child that exits 0 reads as 0. Unlocked, ``Process.start`` in one thread polls another thread's
    forkserver children, and one of the two reads gets end-of-file and records 255 (unlocked, this
    test failed 5 runs of 5)."""
    import concurrent.futures
    import random

    from mmbalance.bench.processes import exit_code, settle, start_processes
    from tests.dist_utils import worker_context

    ctx = worker_context()
    rng = random.Random(0)
    naps = [[rng.random() * 0.05 for _ in range(3)] for _ in range(320)]

    def group(seconds: list[float]) -> list[int | None]:
        procs = [ctx.Process(target=time.sleep, args=(s,), daemon=True) for s in seconds]
        start_processes(procs)
        assert not settle(procs, 30.0)
        return [exit_code(p) for p in procs]

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        codes = [c for group_codes in pool.map(group, naps) for c in group_codes]
    assert codes == [0] * len(codes), sorted(set(codes))


def test_settle_waits_for_processes_that_are_just_exiting():
    """A process's sentinel is ready when it closes its files, a moment before it can be reaped;
    ``settle`` must not take such a process for hung (a non-blocking poll right after the sentinel
    found about one process in six still running here)."""
    import multiprocessing as mp

    from mmbalance.bench.processes import exit_code, settle, start_processes

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=os.getpid, daemon=True) for _ in range(60)]
    start_processes(procs)
    assert settle(procs, 60.0) == set()
    assert [exit_code(p) for p in procs] == [0] * len(procs)


def test_a_group_that_gloo_fails_to_connect_runs_once_more():
    """gloo sometimes fails to connect a new group's ranks (its rendezvous race): nothing of the
    test ran, so the run starts again on fresh processes; the second run's values come back."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "failed-once")
        assert run_distributed(_value, 2, _init_fault=marker) == [2, 12]
        assert os.path.exists(marker)  # the first run's rank 1 did fail to connect


def test_other_failures_are_not_run_again():
    """A failure in the body is the test's own, whatever its message: reported, never retried."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "bodies")
        with pytest.raises(RuntimeError, match="but in the body of rank 1"):
            run_distributed(_die_in_body_with_error, 2, log)
        with open(log) as f:
            assert sorted(f.read().split()) == ["0", "1"]  # each rank's body ran once


def _die_in_body_with_error(rank: int, world: int, log: str) -> int:
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    if rank == 1:
        raise RuntimeError(f"Gloo connectFullMesh failed, but in the body of rank {rank}")
    return rank


def test_launch_stops_the_other_ranks_soon_after_one_fails(tmp_path):
    """A launched rank that fails leaves the others a grace period, not the whole timeout: a peer
    waiting on it (here: sleeping) is killed, and the failed rank's error is the report."""
    script = tmp_path / "one_fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit('rank 1 gives up')\n"
        "time.sleep(600)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1's process exited with code 1[\s\S]*rank 1 gives up"):
        launch(script, nproc=3, timeout=300, grace=2)
    assert time.monotonic() - t0 < 60


def test_launch_returns_rank_0s_output(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    assert launch(script, nproc=2, timeout=120).strip() == "rank 0 of 2"


def _default_start_method() -> str:
    code = "import multiprocessing; print(multiprocessing.get_start_method())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_preloaded_launch_runs_the_script_as_python_would(tmp_path, monkeypatch):
    """A preloaded rank (the default) starts with transformers imported, and otherwise sees what
    ``python script`` shows: ``__main__``, its arguments, its directory first on the path, the
    launch's environment, the repository as its directory, a session of its own, one thread of
    torch; a rank whose import-time environment differs from the fork server's (here a
    ``TORCH_`` variable) runs in a fresh interpreter instead, as ``preloaded=False`` does. What the
    tests' own process sets as it runs (a cache's place, as torch.compile does; tokenizers'
    parallelism) is no such difference."""
    script = tmp_path / "where.py"
    script.write_text(
        "import json, multiprocessing, os, sys\n"
        "import torch\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(),\n"
        "    'preloaded': 'transformers.trainer' in sys.modules, 'var': os.environ.get('MMB_VAR'),\n"
        "    'session': os.getsid(0) == os.getpid(), 'threads': torch.get_num_threads(),\n"
        "    'start': multiprocessing.get_start_method(), 'parent': multiprocessing.parent_process() is None,\n"
        "    'process': multiprocessing.current_process().name}))\n"
        "sys.exit(int(os.environ['RANK']) * 0)\n"
    )
    want = {"name": "__main__", "argv": [str(script), "a", "b"], "path0": str(tmp_path), "cwd": str(REPO),
            "var": "v", "session": True, "threads": 1, "start": _default_start_method(), "parent": True,
            "process": "MainProcess"}  # fmt: skip
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    for kw, preloaded in (
        ({}, True),
        ({"preloaded": False}, False),
        ({"env": {"TORCH_MMB_TEST": "1"}}, False),
    ):
        env = {"MMB_VAR": "v", **kw.pop("env", {})}
        got = json.loads(launch(script, "a", "b", nproc=2, timeout=120, env=env, **kw))
        assert got == {**want, "preloaded": preloaded}, (kw, got)


def test_a_preloaded_rank_that_raises_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise KeyError('the missing key')\n")
    with pytest.raises(
        AssertionError, match=r"rank 1's process exited with code 1[\s\S]*KeyError: 'the missing key'"
    ):
        launch(script, nproc=2, timeout=120, grace=2)


@pytest.mark.parametrize("preloaded", [True, False])
def test_a_hung_launch_reports_where_each_rank_waits(tmp_path, preloaded):
    """At the timeout every rank still running writes its Python stack into its log, and the
    report carries it (and the output printed before, unbuffered)."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import os, time\n"
        "print('rank', os.environ['RANK'], 'before the wait')\n"
        "def a_loader_worker_waits():\n"
        "    time.sleep(600)\n"
        "def waits_for_a_peer():\n"
        "    time.sleep(600)\n"
        "if os.fork() == 0:\n"  # a process the rank started (as a DataLoader worker is) hangs too
        "    a_loader_worker_waits()\n"
        "waits_for_a_peer()\n"
    )
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish in 3 s") as info:
        launch(script, nproc=2, timeout=3, preloaded=preloaded)
    assert time.monotonic() - t0 < 60
    report = str(info.value)
    for rank in (0, 1):
        part = report.split(f"--- rank {rank}\n")[1].split("--- rank")[0]
        assert f"rank {rank} before the wait" in part
        assert "in waits_for_a_peer" in part and "hangs.py" in part
        rank_part, worker_part = part.split("started by the rank")
        assert "the rank\n" in rank_part and "in waits_for_a_peer" in rank_part, part
        assert "in a_loader_worker_waits" in worker_part and "waits_for_a_peer" not in worker_part, part


def test_launch_runs_again_when_the_stores_port_was_taken(tmp_path):
    """rank 0 failing to bind its store's port (another process took it after ``_free_port``) is
    the launch's race, not the script's: the run starts again on a new port; any other failure of
    rank 0 is reported at once."""
    marker = tmp_path / "taken-once"
    script = tmp_path / "port.py"
    script.write_text(
        "import os, sys\n"
        f"marker = {str(marker)!r}\n"
        "if os.environ['RANK'] == '0' and not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    sys.exit('torch.distributed.DistNetworkError: TCPStore: port ' + os.environ['MASTER_PORT'] + "
        "', code: -98, name: EADDRINUSE, message: address already in use')\n"
        "print('rank', os.environ['RANK'], 'ran')\n"
    )
    assert launch(script, nproc=2, timeout=120, grace=2).strip() == "rank 0 ran"
    assert marker.exists()
    other = tmp_path / "other.py"
    other.write_text(
        "import os, sys\nif os.environ['RANK'] == '0':\n    sys.exit('EADDRINUSE from the script itself')\n"
    )
    with pytest.raises(
        AssertionError, match="rank 0's process exited with code 1[\\s\\S]*from the script itself"
    ):
        launch(other, nproc=2, timeout=120, grace=2)
