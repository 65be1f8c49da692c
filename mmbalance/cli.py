"""The ``mmbalance`` command line: ``mmbalance bench|demo|simulate``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

BENCHES = ("planners", "varlen", "alltoall", "attention", "overlap")


def _repo_root() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isdir(os.path.join(root, "bench")) else None


def _bench(args: argparse.Namespace) -> int:
    root = _repo_root()
    if root is None:
        print(
            "mmbalance bench runs from a source checkout (the bench/ folder is not installed)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, root)

    json_path = args.json or os.path.join(root, "results", "bench.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    if not args.json and os.path.exists(json_path):
        os.remove(json_path)
    unknown = [n for n in args.only if n not in BENCHES]
    if unknown:
        print(f"mmbalance bench: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    names = args.only or list(BENCHES)
    failed = []
    for name in names:
        print(f"\n#### bench.{name}", flush=True)
        try:
            mod = importlib.import_module(f"bench.{name}")
            mod.main((["--full"] if args.full else []) + ["--json", json_path])
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one failing benchmark does not stop the rest
            if isinstance(exc, SystemExit) and not exc.code:
                continue
            print(f"[{name}] failed: {exc!r}", file=sys.stderr)
            failed.append(name)
    if not args.only:
        print("\n#### bench.kernel_audit (sm_90, sm_80)", flush=True)
        audit = importlib.import_module("bench.kernel_audit")
        for arch in ("sm_90", "sm_80"):
            try:
                rc = audit.main(
                    ["--arch", arch, "--json", os.path.join(os.path.dirname(json_path), f"audit_{arch}.json")]
                )
            except SystemExit as exc:
                rc = exc.code
            if rc:
                failed.append(f"kernel_audit[{arch}]")
    _summary(json_path)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _summary(json_path: str) -> None:
    """One line per (op, provider): rows, median time, and the headline metric where there is one."""
    import json
    import statistics

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
    print(f"\n== summary ({json_path}) ==")
    print(f"{'op':<28} {'provider':<20} {'rows':>4} {'median ms':>10}  headline")
    for (op, prov), rows in sorted(groups.items()):
        times = [r["time_ms"] for r in rows if isinstance(r.get("time_ms"), (int, float))]
        head = []
        for k in keys:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            if vals:
                head.append(f"{k} {statistics.median(vals):.4g}")
        med = f"{statistics.median(times):.4g}" if times else "-"
        print(f"{op[:28]:<28} {prov[:20]:<20} {len(rows):>4} {med:>10}  {', '.join(head)}")


def _delegate(module: str, argv: list[str]) -> int:
    root = _repo_root()
    if root is None:
        print(
            f"mmbalance {module.split('.')[-1]} runs from a source checkout (bench/ is not installed)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, root)
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # demo and simulate own their flags; hand them everything after the subcommand
    if argv and argv[0] == "demo":
        return _delegate("bench.demo", argv[1:])
    if argv and argv[0] == "simulate":
        return _delegate("bench.simulate", argv[1:])
    p = argparse.ArgumentParser(prog="mmbalance", description="Load balancing for multimodal LLM training.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="end-to-end balanced training on N ranks (mmbalance demo --help)")
    sub.add_parser("simulate", help="what balancing gives at your scale (mmbalance simulate --help)")
    b = sub.add_parser("bench", help="run the benchmark suite (quick by default)")
    b.add_argument("only", nargs="*", metavar="NAME", help=f"benchmarks to run, of {', '.join(BENCHES)} (default: all)")
    b.add_argument("--full", action="store_true", help="the full sweep")
    b.add_argument("--json", metavar="FILE", help="append JSON rows to FILE")
    b.set_defaults(func=_bench)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
