"""A step's examples cut into its micro-batch slots under the token budget (:func:`plan_slots`).

With context parallelism a micro-batch slot runs on all ranks together: its sequences are laid out
in CP groups of any degree under ``max_tokens_per_rank`` (:func:`~.plan.plan_layout`). The slots of
an optimizer step are therefore formed with the budget as a hard limit first and balance second:

1. the balanced split without context parallelism (the sampler's micro-batches), when every slot
   of it can be laid out;
2. otherwise the best balanced of a few greedy splits that can: longest-processing-time on the
   examples' cost with the capacity as a limit, and first- and worst-fit decreasing on tokens;
3. otherwise an exhaustive search (longest examples first, slots of equal load tried once, no slot
   past ``world * max_tokens_per_rank``), which either finds a split or proves there is none.

Which examples train in a step does not change, only their micro-batch, and the loss is normalized
over the whole step, so training equals the run without context parallelism. No communication
happens here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

__all__ = ["SlotSearch", "plan_slots"]


class SlotSearch:
    """What :func:`plan_slots` found: ``slots`` (the slot of every example, int64 ``[n]``, or
    ``None``), ``exhausted`` (the search ran past its node budget without an answer) and
    ``nodes`` (assignments the exhaustive search tried)."""

    def __init__(self, slots: np.ndarray | None, exhausted: bool = False, nodes: int = 0):
        self.slots, self.exhausted, self.nodes = slots, exhausted, nodes


def _greedy(order: np.ndarray, tokens: np.ndarray, weight: np.ndarray, count: int, cap: int,
            pick: Callable[[np.ndarray, np.ndarray, np.ndarray], int]) -> np.ndarray | None:  # fmt: skip
    """Examples in ``order``, each to the slot ``pick(room_mask, loads, tokens)`` chooses among those
    with room; ``None`` when one has no room anywhere."""
    slots = np.full(tokens.size, -1, dtype=np.int64)
    load = np.zeros(count)
    used = np.zeros(count, dtype=np.int64)
    for i in order.tolist():
        room = used + tokens[i] <= cap
        if not room.any():
            return None
        s = pick(room, load, used)
        slots[i] = s
        load[s] += weight[i]
        used[s] += tokens[i]
    return slots


def plan_slots(tokens, costs, count: int, capacity: int, fits: Callable[[np.ndarray], bool],
               start: np.ndarray | None = None, max_nodes: int = 200_000) -> SlotSearch:  # fmt: skip
    """The slot of every example of a step: ``count`` slots, each of which ``fits`` (called with a
    slot's example indices, ascending; cached), the split of the lowest costliest slot among the
    candidates, or a proof that none exists (``slots is None``).

    Args:
        tokens: int ``[n]``, every example's tokens (what ``capacity`` limits).
        costs: float ``[n]``, what the slots are balanced in.
        count: the step's micro-batch slots (``gradient_accumulation_steps``).
        capacity: tokens a slot may hold at most (``world * max_tokens_per_rank``); ``fits`` may be
            stricter (zigzag rounding), never looser.
        fits: whether a slot of these examples can be laid out. It must depend on the slot's
            tokens alone (their multiset, not which examples hold them): the exhaustive search
            tries slots of equal contents once. The layout planner's feasibility does.
        start: a preferred split (the balanced one), taken when every slot of it fits.
        max_nodes: the exhaustive search's budget; past it the answer is ``exhausted``.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n = tokens.size
    memo: dict[tuple[int, ...], bool] = {}

    def ok(members: np.ndarray) -> bool:
        key = tuple(members.tolist())
        if key not in memo:
            memo[key] = bool(fits(members))
        return memo[key]

    def valid(slots: np.ndarray) -> bool:
        return all(ok(np.flatnonzero(slots == s)) for s in range(count))

    def worst(slots: np.ndarray) -> float:
        return float(np.bincount(slots, weights=costs, minlength=count).max(initial=0.0))

    if n and int(tokens.max()) > capacity:
        return SlotSearch(None)
    if start is not None and valid(np.asarray(start, dtype=np.int64)):
        return SlotSearch(np.asarray(start, dtype=np.int64).copy())
    by_cost = np.lexsort((np.arange(n), -costs))
    by_tokens = np.lexsort((np.arange(n), -tokens))
    candidates = [
        _greedy(by_cost, tokens, costs, count, capacity, lambda room, load, used: int(np.argmin(np.where(room, load, np.inf)))),
        _greedy(by_tokens, tokens, costs, count, capacity, lambda room, load, used: int(np.argmax(room))),
        _greedy(by_tokens, tokens, costs, count, capacity, lambda room, load, used: int(np.argmin(np.where(room, used, np.iinfo(np.int64).max)))),
    ]  # fmt: skip
    good = [c for c in candidates if c is not None and valid(c)]
    if good:
        return SlotSearch(min(good, key=worst))
    return _exhaustive(tokens, by_tokens, count, capacity, ok, max_nodes)


def _exhaustive(
    tokens: np.ndarray, order: np.ndarray, count: int, cap: int, ok, max_nodes: int
) -> SlotSearch:
    """Every split, longest examples first: an example goes to each slot with room once (slots of
    equal load and contents are one choice), the tokens left must fit the room left, and a
    complete split is kept when every slot ``ok``s."""
    n = tokens.size
    slots = np.full(n, -1, dtype=np.int64)
    used = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    left = [int(x) for x in np.cumsum(tokens[order][::-1])[::-1]] + [0]  # tokens from position k on
    nodes = 0

    def place(k: int) -> bool | None:
        nonlocal nodes
        if k == n:
            return all(ok(np.asarray(sorted(m), dtype=np.int64)) for m in members)
        if left[k] > count * cap - sum(used):
            return False
        i = int(order[k])
        tried: set[tuple[int, tuple[int, ...]]] = set()
        for s in range(count):
            if used[s] + tokens[i] > cap:
                continue
            twin = (used[s], tuple(sorted(int(tokens[j]) for j in members[s])))
            if twin in tried:  # the same slot again, as far as the rest can tell
                continue
            tried.add(twin)
            nodes += 1
            if nodes > max_nodes:
                return None
            used[s] += int(tokens[i])
            members[s].append(i)
            slots[i] = s
            found = place(k + 1)
            if found is None or found:
                return found
            used[s] -= int(tokens[i])
            members[s].pop()
            slots[i] = -1
        return False

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + n + 200)  # the stack is below the limit; one frame an example
    try:
        found = place(0)
    finally:
        sys.setrecursionlimit(limit)
    if found is None:
        return SlotSearch(None, exhausted=True, nodes=nodes)
    return SlotSearch(slots.copy() if found else None, nodes=nodes)
