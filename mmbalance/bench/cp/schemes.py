"""The context-parallel schemes ``mmbalance bench cp`` compares, as schedules timed by one cost model.

A schedule places every sequence of one step (a packed micro-batch) in one group of ``degree``
ranks; a group runs its sequences packed, long ones split over its ranks in the zigzag layout.
Groups of one *round* run at the same time on disjoint ranks; rounds run one after another (only
the power-of-two hybrid uses more than one). So a step takes, under one :class:`CostModel`,

    step time = sum over rounds of max over the round's groups of cost.time(group's lengths, degree)

Schemes:

* :func:`static_cp`: a fixed degree ``c`` as accelerate's ``ParallelismConfig(cp_size=c)`` sets it
  up: ``world // c`` groups of ``c`` ranks. Accelerate itself does not balance what each group
  gets; here the groups are balanced greedily, which only helps the static scheme: sequences
  longest first (ties by index), each to the group whose modelled time after taking it is the
  smallest (ties: lowest group), among the groups with memory left (``c * memory_per_rank``
  tokens). A degree that cannot hold some sequence, or whose groups run out of memory, is
  infeasible for the step, with the reason.
* :func:`hybrid_pow2`: power-of-two hybrid CP, the idea of Megatron-core's ``BalancedCPScheduler``
  (``hybrid_cp_schedule.py`` and ``datasets/data_schedule_utils.py``), written anew here: every
  sequence gets the power of two of ranks its memory needs; rounds are filled longest first, a
  sequence opening a new group while free ranks remain and else joining the least loaded group of
  its degree that has memory left; a round closes when nothing more fits, or, once a smaller
  degree than the round's first has been placed, when every rank is busy and the ranks' loads are
  within 5% of each other; free ranks are then given to the smallest groups by doubling their
  degree. Loads are Megatron's own estimate, ``l**2 / degree`` per rank; the round's sequences
  left over go to the next round. One difference: Megatron only considers the heads of
  work-balanced buckets of the sorted sequences as the next candidate; here the longest
  remaining sequence of every degree is a candidate. :func:`hybrid_pow2` with ``cost`` is the same
  scheme with the groups' modelled times as loads (``hybrid_pow2_cost``), a stronger baseline that
  separates the power-of-two degrees from the crude estimate.
* :func:`ours`: :func:`mmbalance.balancing.cp_schedule` under the same cost model.

:func:`check_schedule` verifies what every scheme must satisfy; :func:`step_time` and
:func:`largest_shard` measure a schedule.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from mmbalance.balancing import CostModel, CPSchedule, cp_schedule

BALANCE_SLACK = 0.05  # Megatron's ``delta``: a round is balanced when max - min <= 5% of max


@dataclasses.dataclass(frozen=True)
class Round:
    """Groups running at the same time: ``degree[k]`` ranks for group ``k``; ``group_of[i]`` the
    group of sequence ``i`` in this round, ``-1`` for sequences of other rounds."""

    degree: np.ndarray
    group_of: np.ndarray


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One scheme's placement of one step: its rounds, or why it cannot run the step."""

    scheme: str
    rounds: tuple[Round, ...] = ()
    infeasible: str | None = None

    @property
    def feasible(self) -> bool:
        return self.infeasible is None


def group_times(
    cost: CostModel, lengths: np.ndarray, rnd: Round, squares: np.ndarray | None = None
) -> np.ndarray:
    """Modelled time of each group of ``rnd`` (float64 ``[g]``), the formula of :class:`CostModel`.
    ``squares``: each sequence's attention in ``l**2`` units (float64 ``[n]``; default ``l**2``)."""
    g = rnd.degree.size
    inside = rnd.group_of >= 0
    key = rnd.group_of[inside]
    x = lengths[inside].astype(np.float64)
    s1 = np.bincount(key, weights=x, minlength=g)
    s2 = np.bincount(key, weights=x * x if squares is None else squares[inside], minlength=g)
    count = np.bincount(key, minlength=g)
    return times_of(cost, s1, s2, count, rnd.degree)


