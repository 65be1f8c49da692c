"""Plain-Python versions of OrchMLLM's post-balancing algorithms 1, 2, 4 and 5, and cost functions.

Written independently of the compiled core, straight from the paper's pseudo-code, so the tests can
check "never worse than the paper" and recompute costs.
"""

from __future__ import annotations

import heapq


def batch_cost(lengths: list[int], policy: str, alpha: float = 1.0, beta: float = 0.0) -> float:
    if not lengths:
        return 0.0
    b, s, m = len(lengths), float(sum(lengths)), float(max(lengths))
    if policy == "sum":
        return s
    if policy == "padded":
        return b * m
    if policy == "quadratic":
        return alpha * s + beta * float(sum(x * x for x in lengths))
    if policy == "conv":
        return alpha * s + beta * b * m * m
    if policy == "padded_quadratic":
        return alpha * b * m + beta * b * m * m
    raise ValueError(policy)


def costs_of(lengths, dst, num_ranks, policy, alpha=1.0, beta=0.0) -> list[float]:
    per = [[] for _ in range(num_ranks)]
    for length, r in zip(lengths, dst):
        per[int(r)].append(int(length))
    return [batch_cost(p, policy, alpha, beta) for p in per]


def alg1(lengths, d):
    """Algorithm 1: sort descending, each to the batch with the least sum (ties: lowest batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, r) for r in range(d)]
    dst = [0] * len(lengths)
    for i in order:
        load, r = heapq.heappop(heap)
        dst[i] = r
        heapq.heappush(heap, (load + lengths[i], r))
    return dst


def alg2(lengths, d):
    """Algorithm 2: ascending greedy groups under a bound, binary search on the bound."""
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (lengths[i], i))

    def groups(bound):
        out, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * lengths[i] > bound:
                out.append(cur)
                cur = []
            cur.append(i)
        out.append(cur)
        return out

    # The paper starts the search at smallest * (n/d + 1), which can be infeasible; the largest
    # length makes it a valid upper bound (this only makes the reference stronger).
    left, right = lengths[order[0]], lengths[order[-1]] * (n // d + 1)
    while left < right:
        mid = (left + right) // 2
        if len(groups(mid)) <= d:
            right = mid
        else:
            left = mid + 1
    g = groups(left)
    dst = [0] * n
    for k, grp in enumerate(g):
        for i in grp:
            dst[i] = min(k, d - 1)
    return dst


def alg4(lengths, d, tolerance):
    """Algorithm 4: like algorithm 1, but batches whose sums differ by less than `tolerance` are
    compared by their sums of squares. The comparator is not transitive, so "top" is taken as the
    first batch that no later batch beats in a left-to-right scan."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    sums, sq = [0] * d, [0] * d
    dst = [0] * len(lengths)

    def less(a, b):
        if abs(sums[a] - sums[b]) < tolerance:
            return sq[a] < sq[b]
        return sums[a] < sums[b]

    for i in order:
        best = 0
        for r in range(1, d):
            if less(r, best):
                best = r
        dst[i] = best
        sums[best] += lengths[i]
        sq[best] += lengths[i] ** 2
    return dst


def alg5(lengths, d):
    """Algorithm 5: long sequences grouped under the algorithm-1 sum bound, the rest by LPT."""
    n = len(lengths)
    if n == 0:
        return []
    bound = max(costs_of(lengths, alg1(lengths, d), d, "sum"))
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    dst = [0] * n
    groups = [[]]
    pos = 0
    while pos < n:
        i = order[pos]
        if (len(groups[-1]) + 1) * lengths[i] > bound:
            if len(groups) >= d:
                break
            groups.append([])
        groups[-1].append(i)
        dst[i] = len(groups) - 1
        pos += 1
    heap = [(sum(lengths[i] for i in (groups[r] if r < len(groups) else [])), r) for r in range(d)]
    heapq.heapify(heap)
    for i in order[pos:]:
        load, r = heapq.heappop(heap)
        dst[i] = r
        heapq.heappush(heap, (load + lengths[i], r))
    return dst
