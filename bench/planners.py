"""Planner benchmark on real data: speed, quality and locality of post-balancing.

    python -m bench.planners [--full] [--json FILE]

Inputs are per-example sizes sampled from the shipped real-data mixture (images with tiles, videos,
speech; see ``mmbalance.balancing.datasets``), 60 examples per rank, every rank's examples in a
contiguous block (what ``gather_lengths`` returns).

Tables:
1. speed and quality of one "sum" plan at up to 2560 ranks: ours (C++) vs a plain Python LPT
   (OrchMLLM alg. 1) and verl's Karmarkar-Karp balancer (``verl.utils.seqlen_balancing``, when
   installed; it is O(n k log k), so it runs only up to 512 ranks), as makespan / lower bound;
2. every policy vs the paper's algorithm for it, on the phase it suits;
3. locality: tokens moved and the worst per-rank off-node send of our located plans vs plain
   balancing followed by the node-wise permutation (alg. 3);
4. per-phase balance (max/mean load across ranks) before and after.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from mmbalance.balancing import lower_bound, node_wise_permutation, paper_algorithm, post_balance
from mmbalance.balancing.datasets import mixture

from .harness import Row, base_parser, device_name, report, time_cpu

PER_RANK = 60
RANKS_PER_NODE = 8


def python_lpt(lengths: list[int], k: int) -> list[int]:
    """OrchMLLM algorithm 1 in plain Python (heapq), the baseline a Python trainer would write."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    heap = [(0, r) for r in range(k)]
    dst = [0] * len(lengths)
    for i in order:
        load, r = heapq.heappop(heap)
        dst[i] = r
        heapq.heappush(heap, (load + lengths[i], r))
    return dst


def interleaved(fn_a, fn_b, rounds: int, a_per_round: int) -> tuple[float, float]:
    """Median ms of ``fn_a`` and ``fn_b``, timed in alternating rounds (``a_per_round`` calls of
    ``fn_a``, then one of ``fn_b``), after one warm-up call of each."""
    fn_a(), fn_b()
    ta, tb = [], []
    for _ in range(rounds):
        for _ in range(a_per_round):
            t0 = time.perf_counter()
            fn_a()
            ta.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        fn_b()
        tb.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ta)), float(np.median(tb))


def _verl():
    try:
        from verl.utils.seqlen_balancing import karmarkar_karp
    except Exception:  # noqa: BLE001 - any import failure means the peer is unavailable
        return None
    return karmarkar_karp


def _makespan(lengths: np.ndarray, dst: np.ndarray, d: int) -> float:
    return float(np.bincount(dst, weights=lengths, minlength=d).max())


def scales(args) -> list[int]:
    """Rank counts of the speed and locality tables."""
    if args.quick:
        return [64]
    return [64, 256, 512, 1024, 2560] if args.full else [64, 512, 2560]


def bench_speed(ranks: list[int], full: bool) -> list[Row]:
    rows = []
    dev = device_name()
    kk = _verl()
    for d in ranks:
        lengths = mixture(PER_RANK * d, d).llm
        src = np.repeat(np.arange(d), PER_RANK)
        lb = lower_bound(lengths, d)
        shape = f"{d}x{PER_RANK}"
        reps = 10

        as_list = lengths.tolist()
        # ours and the Python LPT timed in alternation, so that a noisy stretch of a shared
        # machine hits both and the ratio stays meaningful
        t, t_py = interleaved(
            lambda: post_balance(lengths, d), lambda: python_lpt(as_list, d), rounds=7, a_per_round=5
        )
        ours = post_balance(lengths, d)
        rows.append(
            Row("post_balance[sum]", "mmbalance", shape, "int64", dev, t, {"makespan/lb": ours.makespan / lb})
        )
        t_loc = time_cpu(
            lambda: post_balance(lengths, d, src_ranks=src, ranks_per_node=RANKS_PER_NODE), reps=reps
        )
        loc = post_balance(lengths, d, src_ranks=src, ranks_per_node=RANKS_PER_NODE)
        rows.append(
            Row(
                "post_balance[sum]",
                "mmbalance+locality",
                shape,
                "int64",
                dev,
                t_loc,
                {"makespan/lb": loc.makespan / lb},
            )
        )
        py = np.asarray(python_lpt(as_list, d))
        rows.append(
            Row(
                "post_balance[sum]",
                "python-lpt",
                shape,
                "int64",
                dev,
                t_py,
                {"makespan/lb": _makespan(lengths, py, d) / lb, "ours_speedup": t_py / t},
            )
        )
        if kk is not None and d <= (512 if full else 64):
            t0 = time.perf_counter()
            parts = kk(as_list, d, False)
            t_kk = (time.perf_counter() - t0) * 1e3
            dst = np.empty(len(as_list), dtype=np.int64)
            for r, p in enumerate(parts):
                dst[p] = r
            rows.append(
                Row(
                    "post_balance[sum]",
                    "verl-kk",
                    shape,
                    "int64",
                    dev,
                    t_kk,
                    {"makespan/lb": _makespan(lengths, dst, d) / lb, "ours_speedup": t_kk / t},
                )
            )
        elif kk is None and d == 64:
            print("(verl not installed: `make peers` installs it for the Karmarkar-Karp comparison)")
    return rows


