"""Planner benchmark on real data: speed, quality and locality of post-balancing.

    python -m mmbalance.bench.planners [--quick | --full] [--json FILE] [--plot FILE.png]

Inputs are per-example sizes sampled from the shipped real-data mixture (images with tiles, videos,
speech; see ``mmbalance.balancing.datasets``), 60 examples per rank, every rank's examples in a
contiguous block (what ``gather_lengths`` returns).

Tables:
1. speed and quality of one "sum" plan at up to 2560 ranks: ours (C++) vs a plain Python LPT
   (OrchMLLM alg. 1) and verl's Karmarkar-Karp balancer (``verl.utils.seqlen_balancing``; it is
   O(n k log k), so it runs only at 64 ranks, up to 512 with ``--full``), as makespan / lower bound.
   verl runs in its own environment (``make peers`` creates ``.venv-peers``; its pins conflict with
   ours) through a subprocess; without it the table says so and a ``peers`` row records why;
2. every policy vs the paper's algorithm for it, on the phase it suits;
3. locality: tokens moved and the worst per-rank off-node send of our located plans vs plain
   balancing followed by the node-wise permutation (alg. 3);
4. per-phase balance (max/mean load across ranks) before and after;
5. the real path: the call ``rebalance`` makes (``src_ranks``, then also ``ranks_per_node=8``)
   beside the plain call, per policy, at 2560 and 16384 ranks (64 with ``--quick``; the whole
   scaling series 64..16384 with ``--full`` or ``--plot``), median of 5 calls.

``--plot`` writes a PNG: time per "sum" plan against the peers, and the scaling series of the real
path and the plain call per policy (log-log), with their makespan / lower bound.
"""

from __future__ import annotations

import bisect
import heapq
import os
import sys
import time

import numpy as np

from mmbalance.balancing import lower_bound, node_wise_permutation, post_balance
from mmbalance.balancing.datasets import mixture
from mmbalance.balancing.node_perm import have_exact_solver
from mmbalance.balancing.paper import paper_algorithm

from ..harness import Row, base_parser, device_name, report, time_cpu
from .peers import peer_python, peer_status_row, run_verl

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


def _makespan(lengths: np.ndarray, dst: np.ndarray, d: int) -> float:
    return float(np.bincount(dst, weights=lengths, minlength=d).max())


def scales(args) -> list[int]:
    """Rank counts of the speed and locality tables."""
    if args.quick:
        return [64]
    return [64, 256, 512, 1024, 2560] if args.full else [64, 512, 2560]


def bench_speed(ranks: list[int], full: bool, peers: bool = True) -> list[Row]:
    """Table 1. ``peers=False`` (``--quick``) leaves verl out: starting its environment alone
    takes seconds."""
    rows = []
    dev = device_name()
    python, why = peer_python() if peers else (None, "skipped with --quick")
    peer_ranks = [d for d in ranks if d <= (512 if full else 64)]
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
        if d not in peer_ranks:
            continue
        if python is not None:
            try:
                peer = run_verl(python, lengths, d, reps=3 if d <= 64 else 1)
            except RuntimeError as exc:
                python, why = None, f"verl failed in {python}: {exc}"
            else:
                rows.append(
                    Row(
                        "post_balance[sum]",
                        "verl-kk",
                        shape,
                        "int64",
                        dev,
                        peer["time_ms"],
                        {
                            "makespan/lb": _makespan(lengths, peer["dst"], d) / lb,
                            "ours_speedup": peer["time_ms"] / t,
                            "peer_version": peer["version"],
                        },
                    )
                )
        if d == peer_ranks[0] or python is None:
            rows.append(peer_status_row("verl-kk", shape, dev, python, why))
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
        paper_cost = float(ours.batch_costs(paper_dst).max())
        lb = lower_bound(lengths, d, policy, alpha=alpha, beta=beta)
        extra = {}
        if policy in ("padded", "conv"):  # a second real plan, to tell the bound's gap from ours
            nf = next_fit(lengths, d, policy, alpha, beta)
            extra["next_fit/lb"] = float(ours.batch_costs(nf).max()) / lb
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
                    **extra,
                },
            )
        )
    return rows


def bench_locality(ranks: list[int], full: bool, exact: bool = True) -> list[Row]:
    rows = []
    dev = device_name()
    if exact and not have_exact_solver():
        print(
            "(the node-wise permutation uses its fast heuristic here: the exact solver needs scipy, "
            'pip install "mmbalance[exact]")'
        )
        exact = False
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
            plan = post_balance(lengths, d, policy, src_ranks=src, ranks_per_node=RANKS_PER_NODE)
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
                        "before_max/mean": plan.imbalance(before=True),
                        "after_max/mean": plan.imbalance(),
                        "moved%": 100 * plan.moved_tokens() / max(1, lengths.sum()),
                    },
                )
            )
    return rows


