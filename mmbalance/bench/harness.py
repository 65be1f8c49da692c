"""The one benchmark harness: timing, result rows, tables, JSON, multi-process runs, the lengths
the benchmarks draw from the shipped mixture, and the command-line functions every command shares.

Every benchmark module builds ``Row`` objects through ``measure`` and hands them to ``report``.
Rows are keyed by op, provider, shape, dtype, device and git sha, so results from different
machines and versions can be stored side by side and compared. The command line (``mmbalance``,
and each module's own ``main``) reports its users' mistakes through :func:`usage_error` and friends:
one line on stderr, exit status 2, never a traceback.

Imports only the standard library at import time (numpy or torch where a function needs it), so the
command line starts quickly.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


@dataclasses.dataclass
class Row:
    op: str
    provider: str
    shape: str
    dtype: str
    device: str
    time_ms: float
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    sha: str = dataclasses.field(default_factory=git_sha)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("metrics"))
        return d


def time_cpu(fn: Callable[[], Any], *, warmup: int = 2, reps: int = 10, min_time_s: float = 0.0) -> float:
    """Median wall time of ``fn()`` in milliseconds (``time.perf_counter`` loop)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start) < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 10 * reps:
            break
    times.sort()
    return times[len(times) // 2]


def host_us(fn: Callable[[], Any], device: str = "cpu", calls: int = 200, warmup: int = 20) -> float:
    """Host time per call in microseconds: ``calls`` calls back to back with no synchronization in
    between (the device is synchronized before and after, not counted), so on a GPU with a tiny
    input this is what launching costs the CPU, not the kernel's time. On a CPU it is the call."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn()
    if cuda:
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def time_fn(fn: Callable[[], Any], device: str = "cpu", **kw) -> float:
    """Median time in ms: ``triton.testing.do_bench`` on CUDA, a perf_counter loop on CPU."""
    if device.startswith("cuda"):
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    return time_cpu(fn, **kw)


def format_table(rows: Iterable[Row], columns: list[str] | None = None) -> str:
    dicts = [r.as_dict() for r in rows]
    if not dicts:
        return "(no rows)"
    if columns is None:
        columns = [k for k in dicts[0] if k not in ("sha", "device")]
        for d in dicts[1:]:
            columns += [k for k in d if k not in columns and k not in ("sha", "device")]

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[fmt(d.get(c)) for c in columns] for d in dicts]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def report(rows: list[Row], json_path: str | None = None, title: str | None = None, file=sys.stdout) -> None:
    """Print ``rows`` as a table and, if ``json_path`` is given, append them there as JSON lines."""
    if title:
        print(f"\n== {title} ==", file=file)
    print(format_table(rows), file=file)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "a") as f:
            for r in rows:
                f.write(json.dumps(r.as_dict()) + "\n")


# ------------------------------------------------------------------------------------- inputs
def draw_lengths(tokens: int, max_length: int, seed: int) -> list[int]:
    """Sequence lengths from the shipped mixture, cut at ``max_length``, until ``tokens`` (the same
    examples for every provider of ``bench hf --device`` and the shipped-lengths attention row)."""
    import numpy as np

    from mmbalance.balancing.datasets import mixture

    rng = np.random.default_rng(seed)
    out: list[int] = []
    while True:
        for n in np.minimum(np.maximum(mixture(64, rng).llm, 8), max_length).tolist():
            if sum(out) + n > tokens:
                return out or [min(int(n), tokens)]
            out.append(int(n))


# ------------------------------------------------------------------------------ command line
def module_prog() -> str | None:
    """``python -m mmbalance.bench.<room>`` while a room's ``__main__`` runs (argparse would name it
    ``__main__.py``); ``None`` otherwise: argparse's own name (the script, or ``mmbalance``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    if name.startswith("mmbalance.") and name.endswith(".__main__"):
        return f"python -m {name[: -len('.__main__')]}"
    return None


