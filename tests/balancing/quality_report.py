"""Planner quality against the exact optimum: how far post_balance is from optimal, per policy.

    python -m tests.balancing.quality_report [--n-instances 1000] [--seed 0] [--policies sum,conv]
                                    [--json FILE] [--cache FILE | --no-cache] [--node-limit N]

For each instance of :mod:`tests.balancing.instances` (n 8..40, d 2..6, heavy-tailed lengths,
ties, Graham's LPT worst case, planted perfect partitions; several ``beta/alpha``) and each policy:

* the proven optimal makespan from :mod:`tests.balancing.exact` (independent of the C++ core);
* ``post_balance`` plain, and with ``src_ranks`` = a random source assignment (seeded per
  instance; the path users take, default ``tolerance``), each re-costed from its ``dst_rank``
  with the reference cost definitions;
* ratio = makespan / optimum. Per policy and mode: mean, p95, max ratio, the count of optimal
  plans (ratio <= 1 + 1e-9) and the worst instance, printed so it can be pasted into a test.

Also checked on every instance: no plan beats the optimum (that would be a solver or planner
bug), ``lower_bound`` never exceeds it, and ``plan.costs`` agrees with the re-costed makespan.
The exact solver's time per solve is reported per policy. An instance the solver cannot prove
within ``--node-limit`` is left out of the ratios and listed with its proven bracket.

Exact optima are cached in a JSON file (default under /tmp, keyed by instance content, policy and
coefficients) so later runs only re-plan; the cache keeps the measured solve times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mmbalance.balancing import lower_bound, post_balance  # noqa: E402
from tests.balancing.exact import makespan_of, solve  # noqa: E402
from tests.balancing.instances import generate  # noqa: E402

POLICIES = ("sum", "padded", "quadratic", "conv", "padded_quadratic")
OPTIMAL_RTOL = 1e-9
DEFAULT_CACHE = "/tmp/mmbalance_exact_cache.json"
CACHE_VERSION = 1


def coefficients(policy: str, alpha: float, beta: float) -> tuple[float, float]:
    """The coefficients that matter for ``policy`` ("sum"/"padded" ignore them)."""
    return (1.0, 0.0) if policy in ("sum", "padded") else (alpha, beta)


def cache_key(inst, policy: str) -> str:
    a, b = coefficients(policy, inst.alpha, inst.beta)
    return f"{policy}|{','.join(map(str, inst.lengths))}|{inst.num_ranks}|{a!r}|{b!r}"


def load_cache(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data.get("entries", {}) if data.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError):
        return {}


def save_cache(path: str | None, entries: dict) -> None:
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": entries}, f)
    os.replace(tmp, path)


def exact_entry(inst, policy: str, node_limit: int, cache: dict) -> tuple[dict, bool]:
    """``{"opt", "lower", "proven", "seconds", "nodes", "method"}``; second value: from the cache."""
    key = cache_key(inst, policy)
    hit = cache.get(key)
    # an unproven entry is retried when the node limit grew
    if hit is not None and (hit["proven"] or hit.get("node_limit", 0) >= node_limit):
        return hit, True
    a, b = coefficients(policy, inst.alpha, inst.beta)
    t0 = time.perf_counter()
    sol = solve(list(inst.lengths), inst.num_ranks, policy, a, b, node_limit=node_limit)
    seconds = time.perf_counter() - t0
    entry = {
        "opt": sol.makespan,
        "lower": sol.lower,
        "proven": sol.proven,
        "seconds": seconds,
        "nodes": sol.nodes,
        "method": sol.method,
        "node_limit": node_limit,
    }
    cache[key] = entry
    return entry, False


def source_ranks(inst) -> np.ndarray:
    """A random source assignment, seeded by the instance index."""
    rng = np.random.default_rng([inst.index, 7919])
    return rng.integers(0, inst.num_ranks, len(inst.lengths)).astype(np.int64)


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def evaluate(
    instances, policies, node_limit: int, cache: dict, progress: bool = True, checkpoint=None
) -> dict:
    modes = ("plain", "src_ranks")
    res = {
        p: {
            "ratios": {m: [] for m in modes},
            "worst": {m: None for m in modes},
            "unproven": [],
            "solve_s": [],
            "cached": 0,
            "problems": [],
            "lb_over_opt": [],
            "records": [],
        }
        for p in policies
    }
    t_start = time.perf_counter()
    last_save = time.perf_counter()
    for k, inst in enumerate(instances):
        lengths = list(inst.lengths)
        d = inst.num_ranks
        src = source_ranks(inst)
        for p in policies:
            r = res[p]
            a, b = coefficients(p, inst.alpha, inst.beta)
            entry, cached = exact_entry(inst, p, node_limit, cache)
            r["solve_s"].append(entry["seconds"])
            r["cached"] += cached
            opt = entry["opt"]
            lb = lower_bound(lengths, d, p, alpha=a, beta=b)
            if entry["proven"]:
                r["lb_over_opt"].append(lb / opt if opt > 0 else 1.0)
                if lb > opt * (1 + 1e-12) + 1e-9:
                    r["problems"].append(f"lower_bound {lb!r} > optimum {opt!r} on instance {inst.index}")
            else:
                r["unproven"].append({"index": inst.index, "lower": entry["lower"], "upper": opt})
            record = {
                "index": inst.index,
                "kind": inst.kind,
                "n": len(lengths),
                "d": d,
                "alpha": a,
                "beta": b,
            }
            r["records"].append(record)
            for mode in modes:
                plan = post_balance(
                    lengths, d, p, alpha=a, beta=b, src_ranks=src if mode == "src_ranks" else None
                )
                mk = makespan_of(lengths, plan.dst_rank, d, p, a, b)
                if abs(mk - plan.makespan) > 1e-9 * max(1.0, mk):
                    r["problems"].append(
                        f"{mode}: plan.costs max {plan.makespan!r} != recomputed {mk!r} on instance {inst.index}"
                    )
                ratio = mk / opt if opt > 0 else (1.0 if mk == 0 else float("inf"))
                if not entry["proven"]:
                    # the optimum is only bracketed: the ratio is at least mk / upper
                    r["unproven"][-1][f"{mode}_ratio_at_least"] = ratio
                    continue
                record[mode] = ratio
                if ratio < 1 - 1e-12:
                    r["problems"].append(
                        f"{mode}: makespan {mk!r} below the optimum {opt!r} on instance {inst.index}"
                    )
                r["ratios"][mode].append(ratio)
                w = r["worst"][mode]
                if w is None or ratio > w["ratio"]:
                    r["worst"][mode] = {
                        "ratio": ratio,
                        "makespan": mk,
                        "optimum": opt,
                        **inst.as_dict(),
                        "alpha": a,
                        "beta": b,
                        **({"src_ranks": src.tolist()} if mode == "src_ranks" else {}),
                    }
        if progress and (k + 1) % 50 == 0:
            print(
                f"  {k + 1}/{len(instances)} instances, {time.perf_counter() - t_start:.0f} s",
                file=sys.stderr,
            )
        if checkpoint is not None and time.perf_counter() - last_save > 60:
            checkpoint()  # keep the solved optima if the run is interrupted
            last_save = time.perf_counter()
    return res


def summarize(res: dict, policies) -> list[dict]:
    rows = []
    for p in policies:
        r = res[p]
        for mode in ("plain", "src_ranks"):
            xs = r["ratios"][mode]
            rows.append(
                {
                    "policy": p,
                    "mode": mode,
                    "n": len(xs),
                    "mean": float(np.mean(xs)) if xs else float("nan"),
                    "p95": percentile(xs, 95),
                    "max": float(np.max(xs)) if xs else float("nan"),
                    "optimal": int(sum(x <= 1 + OPTIMAL_RTOL for x in xs)),
                    "unproven": len(r["unproven"]),
                    "worst": r["worst"][mode],
                }
            )
    return rows


def print_report(rows, res, policies) -> None:
    print()
    print(f"{'policy':<17} {'mode':<10} {'mean':>9} {'p95':>9} {'max':>9} {'optimal':>11} {'unproven':>8}")
    for row in rows:
        print(
            f"{row['policy']:<17} {row['mode']:<10} {row['mean']:>9.5f} {row['p95']:>9.5f} {row['max']:>9.5f} "
            f"{row['optimal']:>5}/{row['n']:<5} {row['unproven']:>8}"
        )
    print()
    print(
        f"{'exact solver':<17} {'solves':>6} {'mean s':>8} {'p95 s':>8} {'max s':>8} {'total s':>8} {'cached':>6}"
    )
    for p in policies:
        t = res[p]["solve_s"]
        print(
            f"{p:<17} {len(t):>6} {np.mean(t):>8.3f} {percentile(t, 95):>8.3f} {np.max(t):>8.2f} {np.sum(t):>8.1f} "
            f"{res[p]['cached']:>6}"
        )
    print()
    print("lower_bound / optimum (library bound tightness): min, mean")
    for p in policies:
        x = res[p]["lb_over_opt"]
        if x:
            print(f"  {p:<17} {np.min(x):.4f} {np.mean(x):.4f}")
    print()
    print(
        "worst instances (reproduce: post_balance(lengths, num_ranks, policy, alpha=, beta=[, src_ranks=]))"
    )
    for row in rows:
        w = row["worst"]
        if w is None or w["ratio"] <= 1 + OPTIMAL_RTOL:
            continue
        src = f" src_ranks={w['src_ranks']}" if "src_ranks" in w else ""
        print(
            f"  {row['policy']}/{row['mode']}: ratio {w['ratio']:.6f} (makespan {w['makespan']!r}, optimum "
            f"{w['optimum']!r}) instance {w['index']} kind={w['kind']} num_ranks={w['num_ranks']} "
            f"alpha={w['alpha']!r} beta={w['beta']!r}\n    lengths={w['lengths']}{src}"
        )
    for p in policies:
        for u in res[p]["unproven"]:
            print(
                f"  unproven {p} instance {u['index']}: optimum in [{u['lower']!r}, {u['upper']!r}], "
                f"plain ratio >= {u.get('plain_ratio_at_least', float('nan')):.5f}"
            )
        for msg in res[p]["problems"]:
            print(f"  PROBLEM {p}: {msg}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-instances", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all five)")
    ap.add_argument("--json", default=None, help="write the summary rows (and per-instance ratios) here")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help=f"exact-optimum cache (default {DEFAULT_CACHE})")
    ap.add_argument("--no-cache", action="store_true", help="solve everything, read and write no cache")
    ap.add_argument("--node-limit", type=int, default=2_000_000, help="B&B nodes per solve before giving up")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.replace(" ", ",").split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    cache_path = None if args.no_cache else args.cache
    cache = load_cache(cache_path)
    instances = generate(args.n_instances, seed=args.seed)
    t0 = time.perf_counter()
    try:
        res = evaluate(
            instances, policies, args.node_limit, cache, checkpoint=lambda: save_cache(cache_path, cache)
        )
    finally:
        save_cache(cache_path, cache)
    rows = summarize(res, policies)
    print_report(rows, res, policies)
    print(f"\n{len(instances)} instances x {len(policies)} policies in {time.perf_counter() - t0:.1f} s")
    if args.json:
        out = {
            "n_instances": args.n_instances,
            "seed": args.seed,
            "node_limit": args.node_limit,
            "rows": rows,
            "ratios": {p: res[p]["ratios"] for p in policies},
            "instances": {p: res[p]["records"] for p in policies},
            "solve_seconds": {p: res[p]["solve_s"] for p in policies},
            "unproven": {p: res[p]["unproven"] for p in policies},
            "problems": {p: res[p]["problems"] for p in policies},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if any(res[p]["problems"] for p in policies) else 0


if __name__ == "__main__":
    sys.exit(main())