def times_of(cost: CostModel, s1, s2, count, degree) -> np.ndarray:
    """:meth:`CostModel.time` of groups given their sums of ``l`` and ``l**2``, sequence counts and
    degrees (arrays of one shape), vectorized."""
    if cost.padded:
        raise ValueError("cost: a padded CostModel does not describe packed CP groups")
    d = np.asarray(degree, dtype=np.float64)
    att = cost.attention * (1.0 + cost.eta) * s2 / d
    ring = np.where(d > 1, cost.ring * s1 * (d - 1.0) / d + cost.ring_latency * (d - 1.0), 0.0)
    both = np.maximum(att, ring) if cost.overlap else att + ring
    return np.where(np.asarray(count) > 0, cost.fixed + cost.linear * s1 / d + both, 0.0)


def step_time(
    schedule: Schedule, lengths: np.ndarray, cost: CostModel, squares: np.ndarray | None = None
) -> float:
    """Sum over rounds of the slowest group's modelled time; ``nan`` for an infeasible schedule.
    ``squares`` as :func:`group_times` takes them."""
    if not schedule.feasible:
        return math.nan
    return float(sum(group_times(cost, lengths, r, squares).max(initial=0.0) for r in schedule.rounds))


def zigzag_tokens(lengths: np.ndarray, degree: int) -> np.ndarray:
    """Tokens on each of ``degree`` ranks when ``lengths`` are packed and each sequence is cut
    into ``2 * degree`` chunks at ``(c * l) // (2 * degree)``, rank ``r`` holding chunks ``r`` and
    ``2 * degree - 1 - r`` (the layout of ``mmbalance.collectives.ring.plan``); int64 ``[degree]``."""
    x = np.asarray(lengths, dtype=np.int64)
    if degree == 1:
        return np.array([int(x.sum())], dtype=np.int64)
    n = 2 * degree
    bounds = (np.arange(n + 1, dtype=np.int64)[None, :] * x[:, None]) // n  # [B, n + 1]
    chunk = np.diff(bounds, axis=1).sum(axis=0)  # tokens of each chunk position over the batch
    return chunk[:degree] + chunk[::-1][:degree]


def largest_shard(schedule: Schedule, lengths: np.ndarray) -> int:
    """Tokens on the busiest rank over the schedule's rounds and groups (zigzag rounding
    included); ``-1`` for an infeasible schedule."""
    if not schedule.feasible:
        return -1
    most = 0
    for rnd in schedule.rounds:
        order = np.argsort(rnd.group_of, kind="stable")
        counts = np.bincount(rnd.group_of[rnd.group_of >= 0], minlength=rnd.degree.size)
        start = int((rnd.group_of < 0).sum())
        for k, d in enumerate(rnd.degree.tolist()):
            members = order[start : start + counts[k]]
            start += counts[k]
            most = max(most, int(zigzag_tokens(lengths[members], d).max()))
    return most


def check_schedule(schedule: Schedule, lengths: np.ndarray, world: int, memory_per_rank: int) -> None:
    """Raise ``ValueError`` unless a feasible schedule places every sequence in exactly one group
    of one round, every round uses at most ``world`` ranks, and every group's tokens fit in
    ``degree * memory_per_rank``. An infeasible schedule must say why and hold no rounds."""
    name = schedule.scheme
    if not schedule.feasible:
        if schedule.rounds or not schedule.infeasible:
            raise ValueError(f"{name}: an infeasible schedule holds rounds or gives no reason")
        return
    n = lengths.size
    placed = np.zeros(n, dtype=np.int64)
    for j, rnd in enumerate(schedule.rounds):
        if rnd.group_of.shape != (n,):
            raise ValueError(f"{name}: round {j} covers {rnd.group_of.shape} sequences, not ({n},)")
        g = rnd.degree.size
        if g == 0 or (rnd.degree < 1).any() or int(rnd.degree.sum()) > world:
            raise ValueError(f"{name}: round {j} has degrees {rnd.degree.tolist()} for {world} ranks")
        if (rnd.group_of >= g).any() or (rnd.group_of < -1).any():
            raise ValueError(f"{name}: round {j} names a group it does not have")
        inside = rnd.group_of >= 0
        placed += inside
        tokens = np.bincount(rnd.group_of[inside], weights=lengths[inside], minlength=g)
        over = np.flatnonzero(tokens > rnd.degree * memory_per_rank)
        if over.size:
            k = int(over[0])
            raise ValueError(
                f"{name}: round {j} group {k} holds {int(tokens[k])} tokens on {int(rnd.degree[k])} ranks "
                f"of {memory_per_rank}"
            )
    if n and (placed != 1).any():
        i = int(np.flatnonzero(placed != 1)[0])
        raise ValueError(f"{name}: sequence {i} is placed {int(placed[i])} times")


