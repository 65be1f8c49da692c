"""Bin completion for :mod:`tests.balancing.exact`: the decision "every batch costs at most C",
deciding batches one at a time (see that module's docstring); :class:`_ItemSearch` in
``exact_search`` decides it item by item."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .exact_search import SearchLimitExceeded, _count_bound, _leader_bound

if TYPE_CHECKING:
    from .exact import _Model


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
