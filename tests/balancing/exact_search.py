"""The decision searches of :mod:`tests.balancing.exact` ("every batch costs at most C"): item by
item (:class:`_ItemSearch`) and bin completion (:class:`_BinSearch`), with the count and leader
bounds they prune by. See the module docstring of ``exact`` for the methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .exact import _Model


class SearchLimitExceeded(RuntimeError):
    """The branch and bound hit ``node_limit`` before proving optimality.

    Raised by :func:`exact_makespan` / :func:`exact_assignment` with ``lower`` and ``upper``
    (floats) bracketing the optimum.
    """

    lower: float | None = None
    upper: float | None = None


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
