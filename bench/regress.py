"""Regression gate: compare benchmark rows against stored baseline rows.

    python -m bench.regress NEW.jsonl BASELINE.jsonl [--tolerance 0.10]

Rows are matched on (op, provider, shape, dtype, device). A row regresses when its ``time_ms`` is
more than ``tolerance`` above the baseline's. Rows without a baseline are listed, not failed (a new
benchmark or a new machine); a missing baseline file passes with a note, so the gate can be seeded
by committing the first run's rows. Exit status 1 on any regression.
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
    if not os.path.exists(args.baseline):
        print(f"no baseline at {args.baseline}: nothing to compare (commit these rows to seed it)")
        return 0
    regressions, unmatched = compare(_load(args.new), _load(args.baseline), args.tolerance)
    for u in unmatched:
        print(f"no baseline: {u}")
    for r in regressions:
        print(f"REGRESSION {r}")
    print(f"{len(regressions)} regressions, {len(unmatched)} rows without a baseline")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
