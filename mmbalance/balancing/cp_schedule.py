"""Dynamic context-parallel groups of any degree (DHP section 4.3, and better).

A micro-batch of sequences is split over ``num_ranks`` ranks (a rank is one model replica, TP x PP
GPUs) into CP groups of any integer degree; each group runs ring attention over its packed
sequences. The makespan (slowest group) is minimized under the memory limit of every rank.

The paper packs sequences into memory-full atomic groups (best-fit decreasing) and gives them
degrees by a 2-D DP. We keep that as one candidate and add one per static uniform degree and
"mixed" ones (the sequences slower than a target time alone on the fewest ranks that bring them
under it, the target searched between the best makespan and the lower bound), give each candidate
its optimal degrees (an exact threshold search with the DP's optimum), regroup the best starts for
the degrees found, and return the best: never worse than the paper or than the best static
uniform CP degree under the same cost model. Large plans (``len(lengths) * num_ranks >= 2**18``,
with a ``CostModel``) run their independent parts two at a time on two threads, with the same
result. See ``csrc/dhp.cpp``.

The cost is a :class:`CostModel`, per-sequence times from a vectorized callable (one call per
degree; the search then runs in the compiled core too), or a per-group callable (the slow path).

>>> cost = CostModel(linear=1.0, attention=1e-4, ring=0.5)
>>> sched = cp_schedule([9000, 500, 400, 300, 200], num_ranks=6, memory_per_rank=4096, cost=cost)
>>> [(g.degree, g.ranks, g.sequences.tolist()) for g in sched]
[(5, (0, 1, 2, 3, 4), [0]), (1, (5,), [1, 2, 3, 4])]
>>> sched.makespan, sched.info["static_makespan"], round(sched.info["paper_makespan"])
(5400.0, 6000.0, 6067)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._core_api import core
from .cost_model import CostModel
from .validate import as_count, as_lengths, as_nonnegative, as_num_ranks

DEFAULT_COST = CostModel.transformer()
# A callable cost is evaluated per degree: num_ranks is bounded for it, and so are the n * num_ranks
# entries of its tables (per-sequence times, or static groupings).
MAX_CALLABLE_RANKS = 4096
MAX_TABLE = 1 << 23


@dataclass(frozen=True, eq=False)
class CPGroup:
    """One context-parallel group.

    Attributes:
        degree: number of ranks in the ring (any integer >= 1).
        ranks: the rank ids, ascending; contiguous, and inside one node when it fits one.
        sequences: int64 indices into ``lengths`` of the sequences the group runs, ascending.
        time: estimated seconds of the group under the cost model.
    """

    degree: int
    ranks: tuple[int, ...]
    sequences: np.ndarray
    time: float

    def __repr__(self) -> str:
        return f"CPGroup(degree={self.degree}, ranks={self.ranks}, sequences={self.sequences.tolist()}, time={self.time:.4g})"


class CPSchedule(list):
    """The groups of one micro-batch (a ``list`` of :class:`CPGroup`, largest degree first).

    Attributes:
        makespan: the slowest group's estimated time.
        num_ranks: ranks available; ``sum(g.degree) <= num_ranks`` (spare ranks stay idle).
        info: ``method`` (the winning candidate), ``static_makespan`` / ``static_degree`` (best
            static uniform degree under the same cost), ``paper_makespan`` (best-fit decreasing +
            the DP), ``lower_bound`` (no schedule is faster; ``0`` with a per-group callable);
            ``-1`` where infeasible.
    """

    def __init__(self, groups, makespan: float, num_ranks: int, info: dict):
        super().__init__(groups)
        self.makespan = float(makespan)
        self.num_ranks = int(num_ranks)
        self.info = info

    def group_of(self, n: int) -> np.ndarray:
        """Group index of each of the ``n`` sequences (int64 ``[n]``)."""
        out = np.full(n, -1, dtype=np.int64)
        for k, g in enumerate(self):
            out[g.sequences] = k
        return out


def _check(lengths, num_ranks, memory_per_rank):
    lengths = as_lengths(lengths)
    num_ranks = as_num_ranks(num_ranks)
    mem = as_count(memory_per_rank, "memory_per_rank")
    cap = num_ranks * mem
    if lengths.size:
        big = int(np.argmax(lengths))
        if lengths[big] > cap:
            raise ValueError(
                f"lengths[{big}] = {int(lengths[big])} exceeds the memory of all ranks together "
                f"(num_ranks * memory_per_rank = {cap} tokens)"
            )
        total = int(lengths.sum())
        if total > cap:
            raise ValueError(
                f"lengths need {total} tokens of memory but num_ranks * memory_per_rank = {cap}: "
                "split the micro-batch"
            )
    return lengths, num_ranks, mem


def _cost_of(cost):
    if cost is None:
        return DEFAULT_COST
    if isinstance(cost, CostModel):
        if cost.padded:
            raise ValueError("cost: a padded CostModel does not describe packed CP groups")
        return cost
    if callable(cost):
        return cost
    raise TypeError(
        f"cost must be a CostModel, a callable cost(lengths, degree) or None, got {type(cost).__name__}"
    )


def _build(
    lengths, group_of, degree, num_ranks, ranks_per_node, times, info, layout=None, members=None
) -> CPSchedule:
    if layout is None:
        layout = core().layout_ranks(np.asarray(degree, dtype=np.int64), num_ranks, ranks_per_node)
    offset, ranks = layout
    if members is None:  # every group's sequences, ascending, one group after another
        order = np.argsort(group_of, kind="stable").astype(np.int64, copy=False)
        bounds = np.concatenate([[0], np.cumsum(np.bincount(group_of, minlength=len(degree)))]).tolist()
    else:
        order, bounds = members[0], np.asarray(members[1]).tolist()
    # Python lists once, then one slice per group (hundreds of groups at scale; np.split is slower)
    rank_list, off = np.asarray(ranks).tolist(), np.asarray(offset).tolist()
    starts, ends = bounds[:-1], bounds[1:]
    groups = [
        CPGroup(
            degree=d,
            ranks=tuple(rank_list[off[k] : off[k + 1]]),
            sequences=order[starts[k] : ends[k]],
            time=t,
        )
        for k, (d, t) in enumerate(
            zip(np.asarray(degree).tolist(), np.asarray(times, dtype=np.float64).tolist())
        )
    ]
    return CPSchedule(groups, max(times, default=0.0), num_ranks, info)


def cp_schedule(
    lengths,
    num_ranks: int,
    memory_per_rank: int,
    cost: CostModel | Callable[[np.ndarray, int], float | np.ndarray] | None = None,
    *,
    ranks_per_node: int | None = None,
    max_rounds: int = 3,
    vectorized: bool | None = None,
    encoder_seconds=None,
) -> CPSchedule:
    """Dynamic CP groups for one micro-batch: every sequence in one group, minimal makespan.

    Args:
        lengths: ``[n]`` non-negative token counts of the sequences.
        num_ranks: ranks (model replicas) available; the degrees sum to at most this.
        memory_per_rank: tokens one rank holds; a group of degree ``d`` holds at most
            ``d * memory_per_rank`` tokens (:meth:`CostModel.tokens_per_rank` converts bytes).
        cost: a :class:`CostModel`, a callable ``cost(lengths: np.ndarray, degree: int)`` (see
            ``vectorized``), or ``None`` for :meth:`CostModel.transformer`. With a ``CostModel``
            everything runs in the compiled core.
        ranks_per_node: lay groups out inside nodes of this many ranks where they fit.
        max_rounds: regrouping rounds per candidate (0: no regrouping).
        vectorized: how a callable ``cost`` reads, given int64 ``lengths`` (read-only) and an int
            ``degree``:

            - ``True``: per-sequence times, a float array of ``lengths``' shape: each sequence's
              seconds alone on ``degree`` ranks; a group's time is the sum over its sequences
              (packed sequences run one after another, so no per-group constant). The callable is
              called once per degree ``1..num_ranks`` with all the sequences, and the whole
              search runs in the compiled core on those times.
            - ``False``: the time of one group, a number: ``lengths`` are the group's sequences.
              The callable is probed on a few groups and fitted to the built-in form to search
              groupings; degrees and the makespan then use the callable itself, tabulated on
              the degrees 1..64 and about 10% apart beyond (at most 108 per group and candidate
              grouping), plus one call per group of every static degree.
            - ``None`` (default): decided by the first call, ``cost(lengths, 1)`` with all the
              sequences: a 1-D array means ``True``, a number ``False``.

            A callable needs ``num_ranks <= 4096`` and ``n * num_ranks <= 2**23``; beyond, fit a
            ``CostModel`` to it (:meth:`CostModel.fit`).
        encoder_seconds: ``[n]`` seconds >= 0 per sequence that its group's members share evenly
            (a vision-language group encoding its sequences' media before the LLM phase), or
            ``None``. A group of degree ``d`` then takes ``cost``'s time plus the sum of its
            sequences' ``encoder_seconds`` over ``d``: exactly the group's time, with any cost
            (:meth:`CostModel.with_encoder` folds the share into a per-sequence cost instead, which
            counts ``fixed`` and the ring's overlap per sequence). The lower bound, the static
            degrees and ``makespan`` include the share.

    Returns:
        A :class:`CPSchedule` (a list of :class:`CPGroup`, degree descending). Deterministic.
        Never slower than the best static uniform degree (``info["static_makespan"]``) nor the
        paper's schedule (``info["paper_makespan"]``) under the same cost. A static degree ``c``
        is ``num_ranks // c`` groups of ``c`` ranks, sequences longest first to the group that
        stays fastest (with a per-group callable, fastest under the fitted form, timed by the
        callable). Every degree is compared while ``n * num_ranks <= 2**20``; above that the
        degrees that give each sequence its own group and, of the others, the largest degree of
        every group count (geometrically spread, about ``2**20 / n`` of them, when those are more).
        When that sweep would fill more than ``2**16`` sequences, degrees are filled in ascending
        order of a lower bound on their makespan (their longest sequence alone; all the work over
        their groups), and those whose bound is not below the best static makespan found are left
        out: they cannot beat it.

    Raises:
        ValueError: a sequence exceeds the memory of all ranks together, the sequences do not fit
            in ``num_ranks * memory_per_rank``, a callable gives a time that is not finite and
            >= 0 or an array of the wrong shape, a callable with too many ranks, or an invalid
            argument (named in the message).
        TypeError: an argument of the wrong type, or a callable that returns no numbers.

    Example:
        >>> sched = cp_schedule([30000, 1000, 1000], 4, memory_per_rank=16384)  # default 8B model
        >>> [(g.degree, g.sequences.tolist()) for g in sched], round(sched.makespan, 3)
        ([(4, [0, 1, 2])], 1.281)
        >>> per_seq = lambda ls, d: 1e-3 * ls / d + 2.0 * (d - 1)  # vectorized: a time per sequence
        >>> sched = cp_schedule([30000, 1000, 1000], 4, 16384, per_seq)
        >>> [(g.degree, g.sequences.tolist()) for g in sched], sched.makespan
        ([(3, [0]), (1, [1, 2])], 14.0)
    """
    lengths, num_ranks, mem = _check(lengths, num_ranks, memory_per_rank)
    cost = _cost_of(cost)
    enc = _encoder_seconds(encoder_seconds, lengths.size)
    rpn = 0 if ranks_per_node is None else as_count(ranks_per_node, "ranks_per_node")
    if rpn and num_ranks % rpn:
        raise ValueError(f"ranks_per_node ({rpn}) must divide num_ranks ({num_ranks})")
    rounds = as_count(max_rounds, "max_rounds", minimum=0)
    if vectorized is not None and not isinstance(vectorized, bool):
        raise TypeError(f"vectorized must be True, False or None, got {type(vectorized).__name__}")
    if isinstance(cost, CostModel):
        if vectorized is not None:
            raise ValueError("vectorized applies to a callable cost, not a CostModel")
        r = core().cp_schedule(
            lengths,
            num_ranks,
            mem,
            cost.linear,
            cost.attention * (1.0 + cost.eta),
            cost.ring,
            cost.ring_latency,
            cost.fixed,
            cost.overlap,
            rpn,
            rounds,
            enc,
        )
        return _from_core(lengths, num_ranks, mem, rpn, r)
    if lengths.size == 0:  # as the compiled path reports it; the callable is not called
        info = {"method": "empty", "static_makespan": 0.0, "static_degree": 0, "paper_makespan": 0.0}
        return CPSchedule([], 0.0, num_ranks, {**info, "lower_bound": 0.0})
    if num_ranks > MAX_CALLABLE_RANKS:
        raise ValueError(
            f"num_ranks = {num_ranks}: a callable cost is evaluated on every degree up to num_ranks, "
            f"at most {MAX_CALLABLE_RANKS}; fit a CostModel to it (CostModel.fit) for more ranks"
        )
    if lengths.size * num_ranks > MAX_TABLE:
        raise ValueError(
            f"lengths: a callable cost is evaluated for every sequence on every degree, "
            f"len(lengths) * num_ranks = {lengths.size} * {num_ranks} is more than {MAX_TABLE}; "
            "fit a CostModel to it (CostModel.fit) or split the micro-batch"
        )
    view = lengths.view()
    view.flags.writeable = False
    first = None
    if vectorized is not False:
        first = cost(view, 1)
        if vectorized is None:
            try:
                vectorized = np.ndim(first) == 1
            except (TypeError, ValueError):  # not array-like: reported as a bad time below
                vectorized = False
    if vectorized:
        return _schedule_vectorized(lengths, view, num_ranks, mem, cost, first, rpn, rounds, enc)
    if first is not None:
        _as_time(first, 1)  # the probe is checked like any other call
    return _schedule_callable(lengths, num_ranks, mem, cost, rpn, rounds, enc)


def _encoder_seconds(encoder_seconds, n: int) -> np.ndarray | None:
    """``cp_schedule``'s ``encoder_seconds`` as float64 ``[n]``, checked (``None`` stays)."""
    if encoder_seconds is None:
        return None
    return np.add(as_nonnegative(encoder_seconds, "encoder_seconds", size=n), 0.0)  # -0.0 as 0.0


def _from_core(lengths, num_ranks, mem, rpn, r) -> CPSchedule:
    if lengths.size and r["degree"].size == 0:
        raise ValueError(
            f"lengths do not fit in {num_ranks} ranks of memory_per_rank = {mem} tokens as CP groups: "
            "split the micro-batch"
        )
    info = {k: r[k] for k in ("method", "static_makespan", "static_degree", "paper_makespan", "lower_bound")}
    layout = (r["rank_offset"], r["ranks"])
    members = (r["members"], r["member_offset"])
    return _build(lengths, r["group_of"], r["degree"], num_ranks, rpn, r["time"], info, layout, members)


def _per_sequence(t, n: int, d: int) -> np.ndarray:
    """One degree's row of a vectorized cost: float64 ``[n]`` (values checked with the table)."""
    kind = getattr(getattr(t, "dtype", None), "kind", None)
    try:
        row = np.asarray(t, dtype=np.float64) if kind in (None, "i", "u", "f") else None
    except (TypeError, ValueError):
        row = None
    if row is None:
        raise TypeError(
            f"cost(lengths, {d}) must return real numbers (vectorized: one per sequence), got {type(t).__name__}"
            + (f" of dtype {t.dtype}" if kind else "")
        )
    if row.shape != (n,):
        raise ValueError(
            f"cost(lengths, {d}) returned shape {row.shape}: a vectorized cost gives one time per "
            f"sequence, shape ({n},)"
        )
    return row


def _schedule_vectorized(lengths, view, num_ranks, mem, cost, first, rpn, rounds, enc=None) -> CPSchedule:
    n = lengths.size
    rows = [_per_sequence(cost(view, 1) if first is None else first, n, 1)]
    rows += [_per_sequence(cost(view, d), n, d) for d in range(2, num_ranks + 1)]
    table = np.stack(rows)  # [degree - 1, sequence]
    bad = ~(np.isfinite(table) & (table >= 0))
    if bad.any():
        d, i = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"cost(lengths, {d + 1}) must return finite times >= 0, got {table[d, i]!r} "
            f"for lengths[{i}] = {int(lengths[i])}"
        )
    # [sequence, degree - 1] for the core, -0.0 as 0.0 (it orders times by their bits)
    table = np.add(table.T, 0.0, out=np.empty((n, num_ranks)))
    if enc is not None:  # per sequence, so it adds up exactly
        table += enc[:, None] / np.arange(1, num_ranks + 1, dtype=np.float64)[None, :]
    r = core().cp_schedule_table(lengths, table, num_ranks, mem, rpn, rounds)
    return _from_core(lengths, num_ranks, mem, rpn, r)


def _as_time(t, d: int) -> float:
    if isinstance(t, np.ndarray) and t.ndim == 0 and t.dtype.kind in "iuf":
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(
            f"cost(lengths, {d}) must return a number (the group's time) or, vectorized, an array "
            f"of one time per sequence; got {type(t).__name__}"
        )
    if not np.isfinite(float(t)) or t < 0:
        raise ValueError(f"cost(lengths, {d}) must return a finite number >= 0, got {t!r}")
    return float(t)


class _GroupTimes:
    """A per-group callable's times; each (group, degree) is asked once."""

    def __init__(self, cost, lengths: np.ndarray, enc: np.ndarray | None = None):
        self.cost, self.lengths, self.enc = cost, lengths, enc
        self.cache: dict[tuple[bytes, int], float] = {}

    def __call__(self, members: np.ndarray, d: int) -> float:
        key = (members.tobytes(), d)
        t = self.cache.get(key)
        if t is None:
            group = self.lengths[members]
            group.flags.writeable = False
            t = _as_time(self.cost(group, d), d)
            if self.enc is not None:
                t += float(self.enc[members].sum()) / d
            self.cache[key] = t
        return t


def _members(group_of: np.ndarray, g: int) -> list[np.ndarray]:
    order = np.argsort(group_of, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group_of, minlength=g))])
    return [order[bounds[k] : bounds[k + 1]] for k in range(g)]


