"""Micro-batches of whole optimizer steps: every step's examples split into ``grad_accum``
micro-batches per rank, balanced slot by slot (ranks synchronize at every micro-batch) and in the
step totals. numpy only; the planning is the compiled core's (``csrc/accum.cpp``).
"""

from __future__ import annotations

import numpy as np

from ._core_api import POLICY_IDS, core
from .validate import as_count, as_lengths

__all__ = ["batch_costs_of", "plan_micro_batches", "sampled_costs"]


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
