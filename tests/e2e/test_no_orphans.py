"""No process outlives the command that started it.

Each command of the project that starts worker processes is started here in a session of its own,
left to start its workers, and then ended while they run: with SIGTERM, and separately with
SIGKILL (the workers' parent killed outright, as a test's time limit or a scheduler does). Within
10 seconds no process it started may be left (a zombie has ended; its exit status only waits to
be read). Whatever is left is killed afterwards, so a failure here leaks nothing either.

The commands: the tile sweep's warm-up pool, the kernel audit's compile pool, the benchmarks that
start workers (the long-sequence workers of ``bench attention``, the spawned ranks of
``bench alltoall``, torchrun under ``bench cp --real``), and ``mmbalance launch`` (the workers a
launched program starts, torchrun's included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.procs import alive, descendants, describe, kill_session, session

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)"),
]

# the program `mmbalance launch` runs: two spawned workers and a plain child process, all asleep
_LAUNCHED = textwrap.dedent(
    """
    import multiprocessing as mp, subprocess, sys, time

    def sleep():
        time.sleep(600)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=sleep) for _ in range(2)]
        for w in workers:
            w.start()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("workers started", flush=True)
        time.sleep(600)
    """
)
# the same under torchrun, the way frameworks start their ranks (LLaMA-Factory's FORCE_TORCHRUN)
_RANK = "import time\nprint('rank up', flush=True)\ntime.sleep(600)\n"


def _commands(tmp: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (command, how many live processes below it mean its workers run)."""
    py = sys.executable
    (tmp / "launched.py").write_text(_LAUNCHED)
    (tmp / "rank.py").write_text(_RANK)
    torchrun = [py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(29500 + os.getpid() % 400)]  # fmt: skip
    return {
        "tile sweep": (
            [py, "-m", "mmbalance.bench.attention.tiles", "--device", "cpu", "--shapes", "smoke-causal",
             "--limit", "2", "--warm-jobs", "2", "--json", str(tmp / "tiles.jsonl")],
            2,
        ),
        "kernel audit": ([py, "-m", "mmbalance.bench.kernel_audit", "--arch", "sm_90", "--jobs", "2"], 2),
        "bench attention": (
            [py, "-m", "mmbalance.bench.attention", "--device", "cpu", "--quick", "--no-ring",
             "--long-seqlen", "16384", "--long-rounds", "1", "--json", str(tmp / "a.jsonl")],
            1,
        ),
        "bench alltoall": (
            [py, "-m", "mmbalance.bench.moves.alltoall", "--world", "2", "--ranks-per-node", "1",
             "--json", str(tmp / "b.jsonl")],
            2,
        ),
        "bench cp --real": (
            [py, "-m", "mmbalance.bench.cp", "--real-only", "--real-steps", "50", "--json", str(tmp / "c.jsonl")],
            3,
        ),
        "mmbalance launch": ([py, "-m", "mmbalance.cli", "launch", "--", str(tmp / "launched.py")], 3),
        "mmbalance launch torchrun": (
            [py, "-m", "mmbalance.cli", "launch", "--", *torchrun[1:], str(tmp / "rank.py")],
            2,
        ),
    }  # fmt: skip


def _workers(proc: subprocess.Popen, count: int, log: Path, timeout: float = 240.0) -> set[int]:
    """The live processes below ``proc`` once there are at least ``count`` of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        below = {p for p in descendants(proc.pid) if alive(p)}
        if len(below) >= count:
            return below
        if proc.poll() is not None:
            pytest.fail(
                f"the command ended ({proc.returncode}) before {count} workers ran:\n{log.read_text()[-4000:]}"
            )
        time.sleep(0.2)
    kill_session(proc.pid)
    pytest.fail(f"{count} workers did not start within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize(
    "name",
    ["tile sweep", "kernel audit", "bench attention", "bench alltoall", "bench cp --real", "mmbalance launch",
     "mmbalance launch torchrun"],
)  # fmt: skip
def test_nothing_outlives_the_command(name, how, tmp_path):
    cmd, count = _commands(tmp_path)[name]
    log = tmp_path / "out.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    workers: set[int] = set()
    try:
        workers = _workers(proc, count, log)
        time.sleep(0.5)  # the workers past their start
        workers |= {p for p in descendants(proc.pid) if alive(p)}
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        left = workers
        while time.monotonic() < deadline:
            left = {p for p in workers | set(session(proc.pid)[1:]) if alive(p)}
            if not left:
                break
            time.sleep(0.2)
        assert not left, (
            f"{name}: {len(left)} process(es) still running 10 s after the command got {how}:\n{describe(left)}\n"
            f"--- its output\n{log.read_text()[-3000:]}"
        )
    finally:  # nothing is left behind by a failure either: its session, what is below it, what it started
        kill_session(proc.pid)
        for pid in workers | descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_the_time_limit_of_a_test_command_ends_its_whole_session(tmp_path):
    """``tests.procs.run`` at its limit: the report names what ran, and nothing of it is left."""
    from tests.procs import run

    script = tmp_path / "sleeper.py"
    script.write_text(_LAUNCHED)
    started = time.monotonic()
    with pytest.raises(AssertionError) as err:
        run([sys.executable, str(script)], timeout=8)
    assert time.monotonic() - started < 60
    text = str(err.value)
    assert "did not finish in 8 s" in text and "sleeper.py" in text, text
    assert "time.sleep(600)" in text or "sleep" in text  # a stack of the sleeping processes
    # every process of it is gone: the ones it named by pid are not alive
    pids = [int(line.split()[1]) for line in text.splitlines() if line.startswith("  pid ")]
    assert len(pids) >= 4, text  # the program, two workers, the child (and the resource tracker)
    time.sleep(1)
    assert not [p for p in pids if alive(p)], describe(pids)
