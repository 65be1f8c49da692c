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

POLICIES = ("sum", "padded", "quadratic", "conv", "padded_quadratic")


class SearchLimitExceeded(RuntimeError):
    """The branch and bound hit ``node_limit`` before proving optimality.

    Raised by :func:`exact_makespan` / :func:`exact_assignment` with ``lower`` and ``upper``
    (floats) bracketing the optimum.
    """

    lower: float | None = None
    upper: float | None = None


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


def batch_cost(items, policy: str, alpha: float = 1.0, beta: float = 0.0) -> float:
    """Cost of one batch straight from the definitions, in float64 (for brute force / checks)."""
    items = [int(x) for x in items]
    if not items:
        return 0.0
    b, s, m = len(items), float(sum(items)), float(max(items))
    if policy == "sum":
        return s
    if policy == "padded":
        return b * m
    if policy == "quadratic":
        return alpha * s + beta * float(sum(x * x for x in items))
    if policy == "conv":
        return alpha * s + beta * b * m * m
    if policy == "padded_quadratic":
        return alpha * b * m + beta * b * m * m
    raise ValueError(policy)


def makespan_of(lengths, dst, num_ranks: int, policy: str, alpha: float = 1.0, beta: float = 0.0) -> float:
    """Largest batch cost of an assignment, in float64 (definitions, no scaling)."""
    per: list[list[int]] = [[] for _ in range(num_ranks)]
    for length, r in zip(lengths, dst):
        per[int(r)].append(int(length))
    return max((batch_cost(p, policy, alpha, beta) for p in per), default=0.0)


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


