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
        print("mmbalance bench runs from a source checkout (the bench/ folder is not installed)", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    names = args.only or list(BENCHES)
    failed = []
    for name in names:
        try:
            mod = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError as exc:
            print(f"[{name}] not available: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        argv = (["--full"] if args.full else []) + (["--json", args.json] if args.json else [])
        print(f"\n#### bench.{name}")
        mod.main(argv)
    if "planners" in names or not args.only:
        try:
            audit = importlib.import_module("bench.kernel_audit")
        except ModuleNotFoundError:
            audit = None
        if audit is not None and not args.only:
            print("\n#### bench.kernel_audit (sm_90)")
            audit.main(["--arch", "sm_90"] + (["--json", args.json] if args.json else []))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mmbalance", description="Load balancing for multimodal LLM training.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="run the benchmark suite (quick by default)")
    b.add_argument("only", nargs="*", choices=BENCHES, help="benchmarks to run (default: all)")
    b.add_argument("--full", action="store_true", help="the full sweep")
    b.add_argument("--json", metavar="FILE", help="append JSON rows to FILE")
    b.set_defaults(func=_bench)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
