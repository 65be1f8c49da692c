"""The ``mmbalance`` command line: ``mmbalance bench|demo|simulate``, ``mmbalance --version``.

Every command runs from an installed package (the benchmarks, demo and simulator are
``mmbalance.bench``). Mistakes in the arguments or the input files end in one line on stderr and
exit status 2, never in a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys

BENCHES = ("planners", "varlen", "alltoall", "attention", "overlap", "hf", "sampler", "cp")


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


def fresh_path(directory: str, stem: str, suffix: str) -> str:
    """A path in ``directory`` that does not exist yet: ``stem-<UTC time>[-k]suffix``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(directory, f"{stem}-{stamp}{suffix}")
    k = 1
    while os.path.exists(path):
        path = os.path.join(directory, f"{stem}-{stamp}-{k}{suffix}")
        k += 1
    return path


def _bench(args: argparse.Namespace) -> int:
    unknown = [n for n in args.only if n not in BENCHES]
    if unknown:
        return usage_error(
            "mmbalance bench", f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}"
        )
    if args.real and args.only and "cp" not in args.only:
        return usage_error("mmbalance bench", "--real adds the real steps of the cp benchmark: name cp too")
    if args.json:
        json_path = os.path.abspath(args.json)
        if os.path.isdir(json_path):
            return usage_error("mmbalance bench", f"--json {args.json} is a directory; name a file")
    else:
        # Never overwrite or delete a file the user has: every run gets its own.
        json_path = os.path.abspath(fresh_path(os.getcwd(), "mmbalance-bench", ".jsonl"))
    try:
        os.makedirs(os.path.dirname(json_path), exist_ok=True)
        with open(json_path, "a"):
            pass
    except OSError as exc:
        return usage_error("mmbalance bench", f"cannot write {json_path}: {exc.strerror or exc}")
    print(f"results: {json_path} (JSON rows, appended)", flush=True)
    names = args.only or list(BENCHES)
    extra = ["--full"] if args.full else ["--quick"] if args.quick else []
    failed = []
    for name in names:
        print(f"\n#### bench.{name}", flush=True)
        try:
            mod = importlib.import_module(f"mmbalance.bench.{name}")
            mod.main(extra + (["--real"] if args.real and name == "cp" else []) + ["--json", json_path])
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failing benchmark does not stop the rest
            if isinstance(exc, SystemExit) and not exc.code:
                continue
            print(f"[{name}] failed: {exc!r}", file=sys.stderr)
            failed.append(name)
    if not args.only:
        print("\n#### bench.kernel_audit (sm_90, sm_80)", flush=True)
        audit = importlib.import_module("mmbalance.bench.kernel_audit")
        stem = json_path[: -len(".jsonl")] if json_path.endswith(".jsonl") else json_path
        for arch in ("sm_90", "sm_80"):
            try:
                rc = audit.main(["--arch", arch, "--json", f"{stem}.audit_{arch}.json"])
            except SystemExit as exc:
                rc = exc.code
            if rc:
                failed.append(f"kernel_audit[{arch}]")
    _summary(json_path)
    print(f"\nresults written to {json_path}")
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _span(values: list[float]) -> str:
    """``a`` when every value is the same, else ``lo-hi``: rows of different sizes are not averaged."""
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if f"{lo:.4g}" == f"{hi:.4g}" else f"{lo:.4g}-{hi:.4g}"


def _summary(json_path: str) -> None:
    """One line per (op, provider): rows, shapes, and the range of the time and of the headline
    metric over them (a median across different sizes would mean nothing)."""
    import json

    if not os.path.exists(json_path):
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    with open(json_path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                groups.setdefault((r.get("op", "?"), r.get("provider", "?")), []).append(r)
    keys = (
        "makespan/lb",
        "ours_speedup",
        "frac_of_copy",
        "tflops",
        "ratio",
        "speedup_vs_none",
        "max_offnode_MB",
    )
    print(f"\n== summary ({json_path}): ranges over the rows' shapes ==")
    print(f"{'op':<28} {'provider':<20} {'rows':>4} {'shapes':>6} {'ms':>17}  headline")
    for (op, prov), rows in sorted(groups.items()):
        times = [r["time_ms"] for r in rows if isinstance(r.get("time_ms"), (int, float))]
        head = []
        for k in keys:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            if vals:
                head.append(f"{k} {_span(vals)}")
        shapes = len({r.get("shape") for r in rows})
        ms = _span(times) if times else "-"
        print(f"{op[:28]:<28} {prov[:20]:<20} {len(rows):>4} {shapes:>6} {ms:>17}  {', '.join(head)}")


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def _version() -> str:
    from mmbalance import __version__

    return f"mmbalance {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # demo and simulate own their flags; hand them everything after the subcommand
    if argv and argv[0] == "demo":
        return _delegate("mmbalance.bench.demo", argv[1:])
    if argv and argv[0] == "simulate":
        return _delegate("mmbalance.bench.simulate", argv[1:])
    p = argparse.ArgumentParser(prog="mmbalance", description="Load balancing for multimodal LLM training.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="end-to-end balanced training on N ranks (mmbalance demo --help)")
    sub.add_parser("simulate", help="what balancing gives at your scale (mmbalance simulate --help)")
    b = sub.add_parser(
        "bench",
        help="run the benchmark suite (each benchmark's default sweep; --quick for a smoke run)",
        description="Run the benchmark suite: each benchmark's default sweep (minutes on a CPU), "
        "--quick for a smoke run of the smallest sizes, --full for the whole sweep; then, when no NAME "
        "is given, the kernel audit for sm_90 and sm_80.",
        formatter_class=HelpFormatter,
    )
    b.add_argument(
        "only", nargs="*", metavar="NAME", help=f"benchmarks to run, of {', '.join(BENCHES)} (default: all)"
    )
    size = b.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the full sweep (longer than the default)")
    size.add_argument("--quick", action="store_true", help="a smoke run: the smallest sizes only")
    b.add_argument(
        "--json",
        metavar="FILE",
        help="append JSON rows to FILE (default: a new file mmbalance-bench-<time>.jsonl here)",
    )
    b.add_argument(
        "--real", action="store_true", help="cp: also real steps of a tiny Llama on 4 gloo ranks (torchrun)"
    )
    b.set_defaults(func=_bench)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
