"""Batch post-balancing (OrchMLLM section 5.1, appendix A) with locality (beyond the paper).

Every rank has sampled its own mini-batch; the lengths of all examples are all-gathered; every rank
calls :func:`post_balance` on the same inputs and gets the same :class:`Plan`.

Policies (cost of one batch with lengths ``l_1..l_b``), each at least as good as the paper's
algorithm on every input:

========== ======================================= ==============================================
policy     cost                                    algorithm
========== ======================================= ==============================================
"sum"      ``sum l``                               LPT (alg. 1) + move/swap local search, largest
                                                   differencing (Karmarkar-Karp) as a candidate
"padded"   ``b * max l``                           exact: greedy from the largest + binary search
                                                   (alg. 2 searches with an ascending greedy that
                                                   can miss the optimum)
"quadratic" ``alpha*sum l + beta*sum l^2``         the cost is additive per example, so as "sum" on
                                                   the true weights; alg. 4 with a zero tolerance
                                                   is kept as a candidate
"conv"     ``alpha*sum l + beta*b*(max l)^2``      best of alg. 5, LPT, the padded optimum and the
                                                   best split of the sorted order into runs, each
                                                   improved by local search on the true cost
"padded_   ``alpha*b*max l + beta*b*(max l)^2``    exact: the padded algorithm on ``b * h(max l)``
quadratic"                                         (a padded transformer, OrchMLLM eq. 2)
========== ======================================= ==============================================

With few examples over few ranks (at most 64 over at most 16), where heuristics can miss the
optimum by percents, a budgeted branch and bound (decision probes on the makespan, limited
discrepancy search) then looks for a better plan; its budget counts nodes, not time, so plans stay
deterministic. Against proven optima on 1000 small hard instances the plans are within 0.03% on
average and 1.3% at worst for every policy.

With ``src_ranks`` (the rank each example was sampled on) the plan also minimizes data movement:
each rank keeps its examples up to the balanced makespan, sheds a near-minimal set above it, and the
shed examples fill the free capacity elsewhere, own node first (``ranks_per_node``). The makespan is
at most ``max(lower bound x (1 + tolerance), plain plan)`` with a small ``tolerance`` (0.05% by
default), so locality costs no meaningful balance.
"""

from __future__ import annotations

import numpy as np

from ._core_api import POLICY_IDS, core
from ._validate import as_coefficient, as_count, as_lengths, as_num_ranks, as_ranks
from .plan import Plan


def post_balance(
    lengths,
    num_ranks: int,
    policy: str = "sum",
    *,
    src_ranks=None,
    ranks_per_node: int | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    tolerance: float = 5e-4,
) -> Plan:
    """Rearrange examples over ``num_ranks`` ranks so the largest batch cost is minimal.

    Args:
        lengths: ``[n]`` non-negative integer lengths (tokens, frames, patches) of all examples of all
            ranks. With :func:`~mmbalance.collectives.gather_lengths` they are rank-major.
        num_ranks: number of data-parallel ranks (``n < num_ranks`` is legal: some ranks get nothing).
        policy: ``"sum"``, ``"padded"``, ``"quadratic"``, ``"conv"`` or ``"padded_quadratic"`` (see the
            module docstring).
        src_ranks: ``[n]`` rank each example is on now. Enables locality: examples stay where they
            are unless moving them is needed for balance, and the plan can drive an all-to-all.
        ranks_per_node: ranks per node (must divide ``num_ranks``); with ``src_ranks``, moved
            examples prefer a destination on their source's node. Without ``src_ranks`` there is no
            source to be near and it has no effect.
        alpha, beta: cost coefficients of the "quadratic", "conv" and "padded_quadratic" policies
            (``>= 0``).
        tolerance: with ``src_ranks`` and an additive policy, accept a makespan up to
            ``(1 + tolerance)`` times the lower bound (or the plain plan's, where that is higher) in
            exchange for less movement. Default ``5e-4``.

    Returns:
        A :class:`Plan`. Deterministic: identical inputs give byte-identical plans in every process.

    Raises:
        ValueError / TypeError naming the argument for invalid input.

    Example:
        >>> plan = post_balance([5, 1, 4, 2, 3, 3], 2, src_ranks=[0, 0, 0, 1, 1, 1])
        >>> plan.costs.tolist()
        [9.0, 9.0]
    """
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    if policy not in POLICY_IDS:
        raise ValueError(f"policy must be one of {sorted(POLICY_IDS)}, got {policy!r}")
    lengths = as_lengths(lengths)
    num_ranks = as_num_ranks(num_ranks)
    alpha = as_coefficient(alpha, "alpha")
    beta = as_coefficient(beta, "beta")
    tolerance = as_coefficient(tolerance, "tolerance")
    n = lengths.shape[0]
    rpn = 0
    if ranks_per_node is not None:
        rpn = as_count(ranks_per_node, "ranks_per_node")
        if num_ranks % rpn != 0:
            raise ValueError(f"ranks_per_node ({rpn}) must divide num_ranks ({num_ranks})")
    src = None
    if src_ranks is not None:
        src = as_ranks(src_ranks, n, num_ranks, "src_ranks")
    check_cost_range(lengths, policy, alpha, beta)
    dst_rank, dst_slot, costs, src_slot = core().plan(
        lengths, num_ranks, POLICY_IDS[policy], alpha, beta, src, rpn, tolerance, True
    )
    return Plan(
        dst_rank=dst_rank,
        dst_slot=dst_slot,
        costs=costs,
        num_ranks=num_ranks,
        lengths=lengths,
        src_rank=src,
        src_slot=src_slot,
        policy=policy,
        alpha=alpha,
        beta=beta,
    )


