"""Balanced pipeline partition (OmniBal section 4.2) and adaptive resource allocation (MMScale section 4.3).

:func:`balanced_partition` splits the layers of a vision + language model (per-layer forward times
and output activation sizes, in model order) into pipeline stages. The paper builds a greedy anchor,
jitters every boundary within ``radius`` and ranks the candidates by ``VAR(fwd) + SUM(comm)`` (eqs.
4-5), then times the best few. That metric is additive over stages and cuts (the stage mean is
fixed), so its exact minimum over *all* partitions is a small DP; we add it, its jittered
neighbours and the min-bottleneck partition to the paper's candidates and rank all of them by the
paper's metric: the best is never worse than the paper's under that metric.

:func:`allocate_resources` gives GPUs, TP, DP and PP sizes to the modules of a disaggregated
multimodal model (encoder, LLM backbone, generator) minimizing the iteration time of
DistTrain eqs. 1 and 5. The paper enumerates TP and DP sizes and solves a convex relaxation in
the GPU counts; we solve the integer stage counts exactly for every TP/DP choice.

>>> plan = balanced_partition([1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1], num_stages=2)
>>> plan.best.boundaries, plan.best.stage_times
((4, 6), (4.0, 4.0))
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ._core_api import core
from .validate import as_count, as_nonnegative


@dataclass(frozen=True)
class PartitionCandidate:
    """One partition: stage ``i`` runs layers ``[boundaries[i-1], boundaries[i])`` (0-based,
    ``boundaries[-1]`` is the number of layers; the paper's ``P^(i)`` are ``boundaries[:-1]`` + 1).

    ``variance``: eq. 4; ``comm``: eq. 5 (activations at the cuts); ``score``: ``variance +
    comm_weight * comm``; ``bottleneck``: the slowest stage; ``source``: how it was found;
    ``measured``: the time from ``evaluate`` if it was timed.
    """

    boundaries: tuple[int, ...]
    stage_times: tuple[float, ...]
    variance: float
    comm: float
    score: float
    bottleneck: float
    source: str
    measured: float | None = None


@dataclass(frozen=True)
class PartitionPlan:
    """The chosen partition, the ranked candidates and a plain-text explanation."""

    best: PartitionCandidate
    candidates: list[PartitionCandidate]
    explanation: str

    def explain(self) -> str:
        return self.explanation


def _score(cuts: np.ndarray, prefix: np.ndarray, act: np.ndarray, w: float):
    """Metrics of partitions given as interior cuts ``[C, N-1]`` (vectorized)."""
    L = prefix.size - 1
    c = cuts.shape[0]
    full = np.concatenate(
        [np.zeros((c, 1), dtype=np.int64), cuts, np.full((c, 1), L, dtype=np.int64)], axis=1
    )
    stage = prefix[full[:, 1:]] - prefix[full[:, :-1]]
    var = ((stage - prefix[-1] / stage.shape[1]) ** 2).sum(axis=1)
    comm = act[cuts - 1].sum(axis=1) if cuts.shape[1] else np.zeros(c)
    return stage, var, comm, var + w * comm


def _jitter(cut: np.ndarray, radius: int, L: int, limit: int = 50000) -> np.ndarray:
    """All cuts within ``radius`` of ``cut`` per boundary (the paper's candidate set), strictly
    increasing in ``[1, L-1]``. Beyond ``limit`` combinations, one boundary moves at a time."""
    k = cut.size
    if k == 0:
        return cut[None, :]
    radius = min(radius, L)  # a cut moved further than the layers reach is never valid
    offsets = range(-radius, radius + 1)
    if (2 * radius + 1) ** k <= limit:
        cand = cut[None, :] + np.array(list(itertools.product(offsets, repeat=k)), dtype=np.int64)
    else:
        rows = [cut.copy()]
        for i in range(k):
            for o in offsets:
                if o:
                    r = cut.copy()
                    r[i] += o
                    rows.append(r)
        cand = np.array(rows, dtype=np.int64)
    ok = (cand[:, 0] >= 1) & (cand[:, -1] <= L - 1) & np.all(np.diff(cand, axis=1) > 0, axis=1)
    return cand[ok]


def _partition(fwd, act, num_stages, radius, top_k, comm_weight, evaluate, ours: bool) -> PartitionPlan:
    f = as_nonnegative(fwd, "layer_times")
    L = f.size
    a = as_nonnegative(act, "activations", size=L)
    n = as_count(num_stages, "num_stages")
    if n > L:
        raise ValueError(f"num_stages ({n}) must be <= the number of layers ({L})")
    radius = as_count(radius, "radius", minimum=0)
    top_k = as_count(top_k, "top_k")
    if (
        isinstance(comm_weight, bool)
        or not isinstance(comm_weight, numbers.Real)
        or not float(comm_weight) >= 0
    ):
        raise ValueError(f"comm_weight must be a number >= 0, got {comm_weight!r}")
    w = float(comm_weight)
    prefix = np.concatenate([[0.0], np.cumsum(f)])
    anchor = np.asarray(core().partition_greedy(f, n), dtype=np.int64)
    sets = [("paper-jitter", _jitter(anchor, radius, L)), ("paper-anchor", anchor[None, :])]
    if ours:
        opt = np.asarray(core().partition_dp(f, a, n, w), dtype=np.int64)
        mm = np.asarray(core().partition_minmax(f, n), dtype=np.int64)
        sets = [
            ("dp-optimal", opt[None, :]),
            ("minmax", mm[None, :]),
            ("dp-jitter", _jitter(opt, radius, L)),
        ] + sets
    cuts, source = [], []
    seen = set()
    for name, arr in sets:
        for row in arr:
            key = tuple(int(x) for x in row)
            if key not in seen:
                seen.add(key)
                cuts.append(row)
                source.append(name)
    cut_rows = np.array(cuts, dtype=np.int64).reshape(len(cuts), n - 1)
    stage, var, comm, score = _score(cut_rows, prefix, a, w)
    order = np.lexsort((np.arange(score.size), score))[:top_k]
    cands = [
        PartitionCandidate(
            boundaries=tuple(int(x) for x in cut_rows[i]) + (L,),
            stage_times=tuple(float(x) for x in stage[i]),
            variance=float(var[i]),
            comm=float(comm[i]),
            score=float(score[i]),
            bottleneck=float(stage[i].max()),
            source=source[i],
        )
        for i in order
    ]
    best = cands[0]
    if evaluate is not None:
        timed = []
        for c in cands:
            t = evaluate(c.boundaries)
            if isinstance(t, bool) or not isinstance(t, numbers.Real) or not np.isfinite(float(t)):
                raise ValueError(f"evaluate{c.boundaries} must return a finite time, got {t!r}")
            timed.append(_with_measured(c, float(t)))
        cands = timed
        best = min(cands, key=lambda c: float("inf") if c.measured is None else c.measured)
    paper_cuts = np.concatenate([arr for name, arr in sets if name.startswith("paper")], axis=0)
    paper_score = float(_score(paper_cuts, prefix, a, w)[3].min())
    lines = [
        f"{len(cuts)} candidates over {L} layers in {n} stages, ranked by VAR(fwd) + {w:g} * SUM(comm):",
        *(
            f"  {c.boundaries} [{c.source}] stages {tuple(round(x, 4) for x in c.stage_times)} "
            f"var {c.variance:.4g} comm {c.comm:.4g} score {c.score:.4g} bottleneck {c.bottleneck:.4g}"
            + (f" measured {c.measured:.4g}" if c.measured is not None else "")
            for c in cands
        ),
        f"chosen: {best.boundaries} ({'fastest measured' if evaluate else 'lowest score'}); "
        f"the paper's anchor+jitter best scores {paper_score:.4g}.",
    ]
    return PartitionPlan(best, cands, "\n".join(lines))


def _with_measured(c: PartitionCandidate, t: float) -> PartitionCandidate:
    return PartitionCandidate(
        c.boundaries, c.stage_times, c.variance, c.comm, c.score, c.bottleneck, c.source, t
    )


def balanced_partition(
    layer_times,
    activations,
    num_stages: int,
    *,
    radius: int = 1,
    top_k: int = 5,
    comm_weight: float = 1.0,
    evaluate: Callable[[tuple[int, ...]], float] | None = None,
) -> PartitionPlan:
    """Pipeline stage boundaries for a model with per-layer costs (OmniBal section 4.2, and better).

    Args:
        layer_times: ``[L]`` forward time of every layer in model order (ViT layers, projector, LLM
            layers), e.g. profiled at the balanced mini-batch size.
        activations: ``[L]`` size of each layer's output (what a cut after it sends).
        num_stages: pipeline stages ``N`` (each gets at least one layer).
        radius: jitter radius ``r`` of the candidate set.
        top_k: candidates kept (and timed, with ``evaluate``).
        comm_weight: weight of ``SUM(comm)`` against ``VAR(fwd)`` (the paper adds them: 1).
        evaluate: optional ``evaluate(boundaries) -> seconds`` (a few real iterations, the paper's
            ``f(P)``); the fastest timed candidate is chosen.

    Returns:
        :class:`PartitionPlan` with ``best``, the ranked ``candidates`` and ``explanation``.
    """
    return _partition(layer_times, activations, num_stages, radius, top_k, comm_weight, evaluate, ours=True)


def paper_partition(
    layer_times, activations, num_stages: int, *, radius: int = 1, top_k: int = 5, comm_weight: float = 1.0
) -> PartitionPlan:
    """OmniBal section 4.2 as written: greedy anchor + jitter within ``radius``, ranked by the metric."""
    return _partition(layer_times, activations, num_stages, radius, top_k, comm_weight, None, ours=False)


# --- adaptive resource allocation ---------------------------------------------------------------


@dataclass(frozen=True)
class ModuleCost:
    """Cost of one module of a disaggregated model (DistTrain section 5.1).

    ``time``: forward + backward seconds of the whole module for one sample on ``tp`` GPUs, as a
    callable ``time(tp)`` or a mapping ``{tp: seconds}`` (TP sizes missing from it are not used).
    ``params`` (parameters + gradients), ``optimizer`` and ``activation`` (one sample through the
    whole module) in bytes, used with ``gpu_memory``; ``max_pp``: e.g. the number of layers.
    """

    time: Callable[[int], float] | Mapping[int, float]
    params: float = 0.0
    optimizer: float = 0.0
    activation: float = 0.0
    max_pp: int | None = None


@dataclass(frozen=True)
class ModuleConfig:
    """What one module gets: ``gpus = tp * dp * pp``; ``stage_time`` per microbatch."""

    gpus: int
    tp: int
    dp: int
    pp: int
    stage_time: float


@dataclass(frozen=True)
class Allocation:
    """The chosen configuration, its iteration time (``warmup + steady``), alternatives, and why."""

    modules: dict[str, ModuleConfig]
    iteration_time: float
    warmup: float
    steady: float
    gpus: int
    alternatives: list[dict] = field(default_factory=list)
    explanation: str = ""

    def explain(self) -> str:
        return self.explanation


def _module_table(modules, tp_options):
    names = list(modules)
    times = np.full((len(names), len(tp_options)), np.inf)
    params, optim, act = np.zeros(len(names)), np.zeros(len(names)), np.zeros(len(names))
    max_pp = np.full(len(names), 1 << 30, dtype=np.int64)
    for k, name in enumerate(names):
        spec = modules[name]
        if not isinstance(spec, ModuleCost):
            spec = ModuleCost(spec)
        for j, tp in enumerate(tp_options):
            if isinstance(spec.time, Mapping):
                t = spec.time.get(tp)
                if t is None:
                    continue
            elif callable(spec.time):
                t = spec.time(tp)
            else:
                raise TypeError(f"modules[{name!r}].time must be a callable or a mapping tp -> seconds")
            if isinstance(t, bool) or not isinstance(t, numbers.Real) or not np.isfinite(t) or t < 0:
                raise ValueError(f"modules[{name!r}] time at tp={tp} must be a finite number >= 0, got {t!r}")
            times[k, j] = float(t)
        for attr, arr in (("params", params), ("optimizer", optim), ("activation", act)):
            v = getattr(spec, attr)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v) or v < 0:
                raise ValueError(f"modules[{name!r}].{attr} must be a finite number >= 0")
            arr[k] = float(v)
        if spec.max_pp is not None:
            max_pp[k] = as_count(spec.max_pp, f"modules[{name!r}].max_pp")
    return names, times, params, optim, act, max_pp


def allocate_resources(
    modules: Mapping[str, ModuleCost | Callable[[int], float] | Mapping[int, float]],
    num_gpus: int,
    global_batch: int,
    *,
    llm: str = "llm",
    tp_options=(1, 2, 4, 8),
    gpu_memory: float | None = None,
    top_k: int = 5,
    relaxed: bool = False,
) -> Allocation:
    """GPUs and TP/DP/PP sizes per module (MMScale section 4.3, DistTrain section 5.1-5.2).

    Every TP size (from ``tp_options``) and DP size (``DP_llm`` divides ``global_batch``, every
    other module's DP divides ``DP_llm``) is tried; for each, the integer PP sizes that minimize the
    slowest stage within ``num_gpus`` (and the memory limit) are found exactly, and the iteration
    time ``warmup + max_m T_m * (global_batch / DP_llm - 1)`` (DistTrain eqs. 1, 5) ranks them.
    ``T_m = (DP_llm / DP_m) * C_m(TP_m) / PP_m``. ``relaxed=True`` uses the paper's continuous
    relaxation rounded down instead (for comparisons).

    Args:
        modules: name -> :class:`ModuleCost` (or just its ``time``), in pipeline order.
        num_gpus: GPUs available. global_batch: samples per iteration.
        llm: the name of the backbone module. gpu_memory: bytes per GPU (None: memory ignored).

    Example:
        >>> a = allocate_resources({"vit": lambda tp: 2.0 / tp, "llm": lambda tp: 8.0 / tp}, 16, 8)
        >>> {k: (m.gpus, m.tp, m.dp, m.pp) for k, m in a.modules.items()}, a.iteration_time
        ({'vit': (4, 4, 1, 1), 'llm': (12, 4, 1, 3)}, 7.166666666666666)
    """
    if not isinstance(modules, Mapping) or not modules:
        raise TypeError("modules must be a non-empty mapping name -> ModuleCost")
    if llm not in modules:
        raise ValueError(f"llm={llm!r} is not one of the modules {list(modules)}")
    n = as_count(num_gpus, "num_gpus")
    batch = as_count(global_batch, "global_batch")
    k = as_count(top_k, "top_k")
    tps = [as_count(t, "tp_options") for t in tp_options]
    if not tps:
        raise ValueError("tp_options must not be empty")
    cap = 0.0
    if gpu_memory is not None:
        if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, numbers.Real) or not gpu_memory > 0:
            raise ValueError(f"gpu_memory must be a number > 0, got {gpu_memory!r}")
        cap = float(gpu_memory)
    names, times, params, optim, act, max_pp = _module_table(modules, tps)
    res = core().allocate(
        times,
        params,
        optim,
        act,
        max_pp,
        names.index(llm),
        np.asarray(tps, dtype=np.int64),
        batch,
        n,
        cap,
        k,
        bool(relaxed),
    )
    if not res:
        raise ValueError(f"no configuration fits in num_gpus={n} GPUs" + (" with gpu_memory" if cap else ""))
    best = res[0]
    dl = best["dp"][names.index(llm)]
    confs = {}
    for i, name in enumerate(names):
        tp, dp, pp = best["tp"][i], best["dp"][i], best["pp"][i]
        c = times[i, tps.index(tp)]
        confs[name] = ModuleConfig(tp * dp * pp, tp, dp, pp, float((dl // dp) * c / pp))
    lines = [
        f"{len(names)} modules on {n} GPUs, global batch {batch}: best iteration time {best['iter_time']:.4g} "
        f"(warm-up {best['warmup']:.4g} + steady {best['steady']:.4g}) on {best['gpus']} GPUs",
        *(
            f"  {name}: {m.gpus} GPUs = TP {m.tp} x DP {m.dp} x PP {m.pp}, stage time {m.stage_time:.4g}"
            for name, m in confs.items()
        ),
        "alternatives: "
        + "; ".join(f"{r['iter_time']:.4g} (TP {r['tp']}, DP {r['dp']}, PP {r['pp']})" for r in res[1:]),
    ]
    return Allocation(
        confs, best["iter_time"], best["warmup"], best["steady"], best["gpus"], res[1:], "\n".join(lines)
    )
