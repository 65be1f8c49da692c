"""Micro-batches of whole optimizer steps: every step's examples split into ``grad_accum``
micro-batches per rank, balanced slot by slot (ranks synchronize at every micro-batch) and in the
step totals. numpy only; the planning is the compiled core's (``csrc/accum.cpp``).
"""

from __future__ import annotations

import numpy as np

from ._core_api import POLICY_IDS, core
from .validate import as_count, as_lengths

__all__ = ["batch_costs_of", "plan_equal_counts", "plan_micro_batches", "sampled_costs"]


def _policy_id(policy: str) -> int:
    if policy not in POLICY_IDS:
        raise ValueError(f"policy must be one of {sorted(POLICY_IDS)}, got {policy!r}")
    return POLICY_IDS[policy]


def plan_micro_batches(
    lengths,
    steps: int,
    step_size: int,
    num_ranks: int,
    grad_accum: int,
    policy: str,
    alpha: float,
    beta: float,
    padded: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plan ``steps`` consecutive steps of ``step_size`` examples each (``lengths`` in sampling order,
    ``steps * step_size`` of them).

    Returns ``(rank, micro, costs)``: int64 ``[steps * step_size]`` the rank and the micro-batch slot
    of every example, and float64 ``[steps, grad_accum, num_ranks]`` the cost of every micro-batch
    under ``policy`` (a micro-batch costs ``count * h(longest)`` when ``padded``).
    """
    policy_id = _policy_id(policy)
    lengths = np.ascontiguousarray(as_lengths(lengths, "lengths"), dtype=np.int64)
    return core().plan_accum(
        lengths,
        as_count(steps, "steps", minimum=0),
        as_count(step_size, "step_size", minimum=0),
        as_count(num_ranks, "num_ranks"),
        as_count(grad_accum, "grad_accum"),
        policy_id,
        float(alpha),
        float(beta),
        bool(padded),
    )


def sampled_costs(
    lengths,
    steps: int,
    step_size: int,
    num_ranks: int,
    grad_accum: int,
    policy: str,
    alpha: float,
    beta: float,
) -> np.ndarray:
    """float64 ``[steps, grad_accum, num_ranks]``: the cost of every micro-batch when each step's
    examples (``lengths`` in sampling order, ``steps * step_size`` of them) are dealt as sampled,
    as ``DistributedSampler`` and a plain loader deal them: example ``p`` of a step to rank
    ``p % num_ranks``, in micro-batch ``(p // num_ranks) // (step_size // (num_ranks * grad_accum))``.
    What :func:`plan_micro_batches` is measured against (its ``costs``)."""
    _policy_id(policy)  # refused before the shapes are
    lengths = np.ascontiguousarray(as_lengths(lengths, "lengths"), dtype=np.int64)
    steps = as_count(steps, "steps", minimum=0)
    step_size = as_count(step_size, "step_size", minimum=0)
    num_ranks = as_count(num_ranks, "num_ranks")
    grad_accum = as_count(grad_accum, "grad_accum")
    if lengths.size != steps * step_size or step_size % (num_ranks * grad_accum):
        raise ValueError(
            f"lengths: {lengths.size} examples for {steps} steps of {step_size}, each a multiple of "
            f"num_ranks * grad_accum = {num_ranks * grad_accum}"
        )
    batch = step_size // (num_ranks * grad_accum)
    p = np.arange(step_size, dtype=np.int64)
    within = (p // num_ranks // max(batch, 1)) * num_ranks + p % num_ranks  # slot * ranks + rank
    key = (np.arange(steps, dtype=np.int64)[:, None] * (grad_accum * num_ranks) + within).reshape(-1)
    costs = batch_costs_of(lengths, key, steps * grad_accum * num_ranks, policy, alpha, beta)
    return costs.reshape(steps, grad_accum, num_ranks)


def batch_costs_of(lengths, batch, num_batches: int, policy: str, alpha: float, beta: float) -> np.ndarray:
    """float64 ``[num_batches]``: the cost under ``policy`` of the batches that putting example
    ``i`` (``lengths[i]``) in batch ``batch[i]`` forms (the planners' own pricing)."""
    policy_id = _policy_id(policy)
    lengths = np.ascontiguousarray(as_lengths(lengths, "lengths"), dtype=np.int64)
    batch = np.ascontiguousarray(np.asarray(batch, dtype=np.int64))
    num_batches = as_count(num_batches, "num_batches", minimum=0)
    if batch.shape != lengths.shape or (
        batch.size and (batch.min() < 0 or batch.max() >= max(num_batches, 1))
    ):
        raise ValueError(
            f"batch must give a batch in 0..{num_batches - 1} for each of the {lengths.size} lengths"
        )
    if num_batches == 0:
        return np.zeros(0)
    costs = core().batch_costs(lengths, batch, int(num_batches), policy_id, float(alpha), float(beta))
    return np.asarray(costs, dtype=np.float64)


def _ratio_worst(costs: np.ndarray) -> tuple[float, float]:
    """``(step, micro)`` max/mean over ranks of one step's costs ``[G, ranks]``: the per-rank step
    totals, and the worst micro-batch slot (what the sampler's stats report)."""

    def ratio(load: np.ndarray) -> np.ndarray:
        mean = load.mean(axis=-1)
        return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)

    return float(ratio(costs.sum(axis=0))), float(ratio(costs).max(initial=1.0))


def plan_equal_counts(
    lengths,
    steps: int,
    step_size: int,
    num_ranks: int,
    grad_accum: int,
    policy: str,
    alpha: float,
    beta: float,
    padded: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`plan_micro_batches` where every micro-batch holds exactly ``step_size / (num_ranks *
    grad_accum)`` examples (``b``): for losses that are a mean over each micro-batch's units (DPO's
    pairs), which equal counts keep what they are without balancing.

    Per step: packed, the step's examples form ``num_ranks * grad_accum`` groups of ``b`` of about
    equal cost (longest first to the least-loaded group with room, then swaps; the compiled
    ``balanced_count_groups``), and the costliest ``num_ranks`` groups form the first slot, and so
    on; padded (a micro-batch costs ``b * h(longest)``), the length order cut into consecutive
    slots of ``num_ranks * b`` examples, which gives the least sum over slots of the slowest rank,
    each dealt round-robin over its groups, so that the slot's ``num_ranks`` longest examples lead
    them. In each slot the costliest group goes to the rank
    with the least total so far. A step whose plan is worse than the examples dealt as sampled
    (:func:`sampled_costs`, equal counts too) in the max/mean of the per-rank totals or of any
    micro-batch slot keeps the sampled deal, so neither is ever worse than the draw.

    Returns ``(rank, micro, costs)`` as :func:`plan_micro_batches` does.
    """
    policy_id = _policy_id(policy)
    lengths = np.ascontiguousarray(as_lengths(lengths, "lengths"), dtype=np.int64)
    steps = as_count(steps, "steps", minimum=0)
    step_size = as_count(step_size, "step_size", minimum=0)
    num_ranks = as_count(num_ranks, "num_ranks")
    grad_accum = as_count(grad_accum, "grad_accum")
    slots = num_ranks * grad_accum
    if lengths.size != steps * step_size or step_size % slots:
        raise ValueError(
            f"lengths: {lengths.size} examples for {steps} steps of {step_size}, each a multiple of "
            f"num_ranks * grad_accum = {slots}"
        )
    b = step_size // slots
    sampled = sampled_costs(lengths, steps, step_size, num_ranks, grad_accum, policy, alpha, beta)
    p = np.arange(step_size, dtype=np.int64)
    drawn_rank = p % num_ranks
    drawn_micro = p // num_ranks // max(b, 1)
    rank = np.empty(steps * step_size, dtype=np.int64)
    micro = np.empty(steps * step_size, dtype=np.int64)
    costs = np.empty((steps, grad_accum, num_ranks), dtype=np.float64)
    h = lengths.astype(np.float64)
    if policy_id in (POLICY_IDS["quadratic"], POLICY_IDS["padded_quadratic"]):
        h = alpha * h + beta * h * h
    for s in range(steps):
        cut = slice(s * step_size, (s + 1) * step_size)
        mine = lengths[cut]
        if padded:
            order = np.argsort(-mine, kind="stable")
            group = np.empty(step_size, dtype=np.int64)
            pos = np.arange(step_size, dtype=np.int64)
            # slot k: the next num_ranks * b of the length order; within it dealt round-robin, so the
            # slot's num_ranks longest examples lead its groups (close in length: the slot is even)
            group[order] = (pos // (num_ranks * max(b, 1))) * num_ranks + pos % num_ranks
        else:
            group = np.asarray(core().balanced_count_groups(h[cut], slots, 4 * step_size), dtype=np.int64)
        gcost = np.asarray(batch_costs_of(mine, group, slots, policy, alpha, beta))
        if not padded:  # costliest groups first (padded groups already are, by length)
            by_cost = np.argsort(-gcost, kind="stable")
            relabel = np.empty(slots, dtype=np.int64)
            relabel[by_cost] = np.arange(slots, dtype=np.int64)
            group, gcost = relabel[group], gcost[by_cost]
        total = np.zeros(num_ranks)
        g_rank = np.empty(slots, dtype=np.int64)
        planned = np.empty((grad_accum, num_ranks))
        for k in range(grad_accum):
            members = np.arange(k * num_ranks, (k + 1) * num_ranks)
            members = members[np.argsort(-gcost[members], kind="stable")]
            ranks = np.argsort(total, kind="stable")  # the costliest group to the least-loaded rank
            g_rank[members] = ranks
            total[ranks] += gcost[members]
            planned[k, ranks] = gcost[members]
        plan_rank, plan_micro = g_rank[group], group // num_ranks
        if all(a <= c + 1e-12 for a, c in zip(_ratio_worst(planned), _ratio_worst(sampled[s]), strict=True)):
            rank[cut], micro[cut], costs[s] = plan_rank, plan_micro, planned
        else:
            rank[cut], micro[cut], costs[s] = drawn_rank, drawn_micro, sampled[s]
    return rank, micro, costs
