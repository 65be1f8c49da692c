"""The one helper for multi-rank tests: spawn N processes on gloo, fail loudly on timeout.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size``
fresh processes joined by a file rendezvous into a gloo process group, and returns the list of the
values ``fn`` returned, by rank. An exception in any rank is re-raised here with that rank's
traceback; a rank that does not finish within ``timeout`` seconds makes the whole call fail (no
hangs); and so does a process that reported success but then did not exit with code 0 within
``exit_grace`` seconds (an abort or a hang while the interpreter shuts down is a failure too). A
run in which gloo failed to connect the new group (a race in its rendezvous, before any rank ran
``fn``) runs once more on fresh processes.
"""

from __future__ import annotations

import os

#: the environment this process started with, before any import below could add to it (the fork
#: server imports this module first: ``_run_script`` compares a launched rank's with it)
_ENV_AT_START = dict(os.environ)

import contextlib  # noqa: E402 - after the environment is taken
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.multiprocessing as mp  # noqa: E402

from mmbalance.bench.processes import (  # noqa: E402
    await_reports,
    describe_exit,
    died_without_report,
    exit_code,
    exits_in_words,
    send_report,
    settle,
    start_processes,
)

REPO = Path(__file__).resolve().parents[1]

# Workers start from a fork server that has imported torch and the package once: a fresh process
# then starts in a fraction of a second instead of re-importing torch (seconds of CPU each, and
# the multi-process tests start hundreds of them). The server itself runs no torch op, so forking
# it is safe; each worker still gets its own process and process group.
# The launched programs (``launch``) start there too: transformers' models, its Trainer and the
# integration are seconds of CPU more per process, and 4 ranks share 2 cores.
_PRELOAD = ["tests.dist_utils", "torch", "torch.distributed", "numpy", "mmbalance.collectives",
            "transformers", "transformers.trainer", "accelerate", "mmbalance.integrations.hf"]  # fmt: skip

#: environment variables that the preloaded modules may read as they are imported: a launched rank
#: whose environment differs from the fork server's in one of these runs in a fresh interpreter
#: (``exec``), as an unpreloaded launch does
_IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "GOMP", "CUDA", "NVIDIA", "TRITON",
                    "HF_", "HUGGINGFACE", "TRANSFORMERS", "ACCELERATE", "TOKENIZERS", "MMBALANCE", "LD_")  # fmt: skip
#: ... but for these, which a preloaded rank applies itself (unbuffered output, faulthandler, threads)
_APPLIED_IN_THE_RANK = {"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "OMP_NUM_THREADS"}
#: ... and what is read when first used, not at import, which the tests' own process sets as it
#: runs (after the fork server started): the caches' places (torch.compile sets its own), and
#: tokenizers' parallelism (set off once a process forks after using it)
_READ_WHEN_USED = ("_CACHE_DIR", "TOKENIZERS_PARALLELISM")


def worker_context():
    """The multiprocessing context every multi-process test starts its workers from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def end_like_a_program() -> None:
    """What a program's exit would do, run at the end of a worker: a forked worker ends with
    ``os._exit``, which skips the exit handlers (``atexit``) and the last garbage collection, so a
    rank that would fail there would otherwise pass. (The interpreter's own finalization is
    exercised by the tests that run scripts to their end in fresh interpreters: the README block
    under torchrun, the examples, the teardown programs, the framework runs.)"""
    import atexit
    import gc

    gc.collect()
    atexit._run_exitfuncs()


def exit_after_barrier(code: int) -> None:
    """End a launched training program with ``code``: a barrier when a process group is up (so no
    rank leaves while another still talks to it), the output flushed, then ``os._exit``, which skips
    the interpreter's teardown where a plain gloo program can abort (torch's bug)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# gloo's own message when a pair of ranks fails to connect while the group is created: a race in
# its TCP rendezvous (pytorch/pytorch#53270, #57469), before any code of the test has run
_GLOO_CONNECT = "connectFullMesh failed"


