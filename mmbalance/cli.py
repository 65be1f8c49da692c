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


def _delegate(module: str, argv: list[str]) -> int:
    root = _repo_root()
    if root is None:
        print(f"mmbalance {module.split('.')[-1]} runs from a source checkout (bench/ is not installed)", file=sys.stderr)
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
    b.add_argument("only", nargs="*", choices=BENCHES, help="benchmarks to run (default: all)")
    b.add_argument("--full", action="store_true", help="the full sweep")
    b.add_argument("--json", metavar="FILE", help="append JSON rows to FILE")
    b.set_defaults(func=_bench)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