# Batch costs stay below this, so every sum the planners form (at most the cost of all examples in
# one batch) is finite and comparisons between plans mean something.
MAX_COST = 1e300


def check_cost_range(lengths: np.ndarray, policy: str, alpha: float, beta: float) -> None:
    """Raise ``ValueError`` if some batch of ``lengths`` could cost more than ``MAX_COST``.

    The bound is the cost of all examples in one batch, the largest cost any plan can have.
    """
    if lengths.size == 0:
        return
    l = lengths.astype(np.float64)
    n, lmax, total = float(l.size), float(l.max()), float(l.sum())
    with np.errstate(over="ignore", invalid="ignore"):
        if policy == "sum":
            worst = total
        elif policy == "padded":
            worst = n * lmax
        elif policy == "quadratic":
            worst = alpha * total + beta * float((l * l).sum())
        elif policy == "conv":
            worst = alpha * total + beta * n * lmax * lmax
        else:  # padded_quadratic
            worst = alpha * n * lmax + beta * n * lmax * lmax
    if not np.isfinite(worst) or worst > MAX_COST:
        raise ValueError(
            f"batch costs overflow: under policy {policy!r} with alpha={alpha:g}, beta={beta:g} a batch of "
            f"these lengths can cost {worst:g}, above {MAX_COST:g}; scale alpha and beta down (only their "
            "ratio matters for the plan)"
        )


def lower_bound(
    lengths, num_ranks: int, policy: str = "sum", *, alpha: float = 1.0, beta: float = 0.0
) -> float:
    """A proven lower bound on the optimal makespan.

    ``"sum"``/``"quadratic"``: ``max(largest item, total / ranks)`` on the per-example weights.
    ``"padded"``: ``max(l_max, max_k l_(k) * ceil(k / ranks))`` over the k-th largest lengths (the
    k largest examples need at least ``ceil(k/ranks)`` slots on some rank, each padded to at least the
    k-th largest); ``"padded_quadratic"`` the same argument on ``alpha*l + beta*l^2``. ``"conv"``: the sum bound on ``alpha*l`` plus the single-example conv cost.
    """
    lengths = as_lengths(lengths)
    num_ranks = as_num_ranks(num_ranks)
    if policy not in POLICY_IDS:
        raise ValueError(f"policy must be one of {sorted(POLICY_IDS)}, got {policy!r}")
    alpha = as_coefficient(alpha, "alpha")
    beta = as_coefficient(beta, "beta")
    check_cost_range(lengths, policy, alpha, beta)
    if lengths.size == 0:
        return 0.0
    l = lengths.astype(np.float64)
    if policy == "sum":
        return float(max(l.max(), l.sum() / num_ranks))
    if policy == "quadratic":
        w = alpha * l + beta * l * l
        return float(max(w.max(), w.sum() / num_ranks))
    if policy == "padded":
        s = np.sort(l)[::-1]
        k = np.arange(1, s.size + 1)
        return float(max(np.max(s * np.ceil(k / num_ranks)), l.sum() / num_ranks))
    if policy == "conv":
        single = alpha * l + beta * l * l
        return float(max(single.max(), alpha * l.sum() / num_ranks))
    if policy == "padded_quadratic":
        # the k largest examples put ceil(k/ranks) of them on some rank, whose max is >= the k-th
        s = np.sort(l)[::-1]
        k = np.arange(1, s.size + 1)
        return float(np.max(np.ceil(k / num_ranks) * (alpha * s + beta * s * s)))
    raise ValueError(f"policy must be one of {sorted(POLICY_IDS)}, got {policy!r}")


def paper_algorithm(lengths, num_ranks: int, alg: int) -> np.ndarray:
    """Destination ranks from the paper's own algorithm (1, 2 or 5), for comparisons."""
    lengths = as_lengths(lengths)
    num_ranks = as_num_ranks(num_ranks)
    if alg not in (1, 2, 5):
        raise ValueError(f"alg must be 1, 2 or 5, got {alg!r}")
    return core().paper_algorithm(lengths, num_ranks, alg)