def base_parser(description: str):
    p = argparse.ArgumentParser(prog=module_prog(), description=description)
    p.add_argument("--json", metavar="FILE", help="append result rows to FILE as JSON lines")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the full sweep instead of the default one")
    size.add_argument(
        "--quick", action="store_true", help="a smoke run: the smallest sizes only (same rows, fewer of them)"
    )
    return p


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default once: appended as ``(default: X)`` unless the help text already
    says what the default is, and never for flags that are off (``False``) or unset (``None``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        if not action.option_strings and action.nargs in (argparse.ZERO_OR_MORE, argparse.OPTIONAL):
            return text
        return f"{text} (default: %(default)s)"


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a command that owns its flags (``mmbalance demo``, ``mmbalance simulate``):
    named ``prog``, described by the first line of ``doc`` (its module docstring), every flag's
    default shown by :class:`HelpFormatter`."""
    return argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0], formatter_class=HelpFormatter)


def save_plot(fig, path: str) -> None:
    """Lay out ``fig`` and write it to ``path`` (its folder made if missing) at 120 dpi; says where."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def ms_cell(seconds: float) -> str:
    """Seconds as whole milliseconds for a table cell; ``-`` where there is no number (a scheme that
    cannot run)."""
    import math

    return f"{1e3 * seconds:.0f}" if math.isfinite(seconds) else "-"


def ratio_plot(path: str, results: list, schemes, ratio: Callable[[Any, str], float], *, bold=()) -> None:
    """A PNG of one panel per dataset of ``results`` (each with ``dataset``, ``world`` and
    ``memory_per_rank``): a line per scheme of ``ratio(result, scheme)`` (a modelled step time over
    ours) over the ranks and budgets; a scheme that never runs is left out, ``bold`` ones drawn
    thicker (log y axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(r.dataset for r in results))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, ds in zip(axes[0], names):
        mine = [r for r in results if r.dataset == ds]
        x = np.arange(len(mine))
        for s in schemes:
            y = [ratio(r, s) for r in mine]
            if any(np.isfinite(y)):
                ax.plot(x, y, marker="o" if s in bold else ".", label=s, lw=2 if s in bold else 1)
        ax.set_xticks(x, [f"{r.world}/{r.memory_per_rank // 1024}k" for r in mine], fontsize=8)
        ax.set(xlabel="ranks / tokens per rank", ylabel="modelled step time / ours", yscale="log", title=ds)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_output(prog: str, path: str, write) -> int | None:
    """Run ``write(path)``; on an ``OSError`` (a read-only or special file system, a full disk) print
    one line and return the exit status 2 instead of a traceback."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write(path)
    except OSError as exc:
        return usage_error(prog, f"cannot write {path}: {exc.strerror or exc}")
    return None


def usage_error(prog: str, message: str) -> int:
    """Print ``prog: message`` on stderr and return the usage-error exit status (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def require_matplotlib(prog: str, flag: str = "--plot") -> str | None:
    """``None`` if matplotlib imports; otherwise the message to fail with (before any work runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"{flag} needs matplotlib, which does not import here ({exc}); pip install 'matplotlib>=3.8'"
    return None


def check_output(path: str | None, flag: str) -> str | None:
    """``None`` if ``path`` (an output file named by ``flag``) can be written; else why not."""
    if not path:
        return None
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{flag} {path} is a directory; name a file"
    parent = os.path.dirname(full)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if (
        not os.path.isdir(parent)
        or not os.access(parent, os.W_OK)
        or (os.path.exists(full) and not os.access(full, os.W_OK))
    ):
        return f"{flag} {path} cannot be written"
    return None


def check_outputs(prog: str, json_path: str | None, plot_path: str | None) -> str | None:
    """``None`` if the ``--json`` and ``--plot`` files of command ``prog`` can be written (and
    matplotlib imports when a plot is asked for); else the first reason why not."""
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        msg = check_output(path, flag)
        if msg:
            return msg
    if plot_path:
        return require_matplotlib(prog)
    return None


def fresh_path(directory: str, stem: str, suffix: str) -> str:
    """A path in ``directory`` that does not exist yet: ``stem-<UTC time>[-k]suffix``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(directory, f"{stem}-{stamp}{suffix}")
    k = 1
    while os.path.exists(path):
        path = os.path.join(directory, f"{stem}-{stamp}-{k}{suffix}")
        k += 1
    return path


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


def describe_exit(code: int | None) -> str:
    """A process exit code in words (negative codes are signals)."""
    import signal

    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# ------------------------------------------------------------------------------ workers' lifeline
# Every worker process a command starts ends when the command does, however the command ends: a
# worker watches its parent (a thread that polls ``os.getppid``) and, where the process that started
# it was started by the main thread, also asks Linux to signal it at the parent's death
# (``PR_SET_PDEATHSIG``), which acts at once even while the worker holds the GIL in native code (a
# Triton compile). The kernel sends that signal when the *thread* that started the process exits,
# hence the main-thread condition: a pool started from a helper thread relies on the watch alone.
_PR_SET_PDEATHSIG = 1


def _libc_prctl():
    """libc's ``prctl`` (Linux), or ``None``; looked up before any fork so a child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def lifeline() -> tuple[int, bool]:
    """What a worker needs to end with this process: ``(pid, started by the main thread)``; pass it
    to the worker and call :func:`die_with_parent` with it there."""
    return os.getpid(), threading.current_thread() is threading.main_thread()


def die_with_parent(parent: int, main_thread: bool, sig: int | None = None, interval: float = 0.5) -> None:
    """Make this worker end when its parent ``parent`` (a pid from :func:`lifeline`) does: with
    ``sig`` (default SIGKILL) from the kernel at once where the parent started it from its main
    thread (Linux), and from a watch thread within ``interval`` seconds everywhere. A parent
    already gone ends this process now."""
    import signal

    sig = int(signal.SIGKILL if sig is None else sig)
    if main_thread and _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), sig)
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                time.sleep(10)
                os._exit(1)

    threading.Thread(target=watch, name="mmbalance-lifeline", daemon=True).start()


