"""Cross-check of :mod:`tests.balancing.exact` with scipy.optimize.milp (HiGHS), on the leader
formulation described in that module's docstring."""

from __future__ import annotations

import numpy as np

from .exact import _exact_makespan_of, _prepare


def milp_makespan(
    lengths,
    num_ranks: int,
    policy: str = "sum",
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    time_limit: float = 60.0,
) -> tuple[float, np.ndarray, bool]:
    """Cross-check with scipy.optimize.milp (HiGHS), leader formulation (see module docstring).

    Returns ``(makespan, dst, proven)``: the makespan is re-costed exactly from HiGHS' assignment
    (so it is a true upper bound on the optimum); ``proven`` is HiGHS' own optimality claim, which
    is only as good as its tolerances.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    lengths, d, model, order = _prepare(lengths, num_ranks, policy, alpha, beta)
    n = len(lengths)
    if n == 0:
        return 0.0, np.zeros(0, dtype=np.int64), True
    s = [lengths[i] for i in order]
    norm = max(max(model.w(l) for l in s), 1)
    pairs = [(i, j) for i in range(n) for j in range(i + 1)]  # item i in batch led by j <= i
    col = {p: c for c, p in enumerate(pairs)}
    nv = len(pairs) + 1
    z = nv - 1
    rows = n + (len(pairs) - n) + 1 + n
    A = lil_matrix((rows, nv))
    lo = np.full(rows, -np.inf)
    hi = np.zeros(rows)
    r = 0
    for i in range(n):  # each item exactly once
        for j in range(i + 1):
            A[r, col[(i, j)]] = 1
        lo[r] = hi[r] = 1
        r += 1
    for i, j in pairs:  # only into a batch that is led
        if i != j:
            A[r, col[(i, j)]] = 1
            A[r, col[(j, j)]] = -1
            r += 1
    for j in range(n):
        A[r, col[(j, j)]] = 1
    hi[r] = d
    r += 1
    for j in range(n):  # cost of batch led by j <= z
        for i in range(j, n):
            A[r, col[(i, j)]] = (model.a(s[i]) + model.h(s[j])) / norm
        A[r, z] = -1
        r += 1
    c = np.zeros(nv)
    c[z] = 1
    integrality = np.ones(nv)
    integrality[z] = 0
    ub = np.ones(nv)
    ub[z] = np.inf
    res = milp(
        c,
        constraints=LinearConstraint(A.tocsr(), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(nv), ub),
        options={"time_limit": time_limit, "mip_rel_gap": 1e-9},
    )
    if res.x is None:
        raise RuntimeError(f"MILP failed: {res.message}")
    x = res.x
    leaders = [j for j in range(n) if x[col[(j, j)]] > 0.5]
    rank_of = {j: k for k, j in enumerate(leaders)}
    sorted_dst = []
    for i in range(n):
        j = max(range(i + 1), key=lambda jj: x[col[(i, jj)]])
        sorted_dst.append(rank_of[j])
    dst = np.zeros(n, dtype=np.int64)
    for pos, i in enumerate(order):
        dst[i] = sorted_dst[pos]
    val = _exact_makespan_of(model, lengths, dst, d)
    return model.to_float(val), dst, bool(res.status == 0)