def _worker(rank, world_size, init_file, fn, args, queue, pg_timeout, init_fault=None, stacks_to=None):
    import faulthandler

    import torch.distributed as dist

    from mmbalance.collectives import teardown

    if stacks_to is not None:  # still running at the parent's time limit: the parent asks where
        global _STACKS
        _STACKS = open(stacks_to.format(rank=rank), "w")  # noqa: SIM115 - open for the process's life
        faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True, chain=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        if init_fault is not None and rank == 1 and not os.path.exists(init_fault):
            Path(init_fault).touch()  # the test of the retry: rank 1's first group fails to connect
            raise RuntimeError(f"Gloo {_GLOO_CONNECT} with [injected] Connection closed by peer")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises or retries
        send_report(queue, (rank, False, traceback.format_exc(), "init"))
        return
    try:
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # fn may have ended the run itself (collectives.shutdown)
                # local (a rank that failed must not wait for the others): gloo's workers first let
                # go of what fn's last collectives held, or destroying the group can deadlock
                teardown.wait_for_backend_threads(10)
                dist.destroy_process_group()
        send_report(queue, (rank, True, result, "body"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        send_report(queue, (rank, False, traceback.format_exc(), "body"))
        return
    end_like_a_program()


_STACKS = None  # a worker's file for its stacks


def _ask_for_stacks(ranks: dict, stacks_to: str, wait: float = 10.0) -> str:
    """Each live process of ``ranks`` (rank: process) writes its threads' Python stacks to its file
    (faulthandler on SIGUSR1, registered by ``_worker``); returns what they wrote, once each has
    (a loaded machine may schedule the handler late), or what there is after ``wait`` seconds."""
    asked = {}
    for rank, p in ranks.items():
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
                asked[rank] = stacks_to.format(rank=rank)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait
    texts: dict = {}
    while True:
        for rank, path in asked.items():
            with contextlib.suppress(OSError):
                texts[rank] = Path(path).read_text()
        if all("File " in texts.get(r, "") for r in asked) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return "".join(f"\n-- rank {r}'s threads:\n{texts.get(r) or '(nothing written)'}" for r in sorted(asked))


class _Retry(Exception):
    """Every failure of a run was gloo failing to connect the group, before the test's code ran."""


def run_distributed(
    fn, world_size: int, *args, timeout: float = 300.0, pg_timeout: float = 60.0, exit_grace: float = 30.0,
    _init_fault: str | None = None,
):  # fmt: skip
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    A run whose every failure is gloo failing to connect the group while it is created (a race in
    its TCP rendezvous, before ``fn`` ran anywhere) runs once more, on fresh processes and a fresh
    rendezvous; any other failure, and that one twice, fails the call."""
    try:
        return _run_once(fn, world_size, args, timeout, pg_timeout, exit_grace, _init_fault)
    except _Retry:
        return _run_once(fn, world_size, args, timeout, pg_timeout, exit_grace, None, retry=False)


def _run_once(fn, world_size, args, timeout, pg_timeout, exit_grace, init_fault, retry=True):
    ctx = worker_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        stacks_to = os.path.join(tmp, "stacks-{rank}.txt")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, fn, args, queue, pg_timeout, init_fault, stacks_to),
                daemon=True,
            )
            for r in range(world_size)
        ]  # fmt: skip
        start_processes(procs)
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        phases: dict[int, str] = {}
        try:
            reports, died = await_reports(queue, procs, timeout, stop=lambda report: not report[1])
            for rank, (_, ok, value, phase) in reports.items():
                (results if ok else errors)[rank] = value
                phases[rank] = phase
            if not errors and died:
                raise RuntimeError(died_without_report(died))
            if not errors and len(results) < world_size:
                stacks = _ask_for_stacks({r: p for r, p in enumerate(procs) if r not in results}, stacks_to)
                raise TimeoutError(
                    f"distributed test did not finish within {timeout:.0f}s; finished ranks: {sorted(results)} "
                    f"; where the others were:{stacks}"
                )
        finally:
            hung = settle(procs, exit_grace if len(results) == world_size else 5.0)
        if retry and errors and all(phases[r] == "init" and _GLOO_CONNECT in e for r, e in errors.items()):
            raise _Retry
        if errors:
            rank = min(errors)
            raise RuntimeError(f"rank {rank} failed:\n{errors[rank]}")
        bad = [(r, code) for r, code in enumerate(map(exit_code, procs)) if code != 0]
        if bad:
            what = exits_in_words(bad, hung, exit_grace)
            raise RuntimeError(f"every rank returned its result, but then {what} (a failure at exit)")
        return [results[r] for r in range(world_size)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: how long the other ranks of a launch may run on once one has failed (they may raise too, and
#: say why), before they are killed: a peer that waits on the failed rank would wait out its
#: process group's timeout
LAUNCH_GRACE = 60.0


#: torch's message when rank 0's store cannot take the port chosen for it: another process bound
#: it between ``_free_port`` and the store (a race of that pattern, before any code of the script ran)
_PORT_TAKEN = "EADDRINUSE"


class _PortTaken(Exception):
    pass


def _session(pid: int) -> list[int]:
    """The processes of the session ``pid`` leads, ``pid`` first (Linux ``/proc``; ``[pid]`` where
    there is none)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and int(entry) != pid and _stat(int(entry))[2] == pid:
            found.append(int(entry))
    return [pid, *sorted(found)]


def _stat(pid: int) -> tuple[str, str, int]:
    """``pid``'s name, state and session (``("", "", -1)`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "", "", -1
    fields = stat[stat.rfind(")") + 2 :].split()
    return stat[stat.find("(") + 1 : stat.rfind(")")], fields[0], int(fields[3])


def _dump_stacks(proc: subprocess.Popen, log) -> None:
    """Every process of ``proc``'s session (the rank and what it started: DataLoader workers) writes
    its threads' Python stacks into ``log`` (faulthandler, SIGABRT), one process at a time so the
    dumps do not interleave; the session is stopped first, so what one dump shows is what the
    others were doing when the timeout came, not their reaction to the first one's end."""
    pids = _session(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
    for pid in pids:
        name, _, _ = _stat(pid)
        log.write(f"\n--- the launcher, at the timeout: the stacks of process {pid} ({name or 'gone'}), "
                  f"{'the rank' if pid == proc.pid else 'started by the rank'}\n")  # fmt: skip
        log.flush()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        end = time.monotonic() + 5
        while time.monotonic() < end and _stat(pid)[1] not in ("", "Z"):  # until it is gone or a zombie
            time.sleep(0.05)


def launch(script, *args: str, nproc: int = 2, timeout: float = 300.0, env: dict | None = None,
           grace: float = LAUNCH_GRACE, preloaded: bool = True) -> str:  # fmt: skip
    """Run the Python file ``script`` on ``nproc`` ranks with the environment ``torchrun`` gives its
    workers (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...), from the repository root.

    The workers are started here rather than through torchrun, whose workers live in sessions of
    their own: a timeout here kills every worker, so a hung example fails the test instead of
    leaving the suite waiting on pipes that a stray worker holds open. Once a rank has failed, the
    others get ``grace`` seconds to end before they are killed (the test fails either way). A run
    whose rank 0 could not bind the port chosen for its store (taken by another process in
    between) runs again on a new port, up to three times. A rank still running at the timeout, and
    every process it started (DataLoader workers), writes every thread's Python stack into its log
    (faulthandler, SIGABRT) before the kill, and the report shows each log's end. Returns rank 0's
    stdout.

    ``preloaded`` (the default): each rank is a child of the fork server (``_PRELOAD`` imported)
    that runs the script as ``python script`` would (``__main__``, ``sys.argv``, the environment,
    the working directory, a session of its own) and ends as a forked worker does
    (``end_like_a_program``, then ``os._exit``): the interpreter's own finalization is left out.
    Programs whose exit is under test run with ``preloaded=False``, in fresh interpreters.
    """
    for _ in range(3):
        try:
            return _launch_once(script, args, nproc, timeout, env, grace, preloaded)
        except _PortTaken:
            pass
    raise AssertionError(f"{script}: rank 0's store found its port taken three times")


class _PreloadedRank:
    """A launched rank forked from the fork server, behind the part of ``subprocess.Popen`` that
    ``_launch_once`` uses."""

    def __init__(self, proc):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return exit_code(self.proc)

    def poll(self) -> int | None:
        return exit_code(self.proc)

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while (code := exit_code(self.proc)) is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.proc), timeout)
            time.sleep(0.05)
        return code


def _run_script(script: str, args: tuple, env: dict, log_path: str) -> None:
    """A rank of a preloaded ``launch``, in a child of the fork server: ``python script *args``
    with the environment ``env``, its output into ``log_path``."""
    import faulthandler
    import multiprocessing
    import multiprocessing.process
    import runpy

    # multiprocessing as a program's main process has it: the platform's start method (DataLoader
    # workers), no parent process, the main process's name
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.process._parent_process = None
    multiprocessing.current_process().name = "MainProcess"
    os.setsid()  # a session of its own, as the unpreloaded rank has: the launcher stops it whole
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(REPO)
    differs = any(k.startswith(_IMPORT_TIME_ENV) and k not in _APPLIED_IN_THE_RANK
                  and not k.endswith(_READ_WHEN_USED) and _ENV_AT_START.get(k) != env.get(k)
                  for k in set(_ENV_AT_START) | set(env))  # fmt: skip
    if differs:  # the preloaded modules read another environment: a fresh interpreter reads this one
        os.execve(sys.executable, [sys.executable, script, *args], env)
    # what the imports set themselves (torch: TORCHINDUCTOR_CACHE_DIR), as they would have
    added = {k: v for k, v in os.environ.items() if k not in _ENV_AT_START and k not in env}
    os.environ.clear()
    os.environ.update(env, **added)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.enable(file=sys.stderr, all_threads=True)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # read at torch's import: applied here instead
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit code 1
        traceback.print_exc()
        code = 1
    end_like_a_program()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _start_rank(script, args, env: dict, log, preloaded: bool):
    if not preloaded:
        return subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    proc = worker_context().Process(target=_run_script, args=(str(script), args, env, log.name), daemon=False)
    start_processes([proc])
    return _PreloadedRank(proc)


def _launch_once(script, args, nproc: int, timeout: float, env: dict | None, grace: float,
                 preloaded: bool = True) -> str:  # fmt: skip
    port = str(_free_port())
    procs, logs, timed_out = [], [], False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for rank in range(nproc):
                env_r = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                           # every line in the log as it is written, and a hung rank's stacks there when
                           # it is stopped below
                           PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                           WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
                logs.append(open(os.path.join(tmp, f"rank{rank}.log"), "a+"))  # noqa: SIM115 - closed below
                procs.append(_start_rank(script, args, env_r, logs[-1], preloaded))
            deadline, timed_out, failed_at = time.monotonic() + timeout, False, None
            while True:
                codes = [p.poll() for p in procs]  # every one polled (any() would stop at the first)
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if now > deadline:
                    timed_out = True
                    break
                if failed_at is not None and now > failed_at + grace:
                    break  # the rest are killed below; the failed rank's error is the report
                time.sleep(0.1)
        finally:
            if timed_out:  # every thread's Python stack into its log before the kill, of the rank and
                # of every process it started (DataLoader workers: each rank leads a session of its own)
                for proc, log in zip(procs, logs):
                    if proc.poll() is None:
                        _dump_stacks(proc, log)
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:  # a preloaded rank killed before its setsid
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)  # a killed process ends; never wait without a bound
            outs = []
            for log in logs:
                log.seek(0)
                outs.append(log.read())
                log.close()
    if timed_out:
        tails = "".join(f"--- rank {r}\n{out[-12000:]}" for r, out in enumerate(outs))
        raise AssertionError(f"{script} {' '.join(args)} did not finish in {timeout:.0f} s:\n{tails}")
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        if proc.returncode != 0 and proc.returncode != -signal.SIGKILL:  # a rank that failed by itself first
            if rank == 0 and _PORT_TAKEN in out and "TCPStore" in out:
                raise _PortTaken
            raise AssertionError(f"rank {rank}'s process {describe_exit(proc.returncode)}:\n{out[-3000:]}")
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"rank {rank}'s process {describe_exit(proc.returncode)}:\n{out[-3000:]}"
    return outs[0]
