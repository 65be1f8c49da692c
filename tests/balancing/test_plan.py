"""``Plan.route``: one rank's side of a move, checked by running the move on lists of example ids."""

from __future__ import annotations

import numpy as np
import pytest

from mmbalance.balancing import Plan, post_balance
from mmbalance.balancing.plan import Route


def shuffled_slots(rng, dst_rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """Destination slots in a random order on every rank (so receive buffers need a permutation)."""
    slot = np.empty_like(dst_rank)
    for r in range(num_ranks):
        idx = np.flatnonzero(dst_rank == r)
        slot[idx] = rng.permutation(idx.size)
    return slot


def random_plan(rng, n: int, w: int, *, shuffle: bool) -> Plan:
    lengths = rng.integers(0, 50, size=n).astype(np.int64)
    src_rank = rng.integers(0, w, size=n).astype(np.int64)
    dst_rank = rng.integers(0, w, size=n).astype(np.int64)
    src_slot = shuffled_slots(rng, src_rank, w)
    dst_slot = shuffled_slots(rng, dst_rank, w) if shuffle else None
    if dst_slot is None:  # the usual layout: slots in (source rank, source slot) order
        dst_slot = np.empty_like(dst_rank)
        for r in range(w):
            idx = np.flatnonzero(dst_rank == r)
            idx = idx[np.lexsort((src_slot[idx], src_rank[idx]))]
            dst_slot[idx] = np.arange(idx.size)
    return Plan(
        dst_rank=dst_rank,
        dst_slot=dst_slot,
        costs=np.zeros(w),
        num_ranks=w,
        lengths=lengths,
        src_rank=src_rank,
        src_slot=src_slot,
    )


def run_move(plan: Plan) -> dict[int, list[int]]:
    """Every rank's examples (global ids) after the all-to-all the routes describe, in slot order,
    with token counts checked at every split."""
    w, lengths = plan.num_ranks, plan.lengths
    routes = [plan.route(r) for r in range(w)]
    inbox: dict[int, list[list[int]]] = {d: [] for d in range(w)}
    for s, route in enumerate(routes):
        local = [i for i in range(plan.num_examples) if plan.src_rank[i] == s]
        local.sort(key=lambda i: plan.src_slot[i])
        assert route.in_lengths.tolist() == [int(lengths[i]) for i in local]
        sent = [local[j] for j in route.send_order]
        assert sorted(sent) == sorted(local)
        pos = 0
        for d in range(w):
            chunk, tokens = [], 0
            while tokens < route.send_tokens[d] or (
                pos < len(sent) and plan.dst_rank[sent[pos]] == d and lengths[sent[pos]] == 0
            ):
                chunk.append(sent[pos])
                tokens += int(lengths[sent[pos]])
                pos += 1
            assert tokens == route.send_tokens[d]
            assert all(plan.dst_rank[i] == d for i in chunk)
            inbox[d].append(chunk)
        assert pos == len(sent)
    out = {}
    for d, route in enumerate(routes):
        received = [i for chunk in inbox[d] for i in chunk]
        assert route.recv_tokens == [sum(int(lengths[i]) for i in c) for c in inbox[d]]
        if route.recv_perm is not None:
            received = [received[j] for j in route.recv_perm]
        assert route.out_lengths.tolist() == [int(lengths[i]) for i in received]
        assert route.out_tokens == sum(int(lengths[i]) for i in received)
        out[d] = received
    return out


@pytest.mark.parametrize("shuffle", [False, True], ids=["slot-order", "shuffled-slots"])
@pytest.mark.parametrize(("n", "w"), [(0, 3), (1, 1), (7, 3), (40, 5)])
def test_routes_run_the_plan(rng, n, w, shuffle):
    for _ in range(5):
        plan = random_plan(rng, n, w, shuffle=shuffle)
        out = run_move(plan)
        for d in range(w):
            expect = sorted(np.flatnonzero(plan.dst_rank == d).tolist(), key=lambda i: plan.dst_slot[i])
            assert out[d] == expect
        if not shuffle:
            assert all(plan.route(r).recv_perm is None for r in range(w))


def test_routes_of_a_balanced_plan_and_its_inverse(rng):
    lengths = rng.integers(1, 500, size=60)
    src = np.repeat(np.arange(4), 15)
    plan = post_balance(lengths, 4, src_ranks=src)
    back = plan.inverse()
    for p in (plan, back):
        out = run_move(p)
        for d in range(4):
            assert out[d] == p.recv_order(d).tolist()
    assert plan.route(2) is plan.route(2)  # computed once
    assert isinstance(plan.route(np.int64(1)), Route)


def test_route_refuses_bad_ranks_and_plans_without_sources():
    plan = post_balance([3, 1, 2], 2, src_ranks=[0, 0, 1])
    for bad, exc in [(2, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="rank"):
            plan.route(bad)
    with pytest.raises(ValueError, match="source layout"):
        post_balance([3, 1, 2], 2).route(0)