def bench_policies(full: bool) -> list[Row]:
    rows = []
    dev = device_name()
    d = 256 if full else 64
    sizes = mixture(PER_RANK * d, 3)
    # (policy, phase lengths, paper algorithm, alpha, beta); audio encoders pad, the ViT packs
    cases = [
        ("sum", sizes.vision, 1, 1.0, 0.0),
        ("padded", sizes.audio, 2, 1.0, 0.0),
        ("quadratic", sizes.llm, 1, 1.0, 1.0 / 8192),
        ("conv", sizes.audio, 5, 1.0, 1.0 / 64),
    ]
    for policy, lengths, alg, alpha, beta in cases:
        t = time_cpu(lambda: post_balance(lengths, d, policy, alpha=alpha, beta=beta), reps=10)
        ours = post_balance(lengths, d, policy, alpha=alpha, beta=beta)
        paper_dst = paper_algorithm(lengths, d, alg)
        paper = post_balance(lengths, d, policy, alpha=alpha, beta=beta)  # for its cost function
        from mmbalance.balancing._core_api import batch_costs

        paper_cost = float(batch_costs(lengths, paper_dst, d, policy, alpha, beta).max())
        del paper
        lb = lower_bound(lengths, d, policy, alpha=alpha, beta=beta)
        rows.append(
            Row(
                f"post_balance[{policy}]",
                "mmbalance",
                f"{d}x{PER_RANK}",
                "int64",
                dev,
                t,
                {
                    "makespan/lb": ours.makespan / lb,
                    "paper/lb": paper_cost / lb,
                    "paper_alg": alg,
                    "ours/paper": ours.makespan / paper_cost if paper_cost else 1.0,
                },
            )
        )
    return rows


def bench_locality(ranks: list[int], full: bool, exact: bool = True) -> list[Row]:
    rows = []
    dev = device_name()
    for d in ranks:
        for seed in range(1 if not full else 3):
            lengths = mixture(PER_RANK * d, 100 + seed).llm
            src = np.repeat(np.arange(d), PER_RANK)
            total = lengths.sum()
            lb = lower_bound(lengths, d)
            t = time_cpu(
                lambda: post_balance(lengths, d, src_ranks=src, ranks_per_node=RANKS_PER_NODE), reps=5
            )
            ours = post_balance(lengths, d, src_ranks=src, ranks_per_node=RANKS_PER_NODE)
            plain = post_balance(lengths, d)
            method = "exact" if d <= 64 and exact else "fast"
            t_perm = time_cpu(
                lambda: node_wise_permutation(plain, RANKS_PER_NODE, src_ranks=src, method=method),
                reps=1,
                warmup=0,
            )
            perm = node_wise_permutation(plain, RANKS_PER_NODE, src_ranks=src, method=method)
            off_ours = int(ours.off_node_send(RANKS_PER_NODE).max())
            off_perm = int(perm.off_node_send(RANKS_PER_NODE).max())
            load = np.bincount(src, weights=lengths, minlength=d)
            rows.append(
                Row(
                    "locality[sum]",
                    "mmbalance",
                    f"{d}x{PER_RANK}",
                    "int64",
                    dev,
                    t,
                    {
                        "seed": seed,
                        "makespan/lb": ours.makespan / lb,
                        "moved%": 100 * ours.moved_tokens() / total,
                        "needed%": 100 * np.maximum(0, load - ours.makespan).sum() / total,
                        "max_offnode": off_ours,
                        "alg3_max_offnode": off_perm,
                        "ratio": off_ours / max(off_perm, 1),
                        "alg3_moved%": 100 * perm.moved_tokens() / total,
                        "alg3": method,
                        "alg3_ms": t_perm,
                    },
                )
            )
    return rows


def bench_phases(full: bool) -> list[Row]:
    rows = []
    dev = device_name()
    for d in [64] if not full else [64, 512]:
        sizes = mixture(PER_RANK * d, 7)
        src = np.repeat(np.arange(d), PER_RANK)
        for phase, policy in (("vision", "sum"), ("audio", "padded"), ("llm", "sum")):
            lengths = sizes.phase(phase)
            before = np.bincount(src, weights=lengths, minlength=d)
            plan = post_balance(lengths, d, policy, src_ranks=src, ranks_per_node=RANKS_PER_NODE)
            if policy == "padded":
                cnt = np.bincount(src, minlength=d)
                mx = np.zeros(d)
                np.maximum.at(mx, src, lengths)
                before = cnt * mx
            after = plan.costs
            rows.append(
                Row(
                    f"phase[{phase}]",
                    "mmbalance",
                    f"{d}x{PER_RANK}",
                    "int64",
                    dev,
                    0.0,
                    {
                        "policy": policy,
                        "before_max/mean": before.max() / before.mean(),
                        "after_max/mean": after.max() / after.mean(),
                        "moved%": 100 * plan.moved_tokens() / max(1, lengths.sum()),
                    },
                )
            )
    return rows


def main(argv=None) -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args(argv)
    report(
        bench_speed(scales(args), args.full),
        args.json,
        "1. speed and quality of one 'sum' plan (real-data LLM lengths)",
    )
    report(
        bench_policies(args.full),
        args.json,
        "2. every policy vs the paper's algorithm (makespan / lower bound)",
    )
    report(
        bench_locality(scales(args), args.full, exact=not args.quick),
        args.json,
        "3. locality: ours vs plain + node-wise permutation (alg. 3), 8 ranks/node",
    )
    report(bench_phases(args.full), args.json, "4. per-phase balance before/after (max/mean of batch cost)")
    if not args.quick:
        from . import planners_extra

        planners_extra.run(args.full, args.json)


if __name__ == "__main__":
    main()
