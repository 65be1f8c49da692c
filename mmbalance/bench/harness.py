"""The one benchmark harness: timing, result rows, tables, JSON, the lengths the benchmarks draw
from the shipped mixture, and the command-line functions every command shares (the worker
processes a benchmark starts: ``processes.py``).

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
