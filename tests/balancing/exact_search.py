"""The decision searches of :mod:`tests.balancing.exact` ("every batch costs at most C"): item by
item (:class:`_ItemSearch`) and bin completion (:class:`_BinSearch`), with the count and leader
bounds they prune by. See the module docstring of ``exact`` for the methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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