def _count_bound(as_: list[int], hs: list[int], b: int) -> int:
    """Items sorted by length descending: of the k largest, some batch holds c = ceil(k/b); its
    leader is at least the largest of them, so it costs at least the ``a`` of the c smallest of the
    k plus c times the ``h`` of the largest of those c (``h`` is 0 for additive policies)."""
    m = len(as_)
    pre = [0]
    for x in as_:
        pre.append(pre[-1] + x)
    lb = 0
    for k in range(1, m + 1):
        c = -(-k // b)
        v = pre[k] - pre[k - c] + c * hs[k - c]
        if v > lb:
            lb = v
    return lb


def _root_lower_bound(model: _Model, s: list[int], d: int) -> int:
    if not s:
        return 0
    ws = [model.w(l) for l in s]
    lb = -(-sum(ws) // d)
    lb = max(lb, _count_bound([model.a(l) for l in s], [model.h(l) for l in s], d))
    if not model.additive:
        lb = max(lb, _leader_bound([model.a(l) for l in s], [model.h(l) for l in s], d))
    return lb


class _ItemSearch:
    """Decision "every batch cost <= C?", item by item (each item to an open batch or a new one)."""

    def __init__(self, model: _Model, s: list[int], d: int, node_limit: int):
        self.model, self.s, self.d, self.n = model, s, d, len(s)
        self.node_limit = node_limit
        self.nodes = 0
        n = self.n
        self.a_of = [model.a(l) for l in s]
        self.w_of = [model.w(l) for l in s]
        self.h_of = [model.h(l) for l in s]
        self.suf_w = [0] * (n + 1)
        self.suf_a = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.suf_w[i] = self.suf_w[i + 1] + self.w_of[i]
            self.suf_a[i] = self.suf_a[i + 1] + self.a_of[i]
        # pad[q][i]: least padding sum_r count_r h(leader_r) of the items i.. in <= q contiguous
        # batches. The items i.. that join open batches pay at least h(s[i]) each, as in one more
        # batch led by s[i]; so with k open batches they need >= suf_a[i] + pad[d - k + 1][i].
        self.pad = None
        if not model.additive:
            inf = float("inf")
            pad = [[0] * (n + 1) for _ in range(d + 2)]
            for i in range(n):
                pad[0][i] = inf
            for q in range(1, d + 2):
                for i in range(n - 1, -1, -1):
                    hi = self.h_of[i]
                    pad[q][i] = min((j - i) * hi + pad[q - 1][j] for j in range(i + 1, n + 1))
            self.pad = pad
        # failed[state] = the largest C at which the subtree of `state` was proven infeasible
        # (infeasible at C implies infeasible at every C' < C)
        self.failed: dict = {}

    def decide(self, C: int):
        """An assignment (sorted order) with every batch cost <= C, or None if there is none."""
        n, d = self.n, self.d
        additive = self.model.additive
        a_of, w_of, h_of, suf_w, suf_a = self.a_of, self.w_of, self.h_of, self.suf_w, self.suf_a
        pad = self.pad
        a_last = a_of[-1]
        failed = self.failed
        loads = [0] * d
        lead = [-1] * d  # leader length of each open batch (ranks 0..k-1 are the open ones)
        hl = [0] * d  # h(leader)
        assign = [0] * n
        limit = self.node_limit

        def dfs(i: int, k: int) -> bool:
            if i == n:
                return True
            self.nodes += 1
            if self.nodes > limit:
                raise SearchLimitExceeded(f"branch and bound exceeded {limit} nodes")
            # capacity: the remaining items need >= need; a batch's slack counts only if the
            # smallest remaining item still fits into it
            usable = (d - k) * C
            min_h = None
            for r in range(k):
                slack = C - loads[r]
                if slack >= a_last + hl[r]:
                    usable += slack
                if min_h is None or hl[r] < min_h:
                    min_h = hl[r]
            need = suf_w[i]
            if not additive:
                alt = suf_a[i] + pad[d - k + 1 if k else d][i]
                if alt > need:
                    need = alt
                if k == d:
                    alt = suf_a[i] + (n - i) * min_h
                    if alt > need:
                        need = alt
            if need > usable:
                return False
            if additive:
                key = (i, tuple(sorted(loads[:k])))
            else:
                key = (i, tuple(sorted(zip(lead[:k], loads[:k]))))
            if failed.get(key, -1) >= C:
                return False
            ai = a_of[i]
            cands = []
            tried = set()
            perfect = None
            for r in range(k):
                v = loads[r] + ai + hl[r]
                if v > C:
                    continue
                sig = loads[r] if additive else (lead[r], loads[r])
                if sig in tried:
                    continue
                tried.add(sig)
                if additive and v == C:
                    # perfect fit: swapping item i with whatever else would fill this batch keeps
                    # any solution feasible, so this placement is never wrong
                    perfect = r
                    break
                cands.append((-loads[r], r))
            if perfect is not None:
                cands = [(0, perfect)]
            else:
                cands.sort()  # fullest batch first
                if k < d and w_of[i] <= C:
                    cands.append((0, k))
            for _, r in cands:
                assign[i] = r
                if r == k:
                    lead[r] = self.s[i]
                    hl[r] = h_of[i]
                    loads[r] = w_of[i]
                    ok = dfs(i + 1, k + 1)
                    lead[r] = -1
                    hl[r] = 0
                    loads[r] = 0
                else:
                    old = loads[r]
                    loads[r] = old + ai + hl[r]
                    ok = dfs(i + 1, k)
                    loads[r] = old
                if ok:
                    return True
            if len(failed) < 3_000_000:
                failed[key] = C
            return False

        return list(assign) if dfs(0, 0) else None


def _leader_bound(as_: list[int], hs: list[int], b: int) -> int:
    """Lower bound on the min-max cost of packing items (sorted by length descending, ``a`` and
    ``h`` values given) into <= b batches, for the leader-dependent policies.

    Three arguments, all using that over all partitions the least ``sum_r count_r * h(leader_r)``
    (and the least ``max_r`` of it) is attained by contiguous segments of the sorted order (give the
    batch with the largest leader the first c_1 items, and so on: counts stay, no leader grows):

    * average: ``(sum a + min sum_r count_r h(leader_r)) / b``;
    * padding alone: ``min max_r count_r h(leader_r)``;
    * split off the first item's batch, of size c: it costs at least ``a_0 + c h_0 + (the c-1
      smallest a)``; the other batches share at least ``sum a - a_0 - (the c-1 largest a)`` plus the
      padding of the m-c smallest items in <= b-1 batches (a subset's padding is at least that of
      the same number of smallest items). The bound is the least over c of the larger of the two.
    """
    m = len(hs)
    if m == 0:
        return 0
    inf = float("inf")
    total_a = sum(as_)
    if b == 1:
        return total_a + m * hs[0]
    # suffix DP: suf[q][i] = least padding sum of items i.. in <= q contiguous batches
    suf = [[0] * (m + 1) for _ in range(b + 1)]
    for i in range(m):
        suf[0][i] = inf
    for q in range(1, b + 1):
        row, prev = suf[q], suf[q - 1]
        for i in range(m - 1, -1, -1):
            best = inf
            hi = hs[i]
            for j in range(i + 1, m + 1):
                v = (j - i) * hi + prev[j]
                if v < best:
                    best = v
            row[i] = best
    # prefix DP for the min-max padding
    prev_max = [0] + [inf] * m
    for _ in range(b):
        cur = [0] + [inf] * m
        for j in range(1, m + 1):
            bm = prev_max[j]
            for i in range(j):
                seg = (j - i) * hs[i]
                v = prev_max[i] if prev_max[i] > seg else seg
                if v < bm:
                    bm = v
            cur[j] = bm
        prev_max = cur
    lb = max(-(-(total_a + suf[b][0]) // b), prev_max[m])
    # split bound
    others = as_[1:]  # descending
    big = [0]
    for x in others:
        big.append(big[-1] + x)
    small = [0]
    for x in reversed(others):
        small.append(small[-1] + x)
    split = inf
    for c in range(1, m + 1):
        f0 = as_[0] + c * hs[0] + small[c - 1]
        if f0 >= split:
            break  # f0 grows with c
        rest = total_a - as_[0] - big[c - 1] + suf[b - 1][c]
        g = -(-rest // (b - 1)) if rest > 0 else 0
        v = f0 if f0 > g else g
        if v < split:
            split = v
    return max(lb, split)


class _BinSearch:
    """Decision "every batch cost <= C?" by bin completion, reused across values of C.

    Batches are filled one at a time. A batch always takes the largest remaining item (its leader:
    ranks are identical, so some batch holds it) plus a subset of the others, and only *maximal*
    subsets are tried: if a remaining item still fits into the batch's budget, adding it is never
    worse (removing an item from another batch never raises that batch's cost). The subset must
    also leave a remainder that the other batches can hold (``sum w(rest) <= (batches - 1) * C``;
    for the leader-dependent policies also :func:`_leader_bound`). Tied lengths
    are interchangeable: a subset takes a prefix of each run of equal lengths, and states are
    remembered by the multiset of remaining lengths. The last two batches are split exactly by a
    subset-sum bitset (additive policies with small weights: a subset of the rest with weight in a
    window; "conv"/"padded"/"padded_quadratic", whose ``a(l)`` is ``A*l``: for each choice of the
    second leader, a (count, length sum) bitset).
    """

    def __init__(self, model: _Model, s: list[int], d: int, node_limit: int):
        self.model, self.s, self.d, self.n = model, s, d, len(s)
        self.node_limit = node_limit
        self.nodes = 0
        self.a_of = [model.a(l) for l in s]
        self.w_of = [model.w(l) for l in s]
        self.h_of = [model.h(l) for l in s]
        self.failed: dict = {}
        self.hbound: dict = {}
        # meet in the middle (numpy int64) for additive weights that are too large for a bitset
        self.mitm_ok = model.additive and sum(self.w_of) < 1 << 62
        if model.additive:
            if sum(self.w_of) <= 1 << 22:
                self.two_way = self._two_way_additive
            elif self.mitm_ok:
                self.two_way = self._two_way_mitm
            else:
                self.two_way = None
        else:
            # a(l) = A_lin * l
            self.a_lin = model.A if model.policy == "conv" else 0
            self.two_way = self._two_way_leader if sum(s) <= 1 << 22 else None

    def _tick(self, k: int = 1):
        self.nodes += k
        if self.nodes > self.node_limit:
            raise SearchLimitExceeded(f"branch and bound exceeded {self.node_limit} nodes")

    def _two_way_additive(self, R: list[int], C: int):
        """Two batches, additive integer weights. Returns the two batches or None."""
        w = self.w_of
        lead, rest = R[0], R[1:]
        total = sum(w[j] for j in R)
        lo = max(total - C - w[lead], 0)  # the leader's batch takes rest-weight in [lo, hi]
        hi = C - w[lead]
        if hi < lo:
            return None
        reach = [1]
        for j in rest:
            reach.append(reach[-1] | (reach[-1] << w[j]))
        window = (reach[-1] >> lo) & ((1 << (hi - lo + 1)) - 1)
        if not window:
            return None
        t = lo + (window & -window).bit_length() - 1  # a reachable sum in the window
        S = [lead]
        for k in range(len(rest), 0, -1):  # walk back: take item k-1 iff t is not reachable without it
            if not (reach[k - 1] >> t) & 1:
                S.append(rest[k - 1])
                t -= w[rest[k - 1]]
        inS = set(S)
        return S, [j for j in R if j not in inS]

    def _window_subsets(self, rest: list[int], key: list[int], lo, hi):
        """Subsets X of ``rest`` (lists of positions into it) with ``lo[|X|] <= sum key <= hi[|X|]``.

        ``key[q]`` is the key of ``rest[q]``; ``lo``/``hi`` are indexed by the subset size. Meet in
        the middle over runs of tied lengths: a subset takes a prefix of each run, so each multiset
        of lengths appears once. Produced lazily, larger first-half sums first.
        """
        s = self.s
        m = len(rest)
        runs = []  # (key, first position, count)
        p = 0
        while p < m:
            q = p
            while q < m and s[rest[q]] == s[rest[p]]:
                q += 1
            runs.append((key[p], p, q - p))
            p = q
        # split the runs so both halves enumerate about as many choices
        total_log = sum(np.log2(c + 1) for _, _, c in runs)
        acc, cut = 0.0, 0
        while cut < len(runs) and acc + np.log2(runs[cut][2] + 1) <= total_log / 2:
            acc += np.log2(runs[cut][2] + 1)
            cut += 1
        r1, r2 = runs[:cut], runs[cut:]

        def sums(rs):
            out = np.zeros(1, dtype=np.int64)
            cnt = np.zeros(1, dtype=np.int64)
            for wt, _, c in rs:
                out = np.concatenate([out + np.int64(k * wt) for k in range(c + 1)])
                cnt = np.concatenate([cnt + k for k in range(c + 1)])
            return out, cnt

        def decode(rs, idx):
            sizes = []
            size = 1
            for _, _, c in rs:
                sizes.append(size)
                size *= c + 1
            pos = []
            for (_, first, _c), sz in zip(reversed(rs), reversed(sizes)):
                k, idx = divmod(idx, sz)
                pos.extend(range(first, first + k))
            return pos

        (s1, c1), (s2, c2) = sums(r1), sums(r2)
        self._tick(1 + (s1.size + s2.size) // 64)
        lo = np.asarray(lo, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.int64)
        uniform = bool((lo == lo[0]).all() and (hi == hi[0]).all())
        if uniform:  # the window does not depend on the size: one sorted list
            groups2 = {None: np.argsort(s2, kind="stable")}
        else:
            o = np.lexsort((s2, c2))
            groups2 = {}
            for k2 in np.unique(c2).tolist():
                groups2[k2] = o[c2[o] == k2]
        found = []  # (first-half index, second-half sorted indices)
        for k2, idx2 in groups2.items():
            s2s = s2[idx2]
            if uniform:
                l1, h1 = lo[0] - s1, hi[0] - s1
            else:
                tot = c1 + k2
                l1, h1 = lo[tot] - s1, hi[tot] - s1
            left = np.searchsorted(s2s, l1, side="left")
            right = np.searchsorted(s2s, h1, side="right")
            hits = np.nonzero(right > left)[0]
            for i in hits.tolist():
                found.append((int(s1[i]), i, idx2[left[i] : right[i]]))
        found.sort(key=lambda t: -t[0])
        for _, i, idx in found:
            base = decode(r1, i)
            for k in idx[::-1].tolist():
                self._tick()
                yield sorted(base + decode(r2, int(k)))

    def _two_way_mitm(self, R: list[int], C: int):
        """Two batches, additive weights too large for a bitset: meet in the middle."""
        w = self.w_of
        lead, rest = R[0], R[1:]
        total = sum(w[j] for j in R)
        lo = max(total - C - w[lead], 0)
        hi = C - w[lead]
        if hi < lo:
            return None
        for X in self._window_subsets(rest, [w[j] for j in rest], [lo], [hi]):
            S = [lead] + [rest[q] for q in X]
            inS = set(S)
            return S, [j for j in R if j not in inS]
        return None

    def _two_way_leader(self, R: list[int], C: int):
        """Two batches, cost = A*sum + count*h(leader). Returns the two batches or None.

        The second batch's leader t is the largest item outside the first batch, so the first
        batch holds every item before t; the items after t split by a (count, sum) bitset.
        """
        s, h = self.s, self.h_of
        A = self.a_lin
        m = len(R)
        hL = h[R[0]]
        pre_len = [0]
        for j in R:
            pre_len.append(pre_len[-1] + s[j])
        if A * pre_len[m] + m * hL <= C:  # everything fits in the first batch
            return list(R), []
        # reach[c] after processing the suffix R[k:] (built backwards): sums of c-subsets
        reach = [1]  # suffix R[m:] is empty
        self._tick(m)
        for k in range(m - 1, 0, -1):  # k: position of t in R
            # reach is over R[k+1:]
            t = R[k]
            if k == 1 or s[t] != s[R[k - 1]]:  # with a tie, the earlier copy can lead instead
                r = m - k - 1
                sum_rest = pre_len[m] - pre_len[k + 1]
                cS0 = A * pre_len[k] + k * hL
                cT0 = A * s[t] + h[t]
                ht = h[t]
                for c in range(r + 1):
                    remS = C - cS0 - c * hL
                    remT = C - cT0 - (r - c) * ht
                    if remS < 0 or remT < 0:
                        continue
                    if A == 0:
                        lo, hi = 0, sum_rest
                    else:
                        hi = min(remS // A, sum_rest)
                        lo = max(sum_rest - remT // A, 0)
                    if lo > hi or c >= len(reach):
                        continue
                    window = (reach[c] >> lo) & ((1 << (hi - lo + 1)) - 1)
                    if window:
                        target = lo + (window & -window).bit_length() - 1
                        return self._split(R, k, c, target)
            # add R[k] to the suffix for the next (smaller) k
            l = s[R[k]]
            reach.append(0)
            for c in range(len(reach) - 1, 0, -1):
                reach[c] |= reach[c - 1] << l
        return None

    def _split(self, R, k, c, target):
        """Rebuild the split found by _two_way_leader: c items of R[k+1:] with length sum target."""
        s = self.s
        rest = R[k + 1 :]
        # layers[q][c] = c-subset sums of rest[q:]
        layers = [None] * (len(rest) + 1)
        cur = [1]
        layers[len(rest)] = list(cur)
        for q in range(len(rest) - 1, -1, -1):
            nxt = cur + [0]
            for cc in range(len(nxt) - 1, 0, -1):
                nxt[cc] |= cur[cc - 1] << s[rest[q]]
            cur = nxt
            layers[q] = list(cur)
        X = []
        for q in range(len(rest)):
            nxt = layers[q + 1]
            # take rest[q] iff (c, target) is not reachable without it
            if c < len(nxt) and (nxt[c] >> target) & 1:
                continue
            X.append(rest[q])
            c -= 1
            target -= s[rest[q]]
        assert c == 0 and target == 0
        inX = set(X)
        S = list(R[:k]) + X
        T = [R[k]] + [j for j in rest if j not in inX]
        return S, T

    def _hbound_fails(self, key, R, b, C) -> bool:
        got = self.hbound.get(key)
        if got is None:
            as_, hs = [self.a_of[j] for j in R], [self.h_of[j] for j in R]
            got = _count_bound(as_, hs, b)
            if not self.model.additive:
                got = max(got, _leader_bound(as_, hs, b))
            if len(self.hbound) < 1_000_000:
                self.hbound[key] = got
        return got > C

    def decide(self, C: int):
        """An assignment (sorted order) with every batch cost <= C, or None if there is none."""
        s, n, d = self.s, self.n, self.d
        a_of, w_of, h_of = self.a_of, self.w_of, self.h_of
        additive = self.model.additive
        failed = self.failed
        batches: list[list[int]] = []
        two_way = self.two_way

        def rec(R: list[int], b: int) -> bool:
            if not R:
                return True
            if b == 0:
                return False
            wsum = 0
            for j in R:
                wsum += w_of[j]
            if wsum > b * C:
                return False
            lead = R[0]
            hL = h_of[lead]
            if b == 1:
                cost = len(R) * hL
                for j in R:
                    cost += a_of[j]
                if cost <= C:
                    batches.append(list(R))
                    return True
                return False
            self._tick()
            key = (tuple(s[j] for j in R), b)
            if failed.get(key, -1) >= C:
                return False
            if self._hbound_fails(key, R, b, C):
                return False
            if b == 2 and two_way is not None:
                got = two_way(R, C)
                if got is not None:
                    batches.extend(got)
                    return True
                failed[key] = C
                return False
            need = wsum - (b - 1) * C  # the batch must take at least this much weight
            rest = R[1:]
            m = len(rest)
            if additive and self.mitm_ok and m >= 16:
                # the leader's batch: a maximal subset X of the rest with weight in
                # [need - w(lead), C - w(lead)], by meet in the middle
                wl = w_of[lead]
                key_x = [w_of[j] for j in rest]
                for X in self._window_subsets(rest, key_x, [max(need - wl, 0)], [C - wl]):
                    inX = set(X)
                    slack = C - wl - sum(w_of[rest[q]] for q in X)
                    # maximal: no skipped item still fits
                    if any(w_of[rest[q]] <= slack for q in range(m) if q not in inX):
                        continue
                    batches.append([lead] + [rest[q] for q in X])
                    if rec([rest[q] for q in range(m) if q not in inX], b - 1):
                        return True
                    batches.pop()
                if len(failed) < 2_000_000:
                    failed[key] = C
                return False
            inc = [a_of[j] + hL for j in rest]
            wr = [w_of[j] for j in rest]
            suf_w = [0] * (m + 1)
            suf_inc = [0] * (m + 1)
            for p in range(m - 1, -1, -1):
                suf_w[p] = suf_w[p + 1] + wr[p]
                suf_inc[p] = suf_inc[p + 1] + inc[p]
            # position in `rest` of the next different length
            nd = [m] * m
            for p in range(m - 2, -1, -1):
                nd[p] = nd[p + 1] if s[rest[p + 1]] == s[rest[p]] else p + 1
            chosen: list[int] = []
            start_cost = a_of[lead] + hL
            big = 1 << 200

            def gen(p: int, cost: int, ws: int, min_excl: int) -> bool:
                # min_excl: smallest increment among skipped items (maximality: must end > slack)
                self._tick()
                if ws + suf_w[p] < need:
                    return False
                if C - cost - suf_inc[p] >= min_excl:
                    return False  # even taking everything left, a skipped item would still fit
                if p == m:
                    if C - cost >= min_excl:
                        return False
                    S = [lead] + [rest[q] for q in chosen]
                    inS = set(chosen)
                    R2 = [rest[q] for q in range(m) if q not in inS]
                    batches.append(S)
                    if rec(R2, b - 1):
                        return True
                    batches.pop()
                    return False
                c2 = cost + inc[p]
                if c2 <= C:
                    chosen.append(p)
                    if gen(p + 1, c2, ws + wr[p], min_excl):
                        return True
                    chosen.pop()
                # skipping item p skips its run of ties (a prefix of each run is taken; if p does
                # not fit, neither do its ties)
                return gen(nd[p], cost, ws, min(min_excl, inc[p]))

            if gen(0, start_cost, w_of[lead], big):
                return True
            if len(failed) < 2_000_000:
                failed[key] = C
            return False

        if not rec(list(range(n)), d):
            return None
        dst = [0] * n
        for r, S in enumerate(batches):
            for j in S:
                dst[j] = r
        return dst


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
