"""The ``mmbalance`` command line: ``mmbalance bench|demo|simulate|launch``, ``mmbalance --version``.

Every command runs from an installed package (the benchmarks, demo and simulator are
``mmbalance.bench``). Mistakes in the arguments or the input files end in one line on stderr and
exit status 2, never in a traceback.

Each command imports its module when it runs (``mmbalance bench planners`` and ``mmbalance
simulate`` never import torch), with a plain ``import`` statement, so the import graph shows them.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from mmbalance.bench.harness import HelpFormatter, fresh_path, usage_error

BENCHES = ("planners", "varlen", "alltoall", "attention", "overlap", "hf", "sampler", "cp", "gdn")
DEVICE_BENCHES = ("varlen", "attention", "hf")  # the benchmarks that take --device


def load_benchmark(name: str) -> ModuleType:
    """The module of benchmark ``name`` (one of :data:`BENCHES`, or ``"kernel_audit"``): its room of
    ``mmbalance.bench``, or the module of a room it is named after (``moves.varlen``), imported now:
    a benchmark whose imports fail (a missing extra) then fails alone."""
    if name == "planners":
        from mmbalance.bench import planners

        return planners
    if name == "varlen":
        from mmbalance.bench.moves import varlen

        return varlen
    if name == "alltoall":
        from mmbalance.bench.moves import alltoall

        return alltoall
    if name == "attention":
        from mmbalance.bench import attention

        return attention
    if name == "overlap":
        from mmbalance.bench.moves import overlap

        return overlap
    if name == "hf":
        from mmbalance.bench import hf

        return hf
    if name == "sampler":
        from mmbalance.bench.planners import sampler

        return sampler
    if name == "cp":
        from mmbalance.bench import cp

        return cp
    if name == "gdn":
        from mmbalance.bench.cp import gdn

        return gdn
    if name == "kernel_audit":
        from mmbalance.bench import kernel_audit

        return kernel_audit
    raise ValueError(f"name must be one of {(*BENCHES, 'kernel_audit')}, got {name!r}")


def _bench(args: argparse.Namespace) -> int:
    unknown = [n for n in args.only if n not in BENCHES]
    if unknown:
        return usage_error(
            "mmbalance bench", f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}"
        )
    if args.real and args.only and "cp" not in args.only:
        return usage_error("mmbalance bench", "--real adds the real steps of the cp benchmark: name cp too")
    if args.vlm and args.only and "cp" not in args.only:
        return usage_error(
            "mmbalance bench", "--vlm selects the cp benchmark's vision-language data: name cp too"
        )
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
            real = (["--real"] if args.real and name == "cp" else []) + (
                ["--vlm"] if args.vlm and name == "cp" else []
            )
            if args.device and name in DEVICE_BENCHES:
                real += ["--device", args.device]
            load_benchmark(name).main(extra + real + ["--json", json_path])
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failing benchmark does not stop the rest
            if isinstance(exc, SystemExit) and not exc.code:
                continue
            print(f"[{name}] failed: {exc!r}", file=sys.stderr)
            failed.append(name)
    if not args.only:
        print("\n#### bench.kernel_audit (sm_90, sm_80)", flush=True)
        audit = load_benchmark("kernel_audit")
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


def _version() -> str:
    from mmbalance import __version__

    return f"mmbalance {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # demo and simulate own their flags; hand them everything after the subcommand
    if argv and argv[0] == "demo":
        from mmbalance.bench import demo

        return int(demo.main(argv[1:]) or 0)
    if argv and argv[0] == "simulate":
        from mmbalance.bench.planners import simulate

        return int(simulate.main(argv[1:]) or 0)
    if argv and argv[0] == "launch":
        from mmbalance.integrations import launch

        return int(launch.main(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="mmbalance", description="Load balancing for multimodal LLM training.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="end-to-end balanced training on N ranks (mmbalance demo --help)")
    sub.add_parser("simulate", help="what balancing gives at your scale (mmbalance simulate --help)")
    sub.add_parser(
        "launch",
        help="run a training program (llamafactory-cli, swift, a script) with every Trainer it builds "
        "balanced (mmbalance launch --help)",
    )
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
    b.add_argument(
        "--vlm",
        action="store_true",
        help="cp: vision-language data (long videos, image documents) against static CP and pre-embedding",
    )
    b.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="attention, varlen: the device to measure on; hf: one end-to-end training step on it",
    )
    b.set_defaults(func=_bench)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
