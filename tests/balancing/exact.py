"""Exact optimum of post-balancing, independent of the compiled core.

    exact_makespan(lengths, num_ranks, policy, alpha=1.0, beta=0.0) -> float
    exact_assignment(lengths, num_ranks, policy, alpha=1.0, beta=0.0) -> np.ndarray (dst rank per item)
    solve(...) -> Solution (makespan, dst, proven lower bound, proven?, nodes)

The problem: put ``n`` items with integer lengths on ``d`` identical ranks, minimizing the largest
batch cost. Every policy's batch cost splits the same way. With the items of a batch sorted by
length descending, the first one (the *leader*) sets the batch maximum ``m`` and

    cost(batch) = sum_{i in batch} a(l_i) + count * h(m)

    policy             a(l)                 h(m)
    "sum"              l                    0
    "quadratic"        alpha*l + beta*l^2   0
    "padded"           0                    m
    "conv"             alpha*l              beta*m^2
    "padded_quadratic" 0                    alpha*m + beta*m^2

so an item of length ``l`` joining a batch led by length ``m >= l`` adds ``g(l, m) = a(l) + h(m)``,
and alone it costs ``w(l) = g(l, l)``. Every batch costs at least the sum of ``w`` over its items.
Policies with ``h == 0`` ("sum", "quadratic", "conv" with beta = 0) are *additive*.

Exactness: ``alpha`` and ``beta`` are replaced by the simplest fraction (denominator <= 1e9) that
rounds to the same float (1e-4 -> 1/10000; otherwise the float's exact binary value), all costs are
scaled by the common denominator to exact Python integers, and every comparison in the search is
exact. The returned makespan is that integer divided by the scale, rounded once. The compiled core
evaluates costs in float64, so the two agree to ~1e-15 relative, not bit for bit.

Methods (:func:`solve`, ``method="auto"``: the DP for "padded"/"padded_quadratic", else the B&B):

* **Contiguous DP** ("padded", "padded_quadratic": ``a == 0``, the cost depends only on count and
  max). Exchange argument: order batches by their maximum and give the first batch the c_1 largest
  items, the next the following c_2, and so on; counts are unchanged and no maximum grows (the
  items above m_j all sit in the batches before j). So an optimal partition is a set of <= d
  contiguous segments of the sorted order, found by an O(n^2 d) DP. Tests check it against brute
  force and the B&B.
* **Branch and bound** (every policy). Incumbent: the best of a greedy (each item, largest first,
  to the batch it raises least) and the best contiguous partition, each improved by move/swap local
  search. Root lower bound: the largest of ``ceil(sum w / d)``; the count bound (of the k largest
  items some rank holds ceil(k/d): the ``a`` of the ceil(k/d) smallest of them plus ceil(k/d)
  times the ``h`` of the largest of those); and for leader-dependent policies
  :func:`_leader_bound` (least total padding over d, least max padding, and a split-off-the-
  first-batch bound; least padding is attained by contiguous segments, as above). Then decision
  probes "every batch cost <= C": at the lower bound, at incumbent - 1, then bisection. A probe
  alternates two exact searches with node budgets growing 4x per round (each keeps its memo of
  refuted states, valid for every smaller C):

  - :class:`_BinSearch`, bin completion: fill batches one at a time; a batch takes the largest
    remaining item plus a *maximal* subset of the rest (adding an item that still fits is never
    worse: removing an item never raises a batch's cost), leaving a remainder the other batches can
    hold (sum w, count and leader bounds). Tied lengths: a subset takes a prefix of each run;
    states are keyed by the multiset of remaining lengths. Additive weights: subsets with weight in
    the window ``[sum - (b-1) C, C]`` come from a meet-in-the-middle (numpy) over tie runs when 16+
    items remain, and the last two batches are split by a subset-sum bitset (small weights) or the
    meet-in-the-middle. Leader-dependent policies: the last two batches are split exactly by
    choosing the second leader and a (count, length-sum) bitset. Finds near-perfect partitions fast.
  - :class:`_ItemSearch`: items largest first, each to an open batch (equal (leader, load) tried
    once) or one new batch; prunes by capacity (remaining ``sum a`` + least padding of the
    remaining suffix vs. usable slack). Refutes bounds decided by a few large items fast.

  ``node_limit`` caps the total work; :func:`solve` then returns the best assignment found with
  ``proven=False`` and the proven bracket ``[lower, makespan]`` (``exact_*`` raise
  :class:`SearchLimitExceeded`).
* **MILP** (:func:`milp_makespan`, scipy/HiGHS, cross-check only). Leader formulation: ``x[i, j]``
  = item i (sorted position) sits in the batch led by item j <= i; ``x[j, j]`` = j leads a batch;
  ``sum_j x[i, j] = 1``, ``x[i, j] <= x[j, j]``, ``sum_j x[j, j] <= d``,
  ``sum_i g(l_i, l_j) x[i, j] <= z``. Costs are divided by the largest single-item cost before the
  solve (objective ~1..n), and the returned assignment is re-costed exactly. HiGHS has misreported
  optimality on objectives near 1e8, so its objective is never trusted alone; it stops at its own
  MIP gap (seen 2e-7 relative above the B&B optimum), and it is slow (seconds to minutes at n ~ 20).

Limits, measured on one core of a shared 2-core machine (CPython 3.11) on the 1000 instances of
:mod:`tests.balancing.instances` (n 8..40, d 2..6, lengths <= 5000) with node_limit 2e6: "padded"
and "padded_quadratic" (DP) < 1 ms each; "sum" all proven, mean 10 ms, max 1.5 s; "quadratic" 999
proven, mean 0.08 s, max 10 s; "conv" 977 proven, mean 0.18 s, max 16 s. The unproven ones are
"conv" with beta/alpha 1e-4..1 and n >= 25 (the padding term breaks the partition structure the
bounds rely on, and the proof is exhaustive) and one 27-bit-weight "quadratic" instance
(multiway partitioning in its hard phase); their proven brackets are within 6% (most within 1%).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .exact_bins import _BinSearch
from .exact_search import SearchLimitExceeded, _count_bound, _ItemSearch, _leader_bound
from .reference import costs_of

POLICIES = ("sum", "padded", "quadratic", "conv", "padded_quadratic")


# ---------------------------------------------------------------------------- cost model


def _simple_fraction(x: float) -> Fraction:
    """The simplest fraction (denominator <= 1e9) that rounds to ``x``, else ``x`` exactly."""
    f = Fraction(x).limit_denominator(10**9)
    return f if float(f) == x else Fraction(x)


class _Model:
    """Integer-scaled cost model: g(l, m) = a(l) + h(m), all values exact ints (true cost * scale)."""

    def __init__(self, policy: str, alpha: float, beta: float):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if alpha < 0 or beta < 0:
            raise ValueError("alpha and beta must be >= 0")
        fa, fb = _simple_fraction(float(alpha)), _simple_fraction(float(beta))
        if policy in ("sum", "padded"):
            fa, fb = Fraction(1), Fraction(0)
        scale = math.lcm(fa.denominator, fb.denominator)
        self.policy = policy
        self.scale = scale
        self.A = int(fa * scale)
        self.B = int(fb * scale)
        # h == 0: the leader does not matter ("conv" with beta == 0 is "sum" scaled by alpha)
        self.additive = (
            policy in ("sum", "quadratic")
            or (policy == "conv" and self.B == 0)
            or (policy == "padded_quadratic" and self.A == 0 and self.B == 0)
        )

    def a(self, l: int) -> int:
        p = self.policy
        if p == "sum":
            return l
        if p == "quadratic":
            return self.A * l + self.B * l * l
        if p == "conv":
            return self.A * l
        return 0  # padded, padded_quadratic

    def h(self, m: int) -> int:
        p = self.policy
        if p == "padded":
            return m
        if p == "conv":
            return self.B * m * m
        if p == "padded_quadratic":
            return self.A * m + self.B * m * m
        return 0

    def w(self, l: int) -> int:
        return self.a(l) + self.h(l)

    def batch(self, items: list[int]) -> int:
        """Exact scaled cost of a batch given its lengths."""
        if not items:
            return 0
        return sum(self.a(l) for l in items) + len(items) * self.h(max(items))

    def to_float(self, v: int) -> float:
        return v / self.scale


def makespan_of(lengths, dst, num_ranks: int, policy: str, alpha: float = 1.0, beta: float = 0.0) -> float:
    """Largest batch cost of an assignment, in float64 (the definitions in ``reference.py``)."""
    return max(costs_of(lengths, dst, num_ranks, policy, alpha, beta), default=0.0)


def _exact_makespan_of(model: _Model, lengths: list[int], dst, d: int) -> int:
    per: list[list[int]] = [[] for _ in range(d)]
    for length, r in zip(lengths, dst):
        per[int(r)].append(length)
    return max((model.batch(p) for p in per), default=0)


def brute_force_makespan(
    lengths, num_ranks: int, policy: str, alpha: float = 1.0, beta: float = 0.0
) -> float:
    """Enumerate all d^n assignments (float64 costs). Only for tiny n."""
    lengths = [int(x) for x in lengths]
    if not lengths:
        return 0.0
    best = float("inf")
    for dst in itertools.product(range(num_ranks), repeat=len(lengths)):
        best = min(best, makespan_of(lengths, dst, num_ranks, policy, alpha, beta))
    return best


# ---------------------------------------------------------------------------- heuristics (incumbent)


def _greedy(model: _Model, s: list[int], d: int) -> list[int]:
    """Items in sorted (descending) order, each to the batch with the least resulting cost."""
    loads = [0] * d
    lead = [-1] * d
    out = []
    for l in s:
        best_r, best_v = 0, None
        for r in range(d):
            v = loads[r] + (model.w(l) if lead[r] < 0 else model.a(l) + model.h(lead[r]))
            if best_v is None or v < best_v:
                best_r, best_v = r, v
        if lead[best_r] < 0:
            lead[best_r] = l
        loads[best_r] = best_v
        out.append(best_r)
    return out


def _contiguous_dp(model: _Model, s: list[int], d: int) -> tuple[int, list[int]]:
    """Best partition of the sorted order into <= d contiguous segments under the true cost."""
    n = len(s)
    a_pre = [0]
    for l in s:
        a_pre.append(a_pre[-1] + model.a(l))

    def seg(i, j):  # cost of s[i:j], j > i; s[i] is the max
        return a_pre[j] - a_pre[i] + (j - i) * model.h(s[i])

    inf = None
    dp = [[inf] * (n + 1) for _ in range(d + 1)]
    arg = [[0] * (n + 1) for _ in range(d + 1)]
    dp[0][0] = 0
    for k in range(1, d + 1):
        dp[k][0] = 0
        for j in range(1, n + 1):
            best, bi = dp[k - 1][j], j  # fewer segments (empty batch)
            for i in range(j):
                if dp[k - 1][i] is None:
                    continue
                v = max(dp[k - 1][i], seg(i, j))
                if best is None or v < best:
                    best, bi = v, i
            dp[k][j], arg[k][j] = best, bi
    out = [0] * n
    j, k = n, d
    while j > 0:
        i = arg[k][j]
        for t in range(i, j):
            out[t] = k - 1
        j, k = i, k - 1
    return dp[d][n], out


def _local_search(model: _Model, s: list[int], d: int, dst: list[int], max_iters: int = 2000) -> list[int]:
    """Moves and swaps out of the most expensive batch while the largest of the two costs drops."""
    dst = list(dst)
    n = len(s)
    members = [[] for _ in range(d)]
    for i, r in enumerate(dst):
        members[r].append(i)

    def cost(items):
        return model.batch([s[i] for i in items])

    costs = [cost(m) for m in members]
    for _ in range(max_iters):
        top = max(range(d), key=lambda r: costs[r])
        cur = costs[top]
        best = None  # (new_max_of_pair, x, y_or_None, other)
        for b in range(d):
            if b == top:
                continue
            ma = members[top]
            mb = members[b]
            for x in ma:
                rest_a = [i for i in ma if i != x]
                ca = cost(rest_a)
                cb = cost(mb + [x])
                v = max(ca, cb)
                if v < cur and (best is None or v < best[0]):
                    best = (v, x, None, b)
                for y in mb:
                    if s[y] == s[x]:
                        continue
                    v = max(cost(rest_a + [y]), cost([i for i in mb if i != y] + [x]))
                    if v < cur and (best is None or v < best[0]):
                        best = (v, x, y, b)
        if best is None:
            break
        _, x, y, b = best
        members[top].remove(x)
        members[b].append(x)
        dst[x] = b
        if y is not None:
            members[b].remove(y)
            members[top].append(y)
            dst[y] = top
        costs[top], costs[b] = cost(members[top]), cost(members[b])
    assert len(dst) == n
    return dst


# ---------------------------------------------------------------------------- branch and bound


def _root_lower_bound(model: _Model, s: list[int], d: int) -> int:
    if not s:
        return 0
    ws = [model.w(l) for l in s]
    lb = -(-sum(ws) // d)
    lb = max(lb, _count_bound([model.a(l) for l in s], [model.h(l) for l in s], d))
    if not model.additive:
        lb = max(lb, _leader_bound([model.a(l) for l in s], [model.h(l) for l in s], d))
    return lb


def _bnb(
    model: _Model,
    s: list[int],
    d: int,
    incumbent: int,
    inc_dst: list[int],
    lb: int,
    node_limit: int,
    searcher: str = "portfolio",
):
    """Exact optimum on the sorted lengths ``s``: (scaled makespan, dst in sorted order, nodes).

    Probes the lower bound ``lb`` (often tight), then the incumbent minus one (often optimal),
    then bisects. Each probe is a decision search; by default a portfolio that alternates
    :class:`_BinSearch` (good at finding near-perfect partitions) and :class:`_ItemSearch` (good at
    refuting a bound when a few large items decide it) with node budgets growing 4x per round, each
    keeping its memo of refuted states between rounds.
    """

    hi, hi_dst = incumbent, list(inc_dst)
    lo = lb  # invariant: optimum in [lo, hi], hi achieved by hi_dst
    if not s or hi <= lo:
        return hi, hi_dst, 0
    if searcher == "bin":
        searches = [_BinSearch(model, s, d, node_limit)]
    elif searcher == "item":
        searches = [_ItemSearch(model, s, d, node_limit)]
    else:  # portfolio
        searches = [_BinSearch(model, s, d, node_limit), _ItemSearch(model, s, d, node_limit)]

    def nodes():
        return sum(x.nodes for x in searches)

    def decide(C):
        if len(searches) == 1:
            return searches[0].decide(C)
        budget = 20_000
        while True:
            for x in searches:
                left = node_limit - nodes()
                if left <= 0:
                    raise SearchLimitExceeded(f"branch and bound exceeded {node_limit} nodes")
                x.node_limit = x.nodes + min(budget, left)
                try:
                    return x.decide(C)
                except SearchLimitExceeded:
                    pass
            budget *= 4

    probes = 0
    while lo < hi:
        # the lower bound first (often tight), then just below the incumbent (often optimal)
        mid = lo if probes == 0 else hi - 1 if probes == 1 else lo + (hi - lo) // 2
        probes += 1
        try:
            got = decide(mid)
        except SearchLimitExceeded as e:
            e.bounds = (lo, hi, hi_dst, nodes())
            raise
        if got is None:
            lo = mid + 1
        else:
            hi, hi_dst = _exact_makespan_of(model, s, got, d), got
    return hi, hi_dst, nodes()


# ---------------------------------------------------------------------------- public API


def _prepare(lengths, num_ranks, policy, alpha, beta):
    lengths = [int(x) for x in np.asarray(lengths, dtype=np.int64).reshape(-1)]
    if any(l < 0 for l in lengths):
        raise ValueError("lengths must be >= 0")
    d = int(num_ranks)
    if d < 1:
        raise ValueError("num_ranks must be >= 1")
    model = _Model(policy, alpha, beta)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return lengths, d, model, order


@dataclass
class Solution:
    """Result of :func:`solve`. Costs are floats (exact scaled integers, rounded once)."""

    makespan: float  # of ``dst``: the optimum when ``proven``
    dst: np.ndarray  # int64 [n] destination rank per item
    lower: float  # proven lower bound on the optimum (== makespan when proven)
    proven: bool
    nodes: int  # search nodes used
    method: str  # "bnb", "dp" or "bound" (a heuristic met the lower bound)


def solve(
    lengths,
    num_ranks: int,
    policy: str = "sum",
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    node_limit: int = 5_000_000,
    method: str = "auto",
    hints=(),
    heuristics: bool = True,
) -> Solution:
    """Optimal assignment, or the best one found with a proven bracket if ``node_limit`` is hit.

    ``method``: ``"auto"`` (the contiguous DP for "padded"/"padded_quadratic", else B&B), ``"bnb"``
    or ``"dp"``. ``hints``: extra assignments (dst rank per item, e.g. another planner's plan) used
    only as incumbents: they are re-costed exactly and can only speed the search up.
    ``heuristics=False`` starts the B&B from the trivial incumbent (everything on one rank), so the
    search itself does all the work (tests).
    """
    lengths, d, model, order = _prepare(lengths, num_ranks, policy, alpha, beta)
    if method == "auto":
        method = "dp" if policy in ("padded", "padded_quadratic") else "bnb"
    n = len(lengths)
    if n == 0:
        return Solution(0.0, np.zeros(0, dtype=np.int64), 0.0, True, 0, method)
    s = [lengths[i] for i in order]
    # Items that add nothing anywhere (additive policies, weight 0) go to rank 0 and leave the search.
    keep = n
    if model.additive:
        while keep > 0 and model.a(s[keep - 1]) == 0:
            keep -= 1
    s_search = s[:keep]
    dd = min(d, max(keep, 1))  # more ranks than items never helps
    proven, nodes, lo = True, 0, None
    if keep == 0:
        sorted_dst, val, used = [0] * n, 0, "bound"
    elif method == "dp":
        if model.policy not in ("padded", "padded_quadratic"):
            raise ValueError("the contiguous DP is exact only for 'padded' and 'padded_quadratic'")
        val, sorted_dst = _contiguous_dp(model, s_search, dd)
        used = "dp"
    elif method == "bnb":
        lb = _root_lower_bound(model, s_search, dd)
        if heuristics:
            cands = [_greedy(model, s_search, dd), _contiguous_dp(model, s_search, dd)[1]]
        else:
            cands = [[0] * keep]
        for h in hints:
            h = np.asarray(h, dtype=np.int64).reshape(-1)
            if h.shape != (n,):
                raise ValueError("a hint must give one rank per item")
            ranks = [int(h[order[pos]]) for pos in range(keep)]
            relabel = {r: k for k, r in enumerate(sorted(set(ranks)))}
            cands.insert(0, [relabel[r] for r in ranks])
        best_v, best_dst = None, None
        for c in cands:
            if max(c) >= dd:
                continue
            v = _exact_makespan_of(model, s_search, c, dd)
            if v > lb and heuristics:
                c = _local_search(model, s_search, dd, c)
                v = _exact_makespan_of(model, s_search, c, dd)
            if best_v is None or v < best_v:
                best_v, best_dst = v, c
            if best_v <= lb:
                break
        used = "bound" if best_v <= lb else "bnb"
        try:
            val, sorted_dst, nodes = _bnb(model, s_search, dd, best_v, best_dst, lb, node_limit)
        except SearchLimitExceeded as e:
            lo, val, sorted_dst, nodes = e.bounds
            proven = False
    else:
        raise ValueError(f"method must be 'auto', 'bnb' or 'dp', got {method!r}")
    sorted_dst = list(sorted_dst) + [0] * (n - keep)
    dst = np.zeros(n, dtype=np.int64)
    for pos, i in enumerate(order):
        dst[i] = sorted_dst[pos]
    # the answer is re-costed from the assignment itself
    assert _exact_makespan_of(model, lengths, dst, d) == val
    lower = model.to_float(val if proven else lo)
    return Solution(model.to_float(val), dst, lower, proven, nodes, used)


def _solve_or_raise(lengths, num_ranks, policy, alpha, beta, node_limit, method):
    sol = solve(lengths, num_ranks, policy, alpha, beta, node_limit=node_limit, method=method)
    if not sol.proven:
        e = SearchLimitExceeded(
            f"branch and bound exceeded {node_limit} nodes; optimum in [{sol.lower!r}, {sol.makespan!r}]"
        )
        e.lower, e.upper = sol.lower, sol.makespan
        raise e
    return sol


def exact_assignment(
    lengths,
    num_ranks: int,
    policy: str = "sum",
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    node_limit: int = 5_000_000,
    method: str = "auto",
) -> np.ndarray:
    """An optimal destination rank per item (int64 ``[n]``).

    ``method``: ``"auto"``, ``"bnb"`` (every policy) or ``"dp"`` ("padded" and "padded_quadratic"
    only). Raises :class:`SearchLimitExceeded` if the B&B needs more than ``node_limit`` nodes.
    """
    return _solve_or_raise(lengths, num_ranks, policy, alpha, beta, node_limit, method).dst


def exact_makespan(
    lengths,
    num_ranks: int,
    policy: str = "sum",
    alpha: float = 1.0,
    beta: float = 0.0,
    *,
    node_limit: int = 5_000_000,
    method: str = "auto",
) -> float:
    """The proven optimal makespan (largest batch cost) as a float. See :func:`exact_assignment`."""
    return _solve_or_raise(lengths, num_ranks, policy, alpha, beta, node_limit, method).makespan
