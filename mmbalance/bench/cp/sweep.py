"""Context parallelism per step: static degrees, power-of-two hybrid CP and ours, on real and long-tail data.

    mmbalance bench cp [--quick | --full] [--vlm] [--real] [--json FILE]
    python -m mmbalance.bench.cp [--quick | --full] [--json FILE] [--markdown FILE] [--plot FILE.png]
        [--ranks 8,64,512] [--budgets 8192,16384] [--datasets ...] [--steps N] [--fill 0.75]
        [--cost FILE] [--strict] [--real | --real-only] [--real-steps 8] [--real-budget 512]
        [--window 4096] [--local-fraction 0.833]

A step is one packed micro-batch of sequences drawn from a dataset until the next one would take
it past ``fill`` (0.75) of the memory of all ranks (``ranks * memory_per_rank`` tokens). Datasets (:mod:`mmbalance.bench.cp.data`):

* ``mixture``: LLM lengths of the shipped multimodal sizes (:func:`mmbalance.balancing.datasets.mixture`:
  images, videos, speech; median about 1k tokens, longest 16.6k);
* ``long_tail_1%`` and ``long_tail_0.2%``: the same, with 1% (0.2%) of the sequences replaced by
  rare long ones of 16-64 times the mixture's median length (uniform in between, up to 65k).

Each runs at 8, 64 and 512 ranks and two per-rank token budgets, 8192 and 16384 (36 and 73 GB of
activations of the default 8B model at ``34 * hidden * layers`` bytes a token). Every scheme of
:mod:`mmbalance.bench.cp.schemes` places every step: static CP of degree 1, 2, 4 and 8 (as
accelerate sets it up, groups balanced greedily), power-of-two hybrid CP (the idea of Megatron's
``BalancedCPScheduler``, with its own load estimate and with the shared cost model) and ours
(:func:`mmbalance.balancing.cp_schedule`); every placement is checked (each sequence once, memory
held) before it is timed. A fixed degree must hold the data's longest sequence (of a 1M-sequence
epoch, :func:`~mmbalance.bench.cp.data.epoch_longest`), whatever the sampled steps hold. One cost model times every scheme:
by default :meth:`CostModel.transformer() <mmbalance.balancing.CostModel.transformer>` (an 8B dense
LLM, 400 TFLOP/s, ring at 50 GB/s), or ``--cost FILE``: a JSON list of measurements
``[[lengths...], degree, seconds]`` (fitted with :meth:`CostModel.fit`, e.g. from
``mmbalance.bench.profile``) or a JSON object of ``CostModel`` fields.

Rows (op ``cp_step``, one per dataset, ranks, budget and scheme; ``time_ms`` is the *modelled* step
time, mean over the steps, ``nan`` where the scheme cannot run): ``step_ms_max``,
``feasible_steps``, ``infeasible`` (why not), ``largest_shard`` (tokens on the busiest rank over the
steps, zigzag rounding included) and ``shard_over_budget``; ``ours_speedup`` (the scheme's mean step
over ours). Ours adds the plan time per step (``plan_ms_median`` / ``plan_ms_max``: wall clock, the
median of ``plan_reps`` calls of ``cp_schedule`` per step on this machine; ``plan_cpu_ms_*`` the
process's CPU time, both planning threads together, what other work on a shared machine does not
inflate: a large plan splits its independent work over the caller's thread and one helper thread),
``vs_best_static``
(mean step of the best static degree that runs every step, over ours), ``worst_vs_static`` (the
largest per-step ratio of ours over the fastest static degree *of that step*), ``over_lower_bound``
and ``best_static_over_lower_bound`` (over ``cp_schedule``'s lower bound: no schedule is faster, so
the latter is the most any schedule could gain), ``vs_<hybrid>``, ``worst_vs_<hybrid>`` and the
degrees it used. The run ends with the acceptance checks: ours at or below the best static degree
and both power-of-two hybrids at every step, at least 1.3x faster than the best static degree on
long-tail data, plan time at most 5 ms at 512 ranks (``--strict``: exit 1 when one fails).

On long-tail data a sliding-window model line follows (:mod:`mmbalance.bench.cp.window`; op
``cp_window_step``; ``--window`` tokens, 4096 by default, on ``--local-fraction`` of the layers,
Gemma 3's 5/6; ranks up to 64): static degrees against ours, with the ring skipping the key blocks
no window reaches, and ours planned for full causal attention, all timed on the windowed model.

``--vlm`` runs vision-language data instead (long ActivityNet videos, a mixture with image
documents): static CP degrees and NeMo-style pre-embedding against ours, with and without encoder
balancing, modelled (:mod:`mmbalance.bench.cp.vlm`; op ``cp_vlm_step``).

``--real`` (or ``--real-only``) then runs real steps of a tiny Llama on 4 gloo ranks through
torchrun: :mod:`mmbalance.bench.cp.real` (step time and all-to-all bytes, ours against static
degrees 1, 2 and 4; op ``cp_real_step``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

from mmbalance.balancing import CostModel, cp_schedule

from ..harness import Row, base_parser, device_name, ms_cell, ratio_plot, report
from . import schemes, vlm, window
from .data import DATASETS, FILL, epoch_longest, step_batches

RANKS = (8, 64, 512)
BUDGETS = (8192, 16384)
STATIC_DEGREES = (1, 2, 4, 8)
HYBRIDS = ("hybrid_pow2", "hybrid_pow2_cost")
SCHEMES = (*(f"static_cp{c}" for c in STATIC_DEGREES), *HYBRIDS, "mmbalance")
RANKS_PER_NODE = 8
PLAN_MS_TARGET, PLAN_MS_AT = 5.0, 512
LONG_TAIL_SPEEDUP = 1.3


def load_cost(path: str | None) -> CostModel:
    """The one cost model of the run (see the module docstring)."""
    if path is None:
        return CostModel.transformer()
    with open(path) as f:
        spec = json.load(f)
    if isinstance(spec, dict):
        return CostModel(**spec)
    if isinstance(spec, list):
        return CostModel.fit([tuple(m) for m in spec])
    raise ValueError(f"--cost {path}: expected a JSON list of measurements or an object of CostModel fields")


@dataclasses.dataclass
class ConfigResult:
    """Per-step results of one (dataset, ranks, budget): for every scheme the modelled step time
    (``nan`` where infeasible), the largest shard (``-1``) and the first reason it could not run."""

    dataset: str
    world: int
    memory_per_rank: int
    steps: int
    sequences: list[int]
    step: dict[str, np.ndarray]
    shard: dict[str, np.ndarray]
    reason: dict[str, str]
    plan_ms: np.ndarray
    plan_cpu_ms: np.ndarray
    lower_bound: np.ndarray
    degrees: dict[int, int]
    methods: dict[str, int]
    too_short: frozenset[str] = frozenset()

    def feasible(self, scheme: str) -> bool:
        """Whether the scheme ran every step and can hold the data's longest sequence (a fixed
        degree must; see :func:`~mmbalance.bench.cp.data.epoch_longest`)."""
        return bool(np.isfinite(self.step[scheme]).all()) and scheme not in self.too_short

    def best_static(self) -> str | None:
        """The static degree with the least mean step among those that ran every step."""
        ok = [s for s in SCHEMES[: len(STATIC_DEGREES)] if self.feasible(s)]
        return min(ok, key=lambda s: float(self.step[s].mean())) if ok else None


def run_config(
    dataset: str,
    world: int,
    memory_per_rank: int,
    steps: int,
    cost: CostModel,
    *,
    fill: float = FILL,
    seed: int = 0,
    plan_reps: int = 3,
) -> ConfigResult:
    """Every scheme on ``steps`` steps; each placement checked, then timed under ``cost``."""
    batches = step_batches(dataset, world, memory_per_rank, steps, fill, seed)
    step = {s: np.full(steps, math.nan) for s in SCHEMES}
    shard = {s: np.full(steps, -1, dtype=np.int64) for s in SCHEMES}
    reason: dict[str, str] = {}
    plan_ms = np.zeros(steps)
    plan_cpu_ms = np.zeros(steps)
    lower_bound = np.zeros(steps)
    degrees: dict[int, int] = {}
    methods: dict[str, int] = {}
    rpn = min(RANKS_PER_NODE, world)
    if batches:
        cp_schedule(batches[0], world, memory_per_rank, cost, ranks_per_node=rpn)  # warm-up
    longest = epoch_longest(dataset)
    too_short = frozenset(f"static_cp{c}" for c in STATIC_DEGREES if c * memory_per_rank < longest)
    for s in sorted(too_short):
        reason[s] = (
            f"{s[len('static_cp') :]} x {memory_per_rank} tokens cannot hold the data's longest sequence ({longest})"
        )
    for t, lengths in enumerate(batches):
        schedules = [schemes.static_cp(lengths, world, memory_per_rank, c, cost) for c in STATIC_DEGREES]
        schedules.append(schemes.hybrid_pow2(lengths, world, memory_per_rank))
        schedules.append(schemes.hybrid_pow2(lengths, world, memory_per_rank, cost))
        times, cpu = [], []
        for _ in range(plan_reps):
            t0, c0 = time.perf_counter(), time.process_time()
            cp_schedule(lengths, world, memory_per_rank, cost, ranks_per_node=rpn)
            times.append(1e3 * (time.perf_counter() - t0))
            cpu.append(1e3 * (time.process_time() - c0))
        plan_ms[t], plan_cpu_ms[t] = float(np.median(times)), float(np.median(cpu))
        mine, plan = schemes.ours(lengths, world, memory_per_rank, cost, rpn)
        schedules.append(mine)
        for sched in schedules:
            schemes.check_schedule(sched, lengths, world, memory_per_rank)
            if not sched.feasible:
                reason.setdefault(sched.scheme, str(sched.infeasible))
                continue
            step[sched.scheme][t] = schemes.step_time(sched, lengths, cost)
            shard[sched.scheme][t] = schemes.largest_shard(sched, lengths)
        if not math.isclose(step["mmbalance"][t], plan.makespan, rel_tol=1e-9, abs_tol=1e-12):
            raise RuntimeError(
                f"cp_schedule's makespan {plan.makespan} differs from the bench's timing {step['mmbalance'][t]} "
                "under the same cost model"
            )
        lower_bound[t] = plan.info["lower_bound"]
        for grp in plan:
            degrees[grp.degree] = degrees.get(grp.degree, 0) + 1
        methods[plan.info["method"]] = methods.get(plan.info["method"], 0) + 1
    return ConfigResult(
        dataset=dataset,
        world=world,
        memory_per_rank=memory_per_rank,
        steps=steps,
        sequences=[b.size for b in batches],
        step=step,
        shard=shard,
        reason=reason,
        plan_ms=plan_ms,
        plan_cpu_ms=plan_cpu_ms,
        lower_bound=lower_bound,
        degrees=degrees,
        methods=methods,
        too_short=too_short,
    )


def _ratio(a: np.ndarray, b: np.ndarray) -> float:
    """Largest per-step ``a / b`` over the steps where both ran (``nan`` if none)."""
    ok = np.isfinite(a) & np.isfinite(b) & (b > 0)
    return float((a[ok] / b[ok]).max()) if ok.any() else math.nan


def rows_of(res: ConfigResult) -> list[Row]:
    """One row per scheme (see the module docstring)."""
    dev = device_name()
    shape = f"{res.dataset}/R{res.world}/M{res.memory_per_rank}"
    ours = res.step["mmbalance"]
    ours_mean = float(ours.mean())
    statics = np.stack([res.step[s] for s in SCHEMES[: len(STATIC_DEGREES)]])
    oracle = np.where(np.isfinite(statics), statics, np.inf).min(axis=0)
    best = res.best_static()
    rows = []
    for s in SCHEMES:
        st = res.step[s]
        ok = np.isfinite(st)
        mean = float(st.mean()) if res.feasible(s) else math.nan
        metrics: dict = {
            "data": res.dataset,
            "ranks": res.world,
            "memory_per_rank": res.memory_per_rank,
            "steps": res.steps,
            "sequences_per_step": float(np.mean(res.sequences)),
            "modelled": True,
            "feasible": res.feasible(s),
            "feasible_steps": int(ok.sum()),
            "infeasible": res.reason.get(s, ""),
            "step_ms_max": 1e3 * float(st[ok].max()) if ok.any() else math.nan,
            "largest_shard": int(res.shard[s].max()),
            "shard_over_budget": float(res.shard[s].max()) / res.memory_per_rank if ok.any() else math.nan,
            "ours_speedup": mean / ours_mean,
        }
        if s == "mmbalance":
            metrics.update(
                {
                    "plan_ms_median": float(np.median(res.plan_ms)),
                    "plan_ms_max": float(res.plan_ms.max()),
                    "plan_cpu_ms_median": float(np.median(res.plan_cpu_ms)),
                    "plan_cpu_ms_max": float(res.plan_cpu_ms.max()),
                    "best_static": best or "none",
                    "vs_best_static": float(res.step[best].mean()) / ours_mean if best else math.nan,
                    "worst_vs_static": _ratio(ours, np.where(np.isfinite(oracle), oracle, np.nan)),
                    "over_lower_bound": float(ours.mean() / res.lower_bound.mean()),
                    "best_static_over_lower_bound": float(res.step[best].mean() / res.lower_bound.mean())
                    if best
                    else math.nan,
                    "degrees": ",".join(f"{d}x{c}" for d, c in sorted(res.degrees.items())),
                    "methods": ",".join(f"{m}:{c}" for m, c in sorted(res.methods.items())),
                }
            )
            for h in HYBRIDS:
                metrics[f"vs_{h}"] = float(res.step[h].mean()) / ours_mean if res.feasible(h) else math.nan
                metrics[f"worst_vs_{h}"] = _ratio(ours, res.step[h])
        rows.append(Row("cp_step", s, shape, "-", dev, 1e3 * mean, metrics))
    return rows


def acceptance(results: list[ConfigResult]) -> list[tuple[str, bool, str]]:
    """The checks the numbers must pass: (what, passed, the figures)."""
    checks = []
    for ds in dict.fromkeys(r.dataset for r in results):
        mine = [r for r in results if r.dataset == ds]
        vs_static = [_ratio(r.step["mmbalance"], r.step[b]) for r in mine if (b := r.best_static())]
        worst_s = max(vs_static, default=math.nan)
        checks.append(
            (
                f"{ds}: ours <= best static degree, every step",
                bool(worst_s <= 1.0 + 1e-9),
                f"worst ours/static {worst_s:.4f}",
            )
        )
        for h in HYBRIDS:
            worst_h = max((_ratio(r.step["mmbalance"], r.step[h]) for r in mine), default=math.nan)
            checks.append(
                (
                    f"{ds}: ours <= {h}, every step",
                    bool(worst_h <= 1.0 + 1e-9),
                    f"worst ours/hybrid {worst_h:.4f}",
                )
            )
        if DATASETS[ds] > 0:
            # the speedup of each configuration, and the most any schedule could give (over the
            # lower bound of cp_schedule: no schedule is faster)
            speed = [
                (
                    float(r.step[b].mean() / r.step["mmbalance"].mean()),
                    float(r.step[b].mean() / r.lower_bound.mean()),
                    r,
                )
                for r in mine
                if (b := r.best_static())
            ]
            if speed:
                low, ceiling, r = min(speed, key=lambda x: x[0])
                checks.append(
                    (
                        f"{ds}: ours >= {LONG_TAIL_SPEEDUP}x faster than the best static degree",
                        bool(low >= LONG_TAIL_SPEEDUP),
                        f"least speedup {low:.3f}x ({r.world} ranks, {r.memory_per_rank} tokens; no schedule "
                        f"can beat {ceiling:.3f}x there); "
                        + ", ".join(f"{x[2].world}/{x[2].memory_per_rank}: {x[0]:.2f}x" for x in speed),
                    )
                )
    big = [r for r in results if r.world == PLAN_MS_AT]
    if big:
        worst = max(float(r.plan_ms.max()) for r in big)
        med = max(float(np.median(r.plan_ms)) for r in big)
        cpu_worst = max(float(r.plan_cpu_ms.max()) for r in big)
        cpu_med = max(float(np.median(r.plan_cpu_ms)) for r in big)
        checks.append(
            (
                f"plan time <= {PLAN_MS_TARGET} ms at {PLAN_MS_AT} ranks",
                worst <= PLAN_MS_TARGET,
                f"wall clock: largest median {med:.2f} ms, max {worst:.2f} ms; the planner's CPU time (both threads): "
                f"largest median {cpu_med:.2f} ms, max {cpu_worst:.2f} ms",
            )
        )
    return checks


def summary_table(results: list[ConfigResult]) -> str:
    """Markdown: one line per (dataset, ranks, budget), mean modelled step times in ms."""
    head = " | ".join(f"static {c}" for c in STATIC_DEGREES)
    lines = [
        f"| data | ranks | tokens/rank | seqs/step | {head} | pow2 hybrid (Megatron's l^2 estimate / the cost "
        "model) | ours | ours vs best static | ours vs hybrid | plan ms (median / max) | plan CPU ms (median / max) "
        "| largest shard, ours / budget |",
        "|---|---|---|---|" + "---|" * len(STATIC_DEGREES) + "---|---|---|---|---|---|---|",
    ]
    for r in results:
        mean = {s: float(r.step[s].mean()) if r.feasible(s) else math.nan for s in SCHEMES}
        best = r.best_static()
        cells = schemes.static_cells(mean, best, STATIC_DEGREES)
        ours = mean["mmbalance"]
        vs_s = f"{mean[best] / ours:.2f}x" if best else "-"
        hyb = [mean[h] for h in HYBRIDS if math.isfinite(mean[h])]
        vs_h = f"{min(hyb) / ours:.2f}x" if hyb else "-"
        lines.append(
            f"| {r.dataset} | {r.world} | {r.memory_per_rank} | {np.mean(r.sequences):.0f} | {cells} "
            f"| {' / '.join(ms_cell(mean[h]) for h in HYBRIDS)} | {ms_cell(ours)} | {vs_s} | {vs_h} "
            f"| {np.median(r.plan_ms):.2f} / {r.plan_ms.max():.2f} "
            f"| {np.median(r.plan_cpu_ms):.2f} / {r.plan_cpu_ms.max():.2f} "
            f"| {int(r.shard['mmbalance'].max()) / r.memory_per_rank:.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[ConfigResult], path: str) -> None:
    """One panel per dataset (PNG): every scheme's mean step time over ours, per ranks and budget;
    schemes that cannot run a configuration are left out of it."""
    ratio_plot(
        path,
        results,
        SCHEMES,
        lambda r, s: float(r.step[s].mean() / r.step["mmbalance"].mean()) if r.feasible(s) else math.nan,
        bold=("mmbalance",),
    )


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"bench.cp: {flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"bench.cp: {flag} takes positive integers, got {text!r}")
    return vals


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", help="comma-separated rank counts (default 8,64,512; --quick 8,64)")
    p.add_argument("--budgets", help="comma-separated tokens per rank (default 8192,32768)")
    p.add_argument(
        "--datasets",
        # names such as long_tail_1% go through argparse's %-formatting of help texts: escaped
        help=(
            f"comma-separated, of {', '.join(DATASETS)}; with --vlm of {', '.join(vlm.DATASETS)} (default: all)"
        ).replace("%", "%%"),
    )
    p.add_argument(
        "--vlm",
        action="store_true",
        help="vision-language sequences (long videos, image documents): static CP and pre-embedding against ours",
    )
    p.add_argument("--steps", type=int, help="steps per configuration (default 20; --quick 2, --full 100)")
    p.add_argument(
        "--fill", type=float, default=FILL, help="a step's tokens, as a fraction of all ranks' memory"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data streams")
    p.add_argument(
        "--cost", metavar="FILE", help="the cost model as JSON (measurements to fit, or CostModel fields)"
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the summary table as Markdown to FILE")
    p.add_argument("--plot", metavar="FILE", help="also write a PNG of step times relative to ours")
    p.add_argument("--strict", action="store_true", help="exit 1 when an acceptance check fails")
    real_group = p.add_mutually_exclusive_group()
    real_group.add_argument(
        "--real", action="store_true", help="then real steps of a tiny Llama on 4 gloo ranks (torchrun)"
    )
    real_group.add_argument("--real-only", action="store_true", help="only the real steps")
    p.add_argument("--real-steps", type=int, default=8, help="measured steps per scheme of the real part")
    p.add_argument("--real-budget", type=int, default=512, help="tokens per rank in the real part")
    p.add_argument(
        "--window", type=int, default=window.WINDOW,
        help="the sliding-window model line's window in tokens (0: no such line); long-tail data, ranks <= 64",
    )  # fmt: skip
    p.add_argument(
        "--local-fraction", type=float, default=window.LOCAL_FRACTION,
        help="the fraction of that model's layers that use the window (Gemma 3: 5/6; Mistral: 1)",
    )  # fmt: skip
    args = p.parse_args(argv)
    from ..harness import check_output, require_matplotlib

    for flag, path in (("--markdown", args.markdown), ("--plot", args.plot)):
        problem = check_output(path, flag)
        if problem:
            print(f"bench.cp: {problem}", file=sys.stderr)
            return 2
    if args.plot and (problem := require_matplotlib("bench.cp")):
        print(f"bench.cp: {problem}", file=sys.stderr)
        return 2
    if not 0.0 < args.fill <= 1.0:
        print(f"bench.cp: --fill must be in (0, 1], got {args.fill}", file=sys.stderr)
        return 2
    known = vlm.DATASETS if args.vlm else tuple(DATASETS)
    datasets = args.datasets.split(",") if args.datasets else list(known)
    unknown = [d for d in datasets if d not in known]
    if unknown:
        print(f"bench.cp: unknown dataset(s) {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    ranks = _ints(args.ranks, "--ranks") if args.ranks else (8, 64) if args.quick else RANKS
    budgets = _ints(args.budgets, "--budgets") if args.budgets else BUDGETS
    steps = args.steps if args.steps is not None else 2 if args.quick else 100 if args.full else 20
    if steps < 1:
        print(f"bench.cp: --steps must be >= 1, got {steps}", file=sys.stderr)
        return 2
    try:
        cost = load_cost(args.cost)
    except (OSError, ValueError, TypeError) as exc:
        print(f"bench.cp: --cost {args.cost}: {exc}", file=sys.stderr)
        return 2
    if args.window < 0 or not 0.0 <= args.local_fraction <= 1.0:
        print("bench.cp: --window must be >= 0 and --local-fraction in [0, 1]", file=sys.stderr)
        return 2
    if args.real_steps < 1 or args.real_budget < 1:
        print("bench.cp: --real-steps and --real-budget must be >= 1", file=sys.stderr)
        return 2
    if args.real or args.real_only:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print('bench.cp: --real needs transformers (pip install "mmbalance[hf]")', file=sys.stderr)
            return 2
    checks: list[tuple[str, bool, str]] = []
    tables = []
    if args.vlm and not args.real_only:
        print(f"cost model: {cost}; one encoder item: {1e3 * vlm.item_seconds(cost):.2f} ms", flush=True)
        vlm_results = []
        for ds in datasets:
            for world in ranks:
                for mem in budgets:
                    res_vlm = vlm.run_config(ds, world, mem, steps, cost, fill=args.fill, seed=args.seed)
                    vlm_results.append(res_vlm)
                    title = f"cp --vlm: {ds}, {world} ranks, {mem} tokens per rank, {steps} steps"
                    report(vlm.rows_of(res_vlm), args.json, title)
        tables.append(vlm.summary_table(vlm_results))
        print("\n== summary: mean modelled step time (ms) per scheme ==\n" + tables[-1])
        checks = vlm.acceptance(vlm_results)
        print("\n== acceptance ==")
        for what, ok, figures in checks:
            print(f"{'pass' if ok else 'FAIL'}  {what}: {figures}")
        if args.plot:
            vlm.plot(vlm_results, args.plot)
            print(f"plot written to {args.plot}")
    elif not args.real_only:
        reps = 1 if args.quick else 5 if args.full else 3
        print(f"cost model: {cost}", flush=True)
        results = []
        for ds in datasets:
            for world in ranks:
                for mem in budgets:
                    res = run_config(
                        ds, world, mem, steps, cost, fill=args.fill, seed=args.seed, plan_reps=reps
                    )
                    results.append(res)
                    title = f"cp: {ds}, {world} ranks, {mem} tokens per rank, {steps} steps"
                    report(rows_of(res), args.json, title)
        tables.append(summary_table(results))
        print(
            "\n== summary: mean modelled step time (ms) per scheme; * the best static degree ==\n"
            + tables[-1]
        )
        window_sets = [ds for ds in datasets if DATASETS[ds] > 0]
        if args.window and window_sets:
            model = window.WindowModel(args.window, args.local_fraction)
            print(f"\nsliding-window model: {model} (planned with the windowed cost) ...", flush=True)
            window_results = []
            for ds in window_sets:
                for world in (w for w in ranks if w <= 64):
                    for mem in budgets:
                        res_w = window.run_config(
                            ds, world, mem, steps, cost, model, fill=args.fill, seed=args.seed
                        )
                        window_results.append(res_w)
                        report(
                            window.rows_of(res_w),
                            args.json,
                            f"cp, {model}: {ds}, {world} ranks, {mem} tokens",
                        )
            tables.append(window.summary_table(window_results))
            print("\n== " + tables[-1])
        checks = acceptance(results)
        print("\n== acceptance ==")
        for what, ok, figures in checks:
            print(f"{'pass' if ok else 'FAIL'}  {what}: {figures}")
        if args.plot:
            plot(results, args.plot)
            print(f"plot written to {args.plot}")
    if args.real or args.real_only:
        from . import real

        print(f"\nreal steps: torchrun, {real.WORLD} gloo ranks, tiny Llama ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            res_real = real.launch(
                os.path.join(tmp, "real.json"), steps=args.real_steps, budget=args.real_budget
            )
        rows = real.rows_of(res_real)
        report(rows, args.json, f"cp, real steps on {real.WORLD} gloo ranks (median of {args.real_steps})")
        tables.append(real.summary_table(rows))
        print("\n== summary: real steps ==\n" + tables[-1])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n\n".join(tables) + "\n")
    return 1 if args.strict and not all(ok for _, ok, _ in checks) else 0