def child_dies_with_parent(sig: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess`` that has the child (any program) signalled with ``sig``
    (default SIGKILL; SIGTERM for a program that stops its own workers on it, as torchrun does) when
    this process ends; ``None`` where that is not available (not Linux) or the caller is not the main
    thread (the kernel would signal at that thread's end)."""
    import signal

    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    sig = int(signal.SIGKILL if sig is None else sig)
    parent, prctl = os.getpid(), _PRCTL

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


# ``multiprocessing`` is not thread-safe about its children: ``Process.start`` polls every child of
# this process (``process._cleanup``), and when two threads poll one forkserver child at once, both
# read its exit status from one pipe; the one that reads second gets end-of-file and records exit
# code 255 for a process that exited 0. Tests that run several process groups from threads (the
# fault tests) met it about once in a few hundred processes. Starting and polling under one lock
# keeps each child's status read once.
_CHILDREN = threading.Lock()


def start_processes(procs) -> None:
    """Start every process of ``procs`` (thread-safe; see ``_CHILDREN``)."""
    with _CHILDREN:
        for p in procs:
            p.start()


def exit_code(proc) -> int | None:
    """``proc.exitcode``, read under the lock that ``start_processes`` holds."""
    with _CHILDREN:
        return proc.exitcode


def send_report(queue, message: tuple) -> None:
    """Put ``message`` on a multiprocessing ``queue`` and wait until it is written to the pipe.

    ``queue.put`` hands the message to a feeder thread; a process that goes on to die in its exit
    handlers (an abort at exit, the very failure the callers look for) would take an unsent report
    with it, and the parent would wait for it until its timeout. The queue is closed afterwards:
    one report per process."""
    queue.put(message)
    queue.close()
    queue.join_thread()


def await_reports(
    queue, procs, timeout: float, *, stop: Callable[[tuple], bool] | None = None, past_deaths: bool = False
):
    """Collect one report (a tuple whose first item is the rank) from each of ``procs`` until every
    one reported, ``stop(report)`` is true for one, a process died without reporting (unless
    ``past_deaths``: then until every process reported or died), or ``timeout`` seconds pass.

    Returns ``(reports, died)``: the reports by rank, and the exit codes of the processes that
    ended without reporting (a crash, a signal, ``os._exit``). The queue is polled, so a dead
    process is noticed within a second or so, not at the timeout."""
    import queue as queue_mod

    reports: dict[int, tuple] = {}
    died: dict[int, int] = {}
    deadline = time.monotonic() + timeout

    def take(wait: float) -> bool:
        try:
            message = queue.get(timeout=wait) if wait > 0 else queue.get_nowait()
        except queue_mod.Empty:
            return False
        except Exception as exc:
            raise RuntimeError(
                "could not receive a rank's report (return numpy arrays or Python values, not tensors: "
                "tensors travel as shared-memory handles that die with the process)"
            ) from exc
        reports[message[0]] = message
        return stop is not None and stop(message)

    while len(reports) + len(died) < len(procs) and time.monotonic() < deadline:
        if take(min(0.5, max(0.01, deadline - time.monotonic()))):
            break
        codes = {r: exit_code(p) for r, p in enumerate(procs) if r not in reports}
        gone = {r: code for r, code in codes.items() if code is not None}
        if gone:
            # a report is in the pipe before its process exits (send_report): drain, then the
            # processes still without one died without reporting
            while take(0):
                pass
            died.update({r: code for r, code in gone.items() if r not in reports})
            if died and not past_deaths:
                break
    return reports, died


def died_without_report(died: dict[int, int]) -> str:
    """Words for the processes that ended before they reported (``await_reports``'s ``died``)."""
    return "; ".join(
        f"rank {r}'s process {describe_exit(code)} before it reported" for r, code in sorted(died.items())
    )


def settle(procs, grace: float) -> set[int]:
    """Give ``procs`` ``grace`` seconds in all to exit, kill the ones that do not; their ranks."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + grace
    hung = set()
    for r, p in enumerate(procs):
        # wait on the sentinel outside the lock; then ``join`` under it. The sentinel is ready when
        # the process has closed its files, a moment before it can be reaped: ``join`` then waits
        # for that moment (a non-blocking poll could still find it running)
        if not wait([p.sentinel], timeout=max(0.1, deadline - time.monotonic())):
            hung.add(r)
            p.kill()
            wait([p.sentinel], timeout=5)
        with _CHILDREN:
            p.join(timeout=5)
    return hung


def exits_in_words(bad: list[tuple[int, int | None]], hung: set[int], grace: float) -> str:
    """How each ``(rank, exit code)`` in ``bad`` ended, in words; ``hung`` ranks had to be killed."""
    return "; ".join(
        f"rank {r}'s process " + (f"did not exit within {grace:.0f}s" if r in hung else describe_exit(code))
        for r, code in bad
    )


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args,
    timeout: float = 600.0,
    backend: str | None = None,
    pg_timeout: float = 300.0,
    exit_grace: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes joined in one process group;
    return what each rank returned, by rank. ``fn`` must be a module-level function (the
    processes are spawned) and return picklable values (no tensors).

    ``backend``: ``"gloo"``, ``"nccl"``, or ``None`` for NCCL when every rank can have a GPU of its
    own and gloo otherwise; with NCCL, rank ``r`` runs on ``cuda:r``. A rank that raises fails the
    call with its traceback; so does a process that finished its work but then did not exit with
    code 0 within ``exit_grace`` seconds (an abort at exit is a failure, not a detail), and any rank
    that has not reported within ``timeout`` seconds."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(
                target=_spawned,
                args=(r, world, init, backend, pg_timeout, fn, args, queue, lifeline()),
                daemon=True,
            )
            for r in range(world)
        ]
        start_processes(procs)
        out: dict[int, Any] = {}
        try:
            reports, died = await_reports(queue, procs, timeout, stop=lambda message: bool(message[2]))
            for rank, (_, value, err) in sorted(reports.items()):
                if err:
                    raise RuntimeError(f"rank {rank} failed:\n{err}")
                out[rank] = value
            if died:
                raise RuntimeError(died_without_report(died))
            if len(out) < world:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(out))} did not finish within {timeout:.0f}s"
                )
        finally:
            hung = settle(procs, exit_grace if len(out) == world else 5.0)
        bad = [(r, code) for r, code in enumerate(map(exit_code, procs)) if code != 0]
        if bad:
            raise RuntimeError(
                f"every rank finished its work, but then {exits_in_words(bad, hung, exit_grace)}"
            )
    return [out[r] for r in range(world)]


def _spawned(rank, world, init, backend, pg_timeout, fn, args, queue, parent):
    import traceback
    from datetime import timedelta

    die_with_parent(*parent)
    import torch
    import torch.distributed as dist

    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init}", rank=rank, world_size=world,
            timeout=timedelta(seconds=pg_timeout),
        )  # fmt: skip
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        send_report(queue, (rank, value, None))
    except Exception:  # noqa: BLE001 - reported to the parent
        send_report(queue, (rank, None, traceback.format_exc()))
