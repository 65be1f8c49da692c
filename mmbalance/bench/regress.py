"""Regression gate: compare benchmark rows against stored baseline rows.

    python -m mmbalance.bench.regress NEW.jsonl BASELINE.jsonl [--tolerance 0.10]

Rows are matched on (op, provider, shape, dtype, device). A row regresses when its ``time_ms`` is
more than ``tolerance`` above the baseline's. Rows without a baseline are listed, not failed (a new
benchmark or a new machine). Exit status 1 on any regression, 2 when a file cannot be read (a
missing baseline is an error here, never a silent pass).

A baseline is simply an earlier run's rows: ``mmbalance bench --json baseline.jsonl`` on the same
machine. ``.github/workflows/gpu.yml`` uses the rows of the last successful run on main.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _load(path: str) -> dict[tuple, dict]:
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows[(r.get("op"), r.get("provider"), r.get("shape"), r.get("dtype"), r.get("device"))] = r
    return rows


def compare(new: dict[tuple, dict], base: dict[tuple, dict], tolerance: float) -> tuple[list[str], list[str]]:
    regressions, unmatched = [], []
    for key, r in sorted(new.items(), key=lambda kv: str(kv[0])):
        b = base.get(key)
        if b is None:
            unmatched.append(" / ".join(map(str, key)))
            continue
        if r["time_ms"] > b["time_ms"] * (1 + tolerance):
            regressions.append(f"{' / '.join(map(str, key))}: {r['time_ms']:.4g} ms vs {b['time_ms']:.4g} ms")
    return regressions, unmatched


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("new")
    p.add_argument("baseline")
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)
    for name, path in (("new rows", args.new), ("baseline", args.baseline)):
        if not os.path.isfile(path):
            print(
                f"mmbalance.bench.regress: no {name} at {path} (record a baseline with "
                "`mmbalance bench --json FILE` on the same machine)",
                file=sys.stderr,
            )
            return 2
    regressions, unmatched = compare(_load(args.new), _load(args.baseline), args.tolerance)
    for u in unmatched:
        print(f"no baseline: {u}")
    for r in regressions:
        print(f"REGRESSION {r}")
    print(f"{len(regressions)} regressions, {len(unmatched)} rows without a baseline")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
