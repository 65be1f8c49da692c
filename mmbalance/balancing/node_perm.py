"""Node-wise rearrangement (OrchMLLM section 5.2.2, algorithm 3).

For users who balance without source information (or with a planner of their own): permute a plan's
new batches over ranks so that the largest off-node send volume of any rank is minimal. Batch costs
do not change. ``method="exact"`` solves the paper's integer program with HiGHS (scipy); ``"fast"``
is the compiled greedy + swap search for large clusters; ``"auto"`` picks exact for small clusters
(at most 64 ranks) when scipy is installed.
"""

from __future__ import annotations

import numpy as np

from ._core_api import core
from .plan import Plan
from .validate import as_coefficient, as_count, as_ranks


def node_wise_permutation(
    plan: Plan,
    ranks_per_node: int,
    *,
    src_ranks=None,
    method: str = "auto",
    time_limit: float = 10.0,
    max_iters: int | None = None,
) -> Plan:
    """Return ``plan`` with its batches permuted over ranks to cut the worst off-node send.

    Args:
        plan: any plan; its ``dst_rank`` values name the new batches.
        ranks_per_node: ranks per node (must divide ``plan.num_ranks``).
        src_ranks: ``[n]`` rank each example is on now; defaults to ``plan.src_rank``.
        method: ``"auto"``, ``"exact"`` (integer program, needs scipy) or ``"fast"``.
        time_limit: seconds for the exact solver; its best solution so far is used when it runs out
            (and the fast one if that is better).
        max_iters: swap iterations of the fast method (default ``4 * num_ranks``).

    Returns:
        A new :class:`Plan` with ``src_rank`` set; within a node, each batch goes to the rank that
        sampled most of its tokens.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    d = plan.num_ranks
    rpn = as_count(ranks_per_node, "ranks_per_node")
    if d % rpn != 0:
        raise ValueError(f"ranks_per_node ({rpn}) must divide num_ranks ({d})")
    if src_ranks is None:
        if plan.src_rank is None:
            raise ValueError("src_ranks is required when the plan has no source layout")
        src = np.ascontiguousarray(plan.src_rank)
    else:
        src = as_ranks(src_ranks, plan.num_examples, d, "src_ranks")
    if method not in ("auto", "exact", "fast"):
        raise ValueError(f"method must be 'auto', 'exact' or 'fast', got {method!r}")
    time_limit = as_coefficient(time_limit, "time_limit")
    iters = 4 * d if max_iters is None else as_count(max_iters, "max_iters", minimum=0)
    lengths = plan.lengths
    batch = np.ascontiguousarray(plan.dst_rank)

    perm = core().node_permutation(lengths, batch, src, d, rpn, iters)
    use_exact = method == "exact" or (method == "auto" and d <= 64 and d // rpn > 1 and _have_scipy())
    if use_exact and d // rpn > 1:
        node_of = _exact_nodes(lengths, batch, src, d, rpn, time_limit)
        if node_of is not None:
            exact = core().place_within_nodes(lengths, batch, src, d, rpn, node_of)
            if _worst_off(lengths, src, exact[batch], rpn) <= _worst_off(lengths, src, perm[batch], rpn):
                perm = exact
    return Plan.from_destinations(
        lengths,
        perm[batch],
        d,
        src,
        policy=plan.policy,
        alpha=plan.alpha,
        beta=plan.beta,
        costs=plan.costs[np.argsort(perm)],
    )


def _worst_off(lengths, src, dst, rpn) -> int:
    off = (src // rpn) != (dst // rpn)
    if not off.any():
        return 0
    return int(np.bincount(src[off], weights=lengths[off]).max())


def have_exact_solver() -> bool:
    """Whether ``method="exact"`` can run here (scipy installed: ``pip install "mmbalance[exact]"``)."""
    return _have_scipy()


def _have_scipy() -> bool:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return False
    return True


def _exact_nodes(lengths, batch, src, d, rpn, time_limit) -> np.ndarray | None:
    """Algorithm 3's integer program: x[m, b] = batch b on node m; minimize the worst off-node send."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as exc:
        raise ImportError(
            "node_wise_permutation(method='exact') needs scipy (its HiGHS solver): "
            'pip install "mmbalance[exact]", or use method="fast" or "auto"'
        ) from exc
    nodes = d // rpn
    nv = nodes * d + 1  # x[m, b] at m * d + b, then t
    vol = np.zeros((d, d))
    np.add.at(vol, (src, batch), lengths)
    out = vol.sum(axis=1)
    rows, cols, vals = [], [], []
    # each batch on exactly one node
    for b in range(d):
        rows += [b] * nodes
        cols += [m * d + b for m in range(nodes)]
        vals += [1.0] * nodes
    # each node holds rpn batches
    for m in range(nodes):
        rows += [d + m] * d
        cols += [m * d + b for b in range(d)]
        vals += [1.0] * d
    # out_s - sum_b vol[s, b] x[node(s), b] <= t
    base = d + nodes
    for s in range(d):
        m = s // rpn
        nz = np.flatnonzero(vol[s])
        rows += [base + s] * (len(nz) + 1)
        cols += [m * d + int(b) for b in nz] + [nv - 1]
        vals += [-float(vol[s, b]) for b in nz] + [-1.0]
    a = coo_matrix((vals, (rows, cols)), shape=(base + d, nv)).tocsr()
    lo = np.concatenate([np.ones(d), np.full(nodes, rpn), np.full(d, -np.inf)])
    hi = np.concatenate([np.ones(d), np.full(nodes, rpn), -out])
    c = np.zeros(nv)
    c[-1] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    ub = np.ones(nv)
    ub[-1] = np.inf
    res = milp(
        c,
        constraints=LinearConstraint(a, lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), ub),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        return None
    x = res.x[:-1].reshape(nodes, d)
    node_of = np.argmax(x, axis=0).astype(np.int64)
    if not np.all(np.bincount(node_of, minlength=nodes) == rpn):
        return None
    return node_of