def _longest_first(lengths: np.ndarray) -> np.ndarray:
    return np.lexsort((np.arange(lengths.size), -lengths))


def static_cp(
    lengths: np.ndarray,
    world: int,
    memory_per_rank: int,
    degree: int,
    cost: CostModel,
    encoder_seconds: np.ndarray | None = None,
    squares=None,
) -> Schedule:
    """A fixed CP degree: ``world // degree`` groups balanced greedily (see the module docstring).
    ``encoder_seconds`` (per sequence): its media's encoder time, which a group's members share, so
    the greedy balances ``cost`` plus ``encoder seconds / degree`` (``bench cp --vlm``).
    ``squares``: each sequence's attention in ``l**2`` units (a sliding-window model's, ``bench cp``'s
    window line), in place of ``l**2``."""
    name = f"static_cp{degree}"
    cap = degree * memory_per_rank
    if degree > world:
        return Schedule(name, infeasible=f"degree {degree} > {world} ranks")
    if lengths.size and int(lengths.max()) > cap:
        i = int(np.argmax(lengths))
        return Schedule(
            name,
            infeasible=f"a sequence of {int(lengths[i])} tokens does not fit {degree} x {memory_per_rank}",
        )
    g = world // degree
    s1, s2 = np.zeros(g), np.zeros(g)
    tokens = np.zeros(g, dtype=np.int64)
    count = np.zeros(g, dtype=np.int64)
    deg = np.full(g, degree, dtype=np.int64)
    enc = np.zeros(g)
    extra = (
        np.zeros(lengths.size) if encoder_seconds is None else np.asarray(encoder_seconds, dtype=np.float64)
    )
    group_of = np.empty(lengths.size, dtype=np.int64)
    sq = (
        lengths.astype(np.float64) ** 2 if squares is None else np.asarray(squares(lengths), dtype=np.float64)
    )
    for i in _longest_first(lengths).tolist():
        l = int(lengths[i])
        room = tokens + l <= cap
        if not room.any():
            return Schedule(name, infeasible=f"its {g} groups of {cap} tokens cannot pack the step")
        after = times_of(cost, s1 + l, s2 + sq[i], count + 1, deg) + (enc + extra[i]) / degree
        k = int(np.argmin(np.where(room, after, np.inf)))
        enc[k] += extra[i]
        s1[k] += l
        s2[k] += sq[i]
        tokens[k] += l
        count[k] += 1
        group_of[i] = k
    used = np.flatnonzero(count > 0)
    remap = np.full(g, -1, dtype=np.int64)
    remap[used] = np.arange(used.size)
    return Schedule(name, (Round(deg[used], remap[group_of]),))


