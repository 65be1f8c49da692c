"""The micro-batch slots of a context-parallel step (``cp/slots.py``), against brute force.

Whenever some split of a step's examples into its slots lets every slot be laid out under the
token budget (every assignment tried), :func:`plan_slots` finds one; it refuses only when none
exists. Checked with the real layout planner (zigzag rounding included) and with arbitrary
predicates that depend on a slot's tokens only.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.balancing import CostModel  # noqa: E402
from mmbalance.integrations.hf.cp.plan import plan_layout  # noqa: E402
from mmbalance.integrations.hf.cp.slots import plan_slots  # noqa: E402

COST = CostModel.transformer(hidden_size=32, num_layers=2, kv_size=16, ffn_size=64)


def layout_fits(tokens: np.ndarray, world: int, budget: int):
    memo: dict[tuple[int, ...], bool] = {}

    def fits(members: np.ndarray) -> bool:
        key = tuple(int(x) for x in tokens[members])
        if key not in memo:
            try:
                plan_layout(tokens[members], np.zeros(members.size, dtype=np.int64), world, budget, COST)
                memo[key] = True
            except ValueError:
                memo[key] = False
        return memo[key]

    return fits


def brute_force(n: int, count: int, fits) -> bool:
    """Whether any assignment of ``n`` examples to ``count`` slots fits every slot."""
    for assign in itertools.product(range(count), repeat=n):
        a = np.asarray(assign, dtype=np.int64)
        if all(fits(np.flatnonzero(a == s)) for s in range(count)):
            return True
    return False


def check(tokens: np.ndarray, count: int, capacity: int, fits) -> None:
    found = plan_slots(tokens, tokens.astype(np.float64) ** 2, count, capacity, fits)
    assert not found.exhausted
    exists = brute_force(tokens.size, count, fits)
    if found.slots is None:
        assert not exists, f"refused, but a split exists: {tokens.tolist()} into {count}"
    else:
        assert exists
        assert found.slots.shape == tokens.shape  # one slot for every example
        assert set(found.slots.tolist()) <= set(range(count))
        for s in range(count):  # every example once, every slot fits
            assert fits(np.flatnonzero(found.slots == s)), (tokens.tolist(), found.slots.tolist())


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 60), min_size=1, max_size=7),
    count=st.integers(1, 3),
    world=st.integers(1, 4),
    budget=st.integers(1, 40),
)
def test_a_fitting_split_is_found_whenever_one_exists(tokens, count, world, budget):
    t = np.asarray(tokens, dtype=np.int64)
    check(t, count, world * budget, layout_fits(t, world, budget))


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 30), min_size=1, max_size=7),
    count=st.integers(1, 3),
    capacity=st.integers(1, 80),
    salt=st.integers(0, 10_000),
)
def test_the_search_is_complete_for_any_token_predicate(tokens, count, capacity, salt):
    """A predicate the greedy splits cannot read (a slot fits when its tokens stay under the
    capacity and a hash of its sorted tokens says so): the exhaustive search still decides."""
    t = np.asarray(tokens, dtype=np.int64)

    def fits(members: np.ndarray) -> bool:
        key = tuple(sorted(int(x) for x in t[members]))
        if sum(key) > capacity:
            return False
        return not key or zlib.crc32(repr((key, salt)).encode()) % 4 != 0

    check(t, count, capacity, fits)


def test_the_balanced_split_is_kept_when_it_fits():
    tokens = np.array([10, 10, 10, 10])
    start = np.array([1, 0, 1, 0])
    found = plan_slots(tokens, tokens * 1.0, 2, 100, lambda m: True, start=start)
    assert found.slots.tolist() == start.tolist()


def test_the_issues_step_is_rearranged_to_fit():
    """4 ranks, max_tokens_per_rank=64, 2 micro-batches of 8 examples: a text of 173 tokens and 11
    short ones in the first slot (338 tokens) does not fit 256; the step (367 tokens) does."""
    rng = np.random.default_rng(3)
    short = rng.integers(8, 22, size=15)
    tokens = np.concatenate([[173], short]).astype(np.int64)
    start = np.array([0] * 12 + [1] * 4)
    assert int(tokens[start == 0].sum()) > 256
    fits = layout_fits(tokens, 4, 64)
    found = plan_slots(tokens, tokens * 1.0, 2, 256, fits, start=start)
    assert found.slots is not None
    assert all(fits(np.flatnonzero(found.slots == s)) for s in range(2))


def test_an_example_over_the_capacity_is_refused_at_once():
    found = plan_slots(np.array([300, 4]), np.array([1.0, 1.0]), 2, 256, lambda m: True)
    assert found.slots is None and not found.exhausted


def test_a_search_past_its_budget_says_so():
    tokens = np.full(14, 10, dtype=np.int64)
    found = plan_slots(tokens, tokens * 1.0, 3, 1000, lambda m: False, max_nodes=50)
    assert found.slots is None and found.exhausted and found.nodes > 50
