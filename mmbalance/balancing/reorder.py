"""Microbatch reordering for pipelines (DistTrain section 6.1-6.2, MMScale section 5.1-5.2), and better.

A global batch of ``n`` samples (one sample per microbatch, as in DistTrain) is split over
``num_groups`` DP groups in equal-count consecutive blocks; each group runs its microbatches
through a ``p``-stage 1F1B pipeline. ``stage_times[i, s]`` is the forward time of sample ``i`` on
stage ``s`` (backward: ``backward_times``, by default twice the forward).

- :func:`simulate_1f1b` scores any order: every op starts when the previous op on its stage and its
  dependency (the forward on the stage before, the backward on the stage after) have ended.
- :func:`intra_reorder`: which samples go to which DP group (equal counts, minimal largest load).
  The paper's algorithm 2 as written (ascending sort, least-loaded group, counts ignored, then split
  in equal blocks by the loader) is :func:`paper_intra_reorder`.
- :func:`inter_reorder`: the order of one group's microbatches. The paper's algorithm 3 is
  :func:`paper_inter_reorder`; ours starts from the best of it, the original and sorted orders and
  improves by simulated swaps and moves: never slower than either.
- :func:`reorder`: both levels; never simulates slower than the original order or the paper's two
  algorithms combined.

>>> t = np.array([[1.0, 1.0], [4.0, 4.0], [1.0, 1.0], [4.0, 4.0]])
>>> plan = reorder(t, num_groups=2)
>>> plan.makespan <= min(plan.info["original"], plan.info["paper"])
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._core_api import core
from .validate import as_count, as_nonnegative


@dataclass(frozen=True, eq=False)
class ReorderPlan:
    """Samples of a global batch in execution order, split over DP groups.

    Attributes:
        order: int64 ``[n]``, a permutation of the samples: DP group ``k`` runs
            ``order[offsets[k]:offsets[k + 1]]`` as its microbatches, in that order.
        offsets: int64 ``[num_groups + 1]``, equal-count blocks (``numpy.array_split`` sizes).
        group_times: float64 ``[num_groups]``, the simulated 1F1B time of every group.
        makespan: the slowest group's time.
        info: ``original`` and ``paper`` makespans and ``method`` (which candidate won).
    """

    order: np.ndarray
    offsets: np.ndarray
    group_times: np.ndarray
    makespan: float
    info: dict


def _times(stage_times, backward_times, name="stage_times"):
    f = _as_matrix(stage_times, name)
    if backward_times is None:
        b = 2.0 * f
    else:
        b = _as_matrix(backward_times, "backward_times")
        if b.shape != f.shape:
            raise ValueError(f"backward_times must have the shape of {name} {f.shape}, got {b.shape}")
    return f, b


def _as_matrix(x, name) -> np.ndarray:
    a = as_nonnegative(x, name, ndim=2, dims="[microbatches, stages]")
    if a.shape[1] < 1 and a.shape[0] > 0:
        raise ValueError(f"{name} needs at least one stage")
    return a


def _offsets(n: int, m: int) -> np.ndarray:
    sizes = np.full(m, n // m, dtype=np.int64)
    sizes[: n % m] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _block_loads(costs: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return (
        np.add.reduceat(np.append(costs[order], 0.0), offsets[:-1])
        if costs.size
        else np.zeros(offsets.size - 1)
    )


def simulate_1f1b(stage_times, backward_times=None, *, return_schedule: bool = False):
    """Makespan of microbatches run in row order through a 1F1B pipeline (DistTrain section 6.2).

    Args:
        stage_times: ``[l, p]`` forward time of microbatch ``i`` on stage ``s`` (float, >= 0).
        backward_times: ``[l, p]`` backward times; default ``2 * stage_times``.
        return_schedule: also return the start times of every forward and backward ``[l, p]``.

    Stage ``s`` runs ``min(p - 1 - s, l)`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards. Empty input: 0.

    >>> simulate_1f1b([[1.0, 1.0], [1.0, 1.0]])  # two microbatches, two stages, backward = 2
    9.0
    """
    f, b = _times(stage_times, backward_times)
    if f.shape[0] == 0:
        return (0.0, f.copy(), b.copy()) if return_schedule else 0.0
    return core().simulate_1f1b(f, b, return_schedule)


def paper_intra_reorder(costs, num_groups: int) -> np.ndarray:
    """DistTrain algorithm 2 as written: an order whose equal blocks are the DP groups."""
    c = as_nonnegative(costs, "costs")
    m = as_count(num_groups, "num_groups")
    return core().paper_intra_order(c, m)


def intra_reorder(costs, num_groups: int, *, max_iters: int | None = None) -> np.ndarray:
    """An order of the samples whose equal-count blocks are balanced DP groups (DistTrain section 6.1).

    Longest first to the least-loaded group with a free slot, then swaps out of the largest group;
    the original order and :func:`paper_intra_reorder` are kept if they are better (never worse).
    Within a block samples are in index order.

    >>> intra_reorder([1, 2, 3, 4], 2).reshape(2, 2).tolist()
    [[0, 3], [1, 2]]
    """
    c = as_nonnegative(costs, "costs")
    m = as_count(num_groups, "num_groups")
    n = c.size
    iters = 4 * n if max_iters is None else as_count(max_iters, "max_iters", minimum=0)
    offsets = _offsets(n, m)
    group = core().balanced_count_groups(c, m, iters)
    ours = np.argsort(group, kind="stable").astype(np.int64)
    best, best_load = ours, _block_loads(c, ours, offsets).max(initial=0.0)
    for cand in (np.arange(n, dtype=np.int64), core().paper_intra_order(c, m)):
        load = _block_loads(c, cand, offsets).max(initial=0.0)
        if load < best_load:
            best, best_load = cand, load
    return best


def paper_inter_reorder(stage_times, backward_times=None) -> np.ndarray:
    """DistTrain algorithm 3: the order of one group's microbatches (indices of rows).

    Smallest (first-stage forward) first, the ``p - 1`` next smallest last (smallest at the very
    end), and each pipeline interval, read from a simulation of the microbatches placed so far,
    filled with the microbatch(es) whose first-stage forward time matches it.
    """
    f, b = _times(stage_times, backward_times)
    n = f.shape[0]
    return core().reorder_blocks(f, b, np.arange(n, dtype=np.int64), np.array([0, n], dtype=np.int64), 1, 0)[
        0
    ]


def inter_reorder(stage_times, backward_times=None, *, max_evals: int | None = None) -> np.ndarray:
    """The order of one group's microbatches that minimizes the simulated 1F1B time (heuristic).

    Never slower than the original order or :func:`paper_inter_reorder`. ``max_evals``: budget of
    simulations for the local search (default ``8 * l``).

    >>> t = np.array([[3.0, 3.0], [1.0, 1.0], [2.0, 2.0]])
    >>> order = inter_reorder(t)
    >>> simulate_1f1b(t[order]) <= min(simulate_1f1b(t), simulate_1f1b(t[paper_inter_reorder(t)]))
    True
    """
    f, b = _times(stage_times, backward_times)
    n = f.shape[0]
    evals = 8 * n if max_evals is None else as_count(max_evals, "max_evals", minimum=0)
    return core().reorder_blocks(
        f, b, np.arange(n, dtype=np.int64), np.array([0, n], dtype=np.int64), 0, evals
    )[0]


def _plan(f, b, order, offsets, method, evals):
    if method is None:
        times = core().simulate_blocks(f, b, order, offsets)
    else:
        order, times = core().reorder_blocks(f, b, order, offsets, method, evals)
    return order, times, float(times.max(initial=0.0))


def reorder(
    stage_times, num_groups: int, backward_times=None, *, max_evals: int | None = None
) -> ReorderPlan:
    """Intra- and inter-microbatch reordering of a global batch (DistTrain section 6.1-6.2).

    Args:
        stage_times: ``[n, p]`` forward time of every sample (a microbatch) on every stage.
        num_groups: DP groups; they get ``numpy.array_split`` counts of samples.
        backward_times: ``[n, p]``; default ``2 * stage_times``.
        max_evals: simulations per searched group for the inter-microbatch order (default
            ``8 * n/groups``); only the slowest group is searched, then the new slowest, and so on.

    Samples are balanced over the groups by their slowest stage (forward + backward), which tracks
    the simulated time better than their total; the paper's algorithm 2 uses the total. The result
    is the best of ours, the original order and the paper's algorithms 2 + 3, by simulated makespan.

    Raises:
        ValueError / TypeError naming the argument.
    """
    f, b = _times(stage_times, backward_times)
    m = as_count(num_groups, "num_groups")
    n = f.shape[0]
    offsets = _offsets(n, m)
    evals = 8 * max(1, -(-n // m)) if max_evals is None else as_count(max_evals, "max_evals", minimum=0)
    # a group's 1F1B time is mostly its microbatches' slowest-stage times, so that is the load
    fb = f + b
    w = np.ascontiguousarray(fb.max(axis=1)) if n else np.zeros(0)
    ident = np.arange(n, dtype=np.int64)
    group = core().balanced_count_groups(w, m, 64)
    # the paper's order is not a seed here: the paper's whole plan is compared below
    ours = _plan(f, b, np.argsort(group, kind="stable").astype(np.int64), offsets, 2, evals)
    orig = _plan(f, b, ident, offsets, None, evals)
    paper = _plan(f, b, core().paper_intra_order(fb.sum(axis=1), m), offsets, 1, evals)
    best, method = ours, "ours"
    if orig[2] < best[2] or paper[2] < best[2]:
        # our inter-microbatch order on the better assignment is at least as good as it
        base, method = (orig, "original+ours") if orig[2] <= paper[2] else (paper, "paper+ours")
        best = _plan(f, b, base[0], offsets, 0, evals)
    info = {"original": orig[2], "paper": paper[2], "method": method}
    return ReorderPlan(best[0], offsets, best[1], best[2], info)


def paper_reorder(stage_times, num_groups: int, backward_times=None) -> ReorderPlan:
    """The paper's algorithms 2 and 3 combined, for comparisons."""
    f, b = _times(stage_times, backward_times)
    m = as_count(num_groups, "num_groups")
    offsets = _offsets(f.shape[0], m)
    w = (f + b).sum(axis=1)
    order, times, ms = _plan(f, b, core().paper_intra_order(w, m), offsets, 1, 0)
    return ReorderPlan(order, offsets, times, ms, {"method": "paper"})
