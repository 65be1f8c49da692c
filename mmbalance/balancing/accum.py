"""Micro-batches of whole optimizer steps: every step's examples split into ``grad_accum``
micro-batches per rank, balanced slot by slot (ranks synchronize at every micro-batch) and in the
step totals. numpy only; the planning is the compiled core's (``csrc/accum.cpp``).
"""

from __future__ import annotations

import numpy as np

from ._core_api import POLICY_IDS, core
from .validate import as_count, as_lengths

__all__ = ["plan_micro_batches"]


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
    if policy not in POLICY_IDS:
        raise ValueError(f"policy must be one of {sorted(POLICY_IDS)}, got {policy!r}")
    lengths = np.ascontiguousarray(as_lengths(lengths, "lengths"), dtype=np.int64)
    return core().plan_accum(
        lengths,
        as_count(steps, "steps", minimum=0),
        as_count(step_size, "step_size", minimum=0),
        as_count(num_ranks, "num_ranks"),
        as_count(grad_accum, "grad_accum"),
        POLICY_IDS[policy],
        float(alpha),
        float(beta),
        bool(padded),
    )
