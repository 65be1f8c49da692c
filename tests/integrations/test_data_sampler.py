"""``BalancedBatchSampler``: every example once per epoch, the same split on every rank without
talking, balanced cost, DistributedSampler's padding, epochs, and clear errors."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest
import torch

from mmbalance.balancing import CostModel
from mmbalance.integrations.data import BalancedBatchSampler
from tests import procs


def _lengths(n=203, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.pareto(1.2, size=n) * 300 + 20).astype(np.int64)


def _all_ranks(lengths, batch_size, world, **kw):
    """Every rank's batches per step, from ``world`` independent samplers."""
    samplers = [BalancedBatchSampler(lengths, batch_size, world, r, **kw) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    return samplers, [list(step) for step in zip(*per_rank)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("batch_size", "world"), [(4, 3), (8, 2), (1, 5), (300, 2)])
def test_every_example_once_per_epoch(drop_last, batch_size, world):
    lengths = _lengths()
    n = lengths.size
    if drop_last and n < batch_size * world:
        with pytest.raises(ValueError, match="smaller than one optimizer step"):
            BalancedBatchSampler(lengths, batch_size, world, 0, drop_last=drop_last)
        return
    samplers, steps = _all_ranks(lengths, batch_size, world, drop_last=drop_last)
    seen = Counter(i for step in steps for batch in step for i in batch)
    total = samplers[0].total_size
    assert sum(seen.values()) == total
    if drop_last:
        assert (
            total == (n // (batch_size * world)) * batch_size * world and max(seen.values(), default=1) == 1
        )
    else:
        assert set(seen) == set(range(n)), "every example is yielded"
        assert total == -(-n // (batch_size * world)) * batch_size * world
        assert sum(c - 1 for c in seen.values()) == total - n, "only the padding repeats"
    for step in steps:  # each step: disjoint batches that together are one global batch
        flat = [i for b in step for i in b]
        assert len(flat) == batch_size * world


def test_balances_better_than_an_even_split():
    lengths = np.random.default_rng(1).lognormal(6.0, 0.8, 2000).astype(np.int64) + 1
    world, bs = 8, 16
    samplers, steps = _all_ranks(lengths, bs, world, cost="quadratic", beta=1e-3)
    from mmbalance.balancing import lower_bound

    w = lengths.astype(float) + 1e-3 * lengths.astype(float) ** 2
    ours, even, bound = [], [], []
    for step, (idx, _, _) in zip(steps, samplers[0].steps()):
        loads = [w[b].sum() for b in step]
        ours.append(max(loads))
        even.append(max(w[idx[r * bs : (r + 1) * bs]].sum() for r in range(world)))
        bound.append(lower_bound(lengths[idx], world, "quadratic", alpha=1.0, beta=1e-3))
    ours, even, bound = map(np.asarray, (ours, even, bound))
    assert np.all(ours <= even + 1e-9) and np.mean(ours / bound) < 1.01 and np.mean(even / bound) > 1.15
    last = [w[b].sum() for b in steps[-1]]
    assert samplers[0].stats["cost"] == pytest.approx(max(last) / np.mean(last))


def test_epochs_and_shuffle():
    lengths = _lengths()
    s = BalancedBatchSampler(lengths, 4, 2, 0, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first
    plain = BalancedBatchSampler(lengths, 4, 2, 0, shuffle=False)
    idx0 = next(plain.steps())[0]
    assert idx0.tolist() == list(range(8))


def test_two_dimensional_lengths_report_every_column():
    rng = np.random.default_rng(4)
    table = np.stack([rng.integers(0, 4000, 300), rng.integers(0, 900, 300), rng.integers(50, 3000, 300)], 1)
    s = BalancedBatchSampler(table, 10, 4, 1, cost="sum")
    for _ in s:
        pass
    assert set(s.stats) == {
        "phase0",
        "phase1",
        "llm",
        "cost",
        "micro_cost",
        "cost_before",
        "micro_cost_before",
    }
    assert s.stats["llm"] == pytest.approx(s.stats["cost"]) and s.stats["llm"] < 1.05


def test_fitted_cost_model_and_dataloader():
    lengths = _lengths(64)
    cm = CostModel(linear=2e-6, attention=3e-9)
    s = BalancedBatchSampler(lengths, 4, 2, 1, cost=cm)
    assert s.policy == "quadratic" and s.alpha == 2e-6
    data = torch.arange(64)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s)
    got = [b.tolist() for b in loader]
    assert got == list(s)


_SCRIPT = """
import numpy as np
from mmbalance.integrations.data import BalancedBatchSampler
l = (np.random.default_rng(0).pareto(1.1, 500) * 100 + 1).astype(int)
s = BalancedBatchSampler(l, 8, 4, 2, seed=9, grad_accum=2, padding=True)
s.set_epoch(3)
print("|".join(",".join(map(str, b)) for b in s))
"""


def test_same_batches_in_every_process():
    outs = {
        procs.run(
            [sys.executable, "-c", _SCRIPT],
            timeout=300,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
        ).stdout  # fmt: skip
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and next(iter(outs)).strip()


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        (dict(lengths=[1, -2, 3], batch_size=1, num_replicas=2, rank=0), "lengths"),
        (dict(lengths=[1, 2], batch_size=0, num_replicas=2, rank=0), "batch_size"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=2, rank=2), "rank"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=0, rank=0), "num_replicas"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=2, rank=0, cost="cubic"), "cost"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=2, rank=0, seed=-1), "seed"),
        (dict(lengths=np.zeros((3, 0)), batch_size=1, num_replicas=2, rank=0), "column"),
        (dict(lengths=[1, 2], batch_size=1), "num_replicas and rank"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=2, rank=0, grad_accum=0), "grad_accum"),
        (dict(lengths=[1, 2], batch_size=1, num_replicas=2, rank=0, padding="yes"), "padding"),
        (dict(lengths=[1, 2], batch_size=2, num_replicas=2, rank=0, drop_last=True), "smaller than one"),
    ],
    ids=[
        "negative",
        "batch0",
        "rank",
        "replicas",
        "cost",
        "seed",
        "no-columns",
        "no-dist",
        "accum0",
        "padding",
        "tiny",
    ],
)
def test_bad_input(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        BalancedBatchSampler(**kwargs)