def _degree_grid(num_ranks: int) -> np.ndarray:
    """Degrees a per-group callable is tabulated on: 1..64, then about 10% apart, and num_ranks."""
    d = set(range(1, min(num_ranks, 64) + 1))
    x = 64.0
    while x < num_ranks:
        x *= 1.1
        d.add(min(int(round(x)), num_ranks))
    d.add(num_ranks)
    return np.array(sorted(d), dtype=np.int64)


def _degrees_for(lengths, group_of, num_ranks, mem, cost, paper=False, timer=None, grid=None):
    """Optimal (or the paper's DP) degrees of a fixed grouping under a cost.

    A callable is tabulated at the degrees of ``grid`` (all when ``None``) and each group's
    minimum degree; other degrees are not considered.
    """
    g = int(group_of.max()) + 1
    members = _members(group_of, g)
    tokens = np.array([lengths[m].sum() for m in members], dtype=np.int64)
    dmin = np.maximum(1, -(-tokens // mem)).astype(np.int64)
    total = int(dmin.sum())
    if total > num_ranks:
        return None, np.inf, None
    table = np.full((g, num_ranks + 1), np.inf)
    hi = num_ranks - (total - dmin)
    if isinstance(cost, CostModel):  # vectorized, same formula
        x = lengths.astype(np.float64)
        s1 = np.bincount(group_of, weights=x, minlength=g)
        s2 = np.bincount(group_of, weights=x * x, minlength=g)
        d = np.arange(num_ranks + 1, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            full = cost.predict(s1[:, None], s2[:, None], np.maximum(d, 1.0)[None, :])
        valid = (d[None, :] >= dmin[:, None]) & (d[None, :] <= hi[:, None])
        table[valid] = full[valid]
    else:
        timer = timer or _GroupTimes(cost, lengths)
        for k in range(g):
            lo, up = int(dmin[k]), int(hi[k])
            ds = range(lo, up + 1) if grid is None else [lo, *grid[(grid > lo) & (grid <= up)].tolist()]
            for d in ds:
                table[k, d] = timer(members[k], d)
    fn = core().paper_dp_degrees if paper else core().optimal_degrees
    degree, makespan = fn(table, dmin, num_ranks)
    if degree.size == 0:
        return None, np.inf, None
    return degree, makespan, table[np.arange(g), degree]


def _probe_fit(cost, lengths: np.ndarray, num_ranks: int, mem: int) -> CostModel:
    """The built-in form fitted to a callable on single sequences over the batch's range."""
    hi = max(int(lengths.max(initial=1)), 2)
    sizes = np.unique(np.geomspace(max(1, hi // 64), hi, 8).astype(np.int64))
    meas = []
    for n in sizes:
        for d in sorted({1, 2, min(num_ranks, 4), min(num_ranks, 8)}):
            if -(-int(n) // mem) <= d:
                meas.append(([int(n)], d, max(_call(cost, np.array([n], dtype=np.int64), d), 1e-30)))
    meas.append(([int(sizes[0])] * 4, 1, max(_call(cost, np.full(4, sizes[0], dtype=np.int64), 1), 1e-30)))
    try:
        return CostModel.fit(meas)
    except ValueError:
        return DEFAULT_COST


def _call(cost, lengths: np.ndarray, d: int) -> float:
    lengths.flags.writeable = False
    return _as_time(cost(lengths, d), d)


def _schedule_callable(lengths, num_ranks, mem, cost, rpn, rounds, enc=None) -> CPSchedule:
    """A per-group callable: candidate groupings from the fitted form, times from the callable
    (plus the groups' ``enc`` share)."""
    n = lengths.size
    timer = _GroupTimes(cost, lengths, enc)
    grid = _degree_grid(num_ranks)
    paper_groups, _ = core().bfd_groups(lengths, mem)
    proxy = _probe_fit(cost, lengths, num_ranks, mem)
    form = (proxy.linear, proxy.attention, proxy.ring, proxy.ring_latency, proxy.fixed, True)
    r = core().cp_schedule(lengths, num_ranks, mem, *form, 0, rounds, enc)
    # static uniform degrees: the fitted form's greedy groupings, timed by the callable
    statics, _ = core().cp_static_groups(lengths, num_ranks, mem, *form, np.arange(1, num_ranks + 1), enc)
    static = None
    for c, grouping in enumerate(statics, start=1):
        if grouping[0] < 0:
            continue
        _, grouping = np.unique(grouping, return_inverse=True)
        times = np.array([timer(m, c) for m in _members(grouping, int(grouping.max()) + 1)])
        if static is None or times.max() < static[0]:
            static = (float(times.max()), c, grouping, times)
    best = None
    if static is not None:
        ms, c, grouping, times = static
        best = (ms, "static", grouping, np.full(times.size, c, dtype=np.int64), times)
    paper_ms = -1.0
    candidates = [("paper", paper_groups), ("proxy", r["group_of"])]
    if static is not None:
        candidates.append(("static+dp", static[2]))
    for method, grouping in candidates:
        if grouping.size != n:
            continue
        degree, ms, times = _degrees_for(lengths, grouping, num_ranks, mem, cost, timer=timer, grid=grid)
        if degree is None:
            continue
        if method == "paper":
            paper_ms = float(ms)
        if best is None or ms < best[0]:
            best = (ms, method, grouping, degree, times)
    if best is None:
        raise ValueError(
            f"lengths do not fit in {num_ranks} ranks of memory_per_rank = {mem} tokens as CP groups: "
            "split the micro-batch"
        )
    ms, method, grouping, degree, times = best
    order = np.argsort(-degree, kind="stable")  # degree descending, as the compiled path
    remap = np.empty_like(order)
    remap[order] = np.arange(order.size)
    info = {
        "method": method,
        "static_makespan": -1.0 if static is None else static[0],
        "static_degree": 0 if static is None else static[1],
        "paper_makespan": paper_ms,
        "lower_bound": 0.0,
    }
    return _build(lengths, remap[grouping], degree[order], num_ranks, rpn, times[order], info)


def paper_cp_schedule(lengths, num_ranks: int, memory_per_rank: int, cost=None) -> CPSchedule:
    """DHP section 4.3 as written: best-fit-decreasing atomic groups, then algorithm 1 (all ranks).

    For comparisons; :func:`cp_schedule` is never worse.
    """
    lengths, num_ranks, mem = _check(lengths, num_ranks, memory_per_rank)
    cost = _cost_of(cost)
    if lengths.size == 0:
        return CPSchedule([], 0.0, num_ranks, {"method": "paper"})
    group_of, _ = core().bfd_groups(lengths, mem)
    degree, ms, times = _degrees_for(lengths, group_of, num_ranks, mem, cost, paper=True)
    if degree is None:
        raise ValueError(f"the best-fit-decreasing groups need more than num_ranks = {num_ranks} ranks")
    return _build(lengths, group_of, degree, num_ranks, 0, times, {"method": "paper"})