def next_fit(lengths: np.ndarray, d: int, policy: str, alpha: float, beta: float) -> np.ndarray:
    """Destination ranks of the best contiguous next-fit plan: lengths sorted descending, each rank
    takes the longest prefix of the rest whose batch cost stays within a cap, the cap bisected
    down to the least at which ``d`` ranks suffice. A plain reference plan for the policies with
    padding (it is optimal for "padded"), computed here, independent of the C++ core."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    order = np.argsort(-lengths, kind="stable")
    s = lengths[order].astype(np.float64)
    a, h = {
        "padded": (np.zeros_like(s), s),
        "conv": (alpha * s, beta * s * s),
        "padded_quadratic": (np.zeros_like(s), alpha * s + beta * s * s),
    }[policy]
    cum = np.concatenate(([0.0], np.cumsum(a))).tolist()
    a_l, h_l = a.tolist(), h.tolist()
    idx = range(n + 1)

    def starts(cap: float) -> list[int] | None:
        out: list[int] = []
        i = 0
        while i < n:
            if len(out) == d or a_l[i] + h_l[i] > cap:
                return None
            out.append(i)
            lead = h_l[i]
            i = (
                bisect.bisect_right(idx, cap + cum[i] + lead * i, lo=i + 1, key=lambda j: cum[j] + lead * j)
                - 1
            )
        return out

    lo = lower_bound(lengths, d, policy, alpha=alpha, beta=beta)
    hi = max(lo, 1e-300)
    while starts(hi) is None:
        lo, hi = hi, 2.0 * hi
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if starts(mid) is None:
            lo = mid
        else:
            hi = mid
    found = starts(hi)
    if found is None:  # pragma: no cover - hi is feasible by construction
        raise RuntimeError("next_fit: the bisection lost its feasible bound")
    bounds = found + [n]
    dst = np.empty(n, dtype=np.int64)
    for rank in range(len(bounds) - 1):
        dst[order[bounds[rank] : bounds[rank + 1]]] = rank
    return dst


# Policy -> (phase of the real-data mixture, alpha, beta) of the real-path table (table 5).
REAL_PATH_CASES = {
    "sum": ("llm", 1.0, 0.0),
    "quadratic": ("llm", 1.0, 1.0 / 8192),
    "padded": ("audio", 1.0, 0.0),
    "conv": ("audio", 1.0, 1.0 / 64),
    "padded_quadratic": ("audio", 1.0, 1.0 / 64),
}
SERIES_RANKS = [64, 256, 1024, 2560, 4096, 16384]
REAL_PATH_MODES = ("plain", "src_ranks", f"src_ranks+rpn{RANKS_PER_NODE}")


def real_path_ranks(args) -> list[int]:
    """Rank counts of table 5: the scaling series for ``--full`` and ``--plot``."""
    if args.quick:
        return [64, 256] if args.plot else [64]
    return SERIES_RANKS if (args.full or args.plot) else [2560, 16384]


def bench_real_path(ranks: list[int], policies: list[str], reps: int = 5) -> list[Row]:
    """Table 5: the call ``rebalance`` makes beside the plain one, median of ``reps`` calls each.

    ``plain``: ``post_balance(lengths, d, policy)``; ``src_ranks``: with every example's source rank
    (rank-major, as ``gather_lengths`` returns them); ``src_ranks+rpn8``: also ``ranks_per_node=8``,
    the full call. Quality: makespan / ``lower_bound``, tokens moved off their source rank (the
    plain plan ignores the sources, so nearly everything moves) and the worst per-rank off-node send.
    """
    rows = []
    dev = device_name()
    for d in ranks:
        print(f"(table 5: {d} ranks ...)", flush=True)  # a few seconds in all at the top sizes
        sizes = mixture(PER_RANK * d, d)
        src = np.repeat(np.arange(d), PER_RANK)
        shape = f"{d}x{PER_RANK}"
        for policy in policies:
            phase, alpha, beta = REAL_PATH_CASES[policy]
            lengths = sizes.phase(phase)
            total = max(1, int(lengths.sum()))
            lb = lower_bound(lengths, d, policy, alpha=alpha, beta=beta)
            t_plain = None
            for mode in REAL_PATH_MODES:
                kw: dict[str, object] = {} if mode == "plain" else {"src_ranks": src}
                if mode.endswith(f"rpn{RANKS_PER_NODE}"):
                    kw["ranks_per_node"] = RANKS_PER_NODE
                call = lambda: post_balance(lengths, d, policy, alpha=alpha, beta=beta, **kw)  # type: ignore[arg-type]
                plan = call()  # the plan measured below, and the warm-up call
                t = time_cpu(call, warmup=0, reps=reps)
                t_plain = t if t_plain is None else t_plain
                moved = plan.dst_rank != src
                off = (src // RANKS_PER_NODE) != (plan.dst_rank // RANKS_PER_NODE)
                off_send = np.bincount(src[off], weights=lengths[off], minlength=d)
                rows.append(
                    Row(
                        f"real_path[{policy}]",
                        mode,
                        shape,
                        "int64",
                        dev,
                        t,
                        {
                            "phase": phase,
                            "makespan/lb": plan.makespan / lb,
                            "moved%": 100.0 * float(lengths[moved].sum()) / total,
                            "max_offnode": int(off_send.max()),
                            "time/plain": t / t_plain,
                        },
                    )
                )
    return rows


def plot(rows: list[Row], path: str) -> None:
    """Three panels (PNG): time of one "sum" plan against the peers (table 1); the scaling series
    of table 5, the real path (solid) and the plain call (dashed) per policy, log-log; and their
    makespan / lower bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ranks_of(row: Row) -> int:
        return int(row.shape.split("x")[0])

    fig, (ax_speed, ax_scale, ax_quality) = plt.subplots(1, 3, figsize=(17, 4.8))
    speed = [r for r in rows if r.op == "post_balance[sum]"]  # table 1's rows
    for prov in dict.fromkeys(r.provider for r in speed):
        pts = sorted((ranks_of(r), r.time_ms) for r in speed if r.provider == prov)
        ax_speed.plot(*zip(*pts), marker="o", label=prov)
    ax_speed.set(xscale="log", yscale="log", xlabel="ranks (60 examples each)", ylabel="ms per plan")
    ax_speed.set_title('one "sum" plan: ours vs the peers', fontsize=10)
    ax_speed.legend(fontsize=7)
    real = [r for r in rows if r.op.startswith("real_path[")]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, op in enumerate(dict.fromkeys(r.op for r in real)):
        color = colors[k % len(colors)]
        for mode, style in ((REAL_PATH_MODES[-1], "-"), ("plain", "--")):
            series = sorted(
                (ranks_of(r), r.time_ms, r.metrics["makespan/lb"])
                for r in real
                if r.op == op and r.provider == mode
            )
            if series:
                x, t, q = zip(*series)
                label = op[len("real_path[") : -1] if style == "-" else None
                ax_scale.plot(x, t, style, marker="o", color=color, label=label)
                ax_quality.plot(x, q, style, marker="o", color=color, label=label)
    for ax in (ax_scale, ax_quality):
        ax.plot([], [], "k-", label=f"src_ranks + ranks_per_node={RANKS_PER_NODE}")
        ax.plot([], [], "k--", label="plain")
        ax.legend(fontsize=7)
    ax_scale.set(xscale="log", yscale="log", xlabel="ranks (60 examples each)", ylabel="ms per plan")
    ax_scale.set_title("the real path (solid) vs the plain call (dashed)", fontsize=10)
    ax_quality.set(xscale="log", xlabel="ranks (60 examples each)", ylabel="makespan / lower bound")
    ax_quality.set_title("quality of those plans", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--plot", metavar="FILE", help="also write a PNG of the speed and scaling results")
    args = p.parse_args(argv)
    if args.plot:  # checked before the run, which takes minutes
        from ..harness import check_output, require_matplotlib

        problem = require_matplotlib("bench.planners") or check_output(args.plot, "--plot")
        if problem:
            print(f"bench.planners: {problem}", file=sys.stderr)
            return 2
    rows = bench_speed(scales(args), args.full, peers=not args.quick)
    report(
        [r for r in rows if r.op != "peers"],
        args.json,
        "1. speed and quality of one 'sum' plan (real-data LLM lengths)",
    )
    report([r for r in rows if r.op == "peers"], args.json, "peers (verl runs in its own environment)")
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
    real = bench_real_path(real_path_ranks(args), list(REAL_PATH_CASES))
    report(
        real,
        args.json,
        f"5. the real path: post_balance as rebalance calls it (src_ranks, ranks_per_node={RANKS_PER_NODE}) "
        "beside the plain call, median of 5",
    )
    if args.plot:
        plot(rows + real, args.plot)
        print(f"plot written to {args.plot}")
    if not args.quick:
        from . import schedulers

        schedulers.run(args.full, args.json)
    return 0