def pow2_degree(lengths: np.ndarray, world: int, memory_per_rank: int) -> np.ndarray:
    """The power of two of ranks each sequence's memory needs (at least 1, at most ``world``)."""
    need = np.maximum(1, -(-lengths // memory_per_rank))
    p2 = np.left_shift(1, np.ceil(np.log2(need)).astype(np.int64))
    return np.minimum(p2, world).astype(np.int64)


def hybrid_pow2(
    lengths: np.ndarray, world: int, memory_per_rank: int, cost: CostModel | None = None
) -> Schedule:
    """Power-of-two hybrid CP in rounds (see the module docstring). Loads are Megatron's
    ``l**2 / degree`` estimate, or with ``cost`` the groups' modelled times (``hybrid_pow2_cost``:
    the same scheme with a better estimate, to tell the power-of-two degrees from the estimate)."""
    name = "hybrid_pow2" if cost is None else "hybrid_pow2_cost"
    n = lengths.size
    if n and int(lengths.max()) > world * memory_per_rank:
        return Schedule(name, infeasible=f"a sequence of {int(lengths.max())} tokens exceeds {world} ranks")
    need = pow2_degree(lengths, world, memory_per_rank)
    order = _longest_first(lengths)
    # per degree, its sequences longest first; a cursor per degree
    queues = {int(d): order[need[order] == d].tolist() for d in np.unique(need)}
    head = dict.fromkeys(queues, 0)
    degrees_desc = sorted(queues, reverse=True)
    left = n
    rounds: list[Round] = []
    while left:
        # groups of this round: degree, tokens, estimated per-rank load (Megatron's l^2 / degree)
        deg = np.zeros(world, dtype=np.int64)
        tokens = np.zeros(world, dtype=np.int64)
        load = np.zeros(world)
        s1, s2 = np.zeros(world), np.zeros(world)
        count = np.zeros(world, dtype=np.int64)
        g = 0
        free = world
        group_of = np.full(n, -1, dtype=np.int64)
        first = 0
        check = False
        while left:
            pick = None
            for d in degrees_desc:
                if head[d] < len(queues[d]) and (free >= d or (deg[:g] == d).any()):
                    pick = d
                    break
            if pick is None:
                break
            i = queues[pick][head[pick]]
            l = int(lengths[i])
            room = (deg[:g] == pick) & (tokens[:g] + l <= pick * memory_per_rank)
            best = int(np.argmin(np.where(room, load[:g], np.inf))) if room.any() else -1
            if free >= pick and (best < 0 or load[best] > 0.0):  # a new group starts with no load
                best, g, free = g, g + 1, free - pick
                deg[best] = pick
            elif best < 0:
                break  # this round is full
            tokens[best] += l
            if cost is None:
                load[best] += float(l) * l / pick
            else:
                s1[best] += l
                s2[best] += float(l) * l
                count[best] += 1
                load[best] = float(times_of(cost, s1[best], s2[best], count[best], pick))
            group_of[i] = best
            head[pick] += 1
            left -= 1
            first = first or pick
            check = check or pick < first
            if check and left and free == 0:
                busy = load[:g]
                if busy.max() - busy.min() <= BALANCE_SLACK * busy.max():
                    break
        # free ranks go to the smallest groups, each doubling its degree (at most to world)
        while free:
            small = int(deg[:g].min())
            k = int(np.flatnonzero(deg[:g] == small)[0])
            grow = min(min(2 * small, world) - small, free)
            deg[k] += grow
            free -= grow
        rounds.append(Round(deg[:g].copy(), group_of))
    return Schedule(name, tuple(rounds))


def ours(
    lengths: np.ndarray, world: int, memory_per_rank: int, cost: CostModel, ranks_per_node: int | None = None
) -> tuple[Schedule, CPSchedule]:
    """:func:`mmbalance.balancing.cp_schedule` as a :class:`Schedule` (one round), and its plan."""
    plan = cp_schedule(lengths, world, memory_per_rank, cost, ranks_per_node=ranks_per_node)
    group_of = plan.group_of(lengths.size)
    degree = np.array([grp.degree for grp in plan], dtype=np.int64)
    return Schedule("mmbalance", (Round(degree, group_of),)), plan


def static_cells(mean: dict[str, float], best: str | None, degrees) -> str:
    """The summary tables' cells of the static degrees: each one's mean step (ms; ``-`` where it
    cannot run), the best one starred."""
    from ..harness import ms_cell

    names = [f"static_cp{c}" for c in degrees]
    return " | ".join(ms_cell(mean[s]) + (" *" if s == best else "") for s in names)
