"""The all-to-all batch communicator on 2, 3 and 4 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


def _local_examples(rank: int, world: int, seed: int, hidden: int = 3):
    """This rank's examples: lengths (with zeros), and content that names (example, position)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 7, size=world)
    counts[0] = max(counts[0], 1)
    lengths_all = [rng.integers(0, 9, size=int(c)) for c in counts]
    for lst in lengths_all:
        if lst.size:
            lst[rng.integers(0, lst.size)] = 0  # a zero-length example on every non-empty rank
    offset = int(sum(counts[:rank]))
    mine = lengths_all[rank]
    rows = []
    for j, length in enumerate(mine):
        gid = offset + j
        for p in range(int(length)):
            rows.append([gid * 100 + p + 0.5 * k for k in range(hidden)])
    x = torch.tensor(rows, dtype=torch.float64).reshape(-1, hidden)
    cu = torch.zeros(mine.size + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(mine)).to(torch.int32)
    return mine, x, cu


def _expected(plan, rank, hidden=3):
    rows = []
    for gid in plan.recv_order(rank):
        for p in range(int(plan.lengths[gid])):
            rows.append([gid * 100 + p + 0.5 * k for k in range(hidden)])
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, hidden)


def _worker(rank, world, seed):
    import torch.distributed as dist

    from mmbalance.balancing import post_balance
    from mmbalance.collectives import gather_lengths, rebalance

    out = {}
    mine, x, cu = _local_examples(rank, world, seed)
    lengths, src = gather_lengths(mine)
    assert lengths.sum() == sum(_local_examples(r, world, seed)[0].sum() for r in range(world))
    plan = post_balance(lengths, world, src_ranks=src, ranks_per_node=1)

    # 1. every example arrives once, on the planned rank and slot, bit-identical; extras travel along
    labels = (x[:, 0] * 2).to(torch.int64)
    pos = torch.stack([labels, labels + 1], dim=1).reshape(-1, 1, 2)  # same dtype: shares a buffer
    (y, y_labels, y_pos), y_cu = rebalance([x, labels, pos], cu, plan)
    exp = _expected(plan, rank)
    assert torch.equal(y, exp), (y, exp)
    exp_labels = (exp[:, 0] * 2).to(torch.int64)
    assert torch.equal(y_labels, exp_labels)
    assert torch.equal(y_pos, torch.stack([exp_labels, exp_labels + 1], dim=1).reshape(-1, 1, 2))
    assert y_cu.tolist() == [0, *np.cumsum(plan.lengths[plan.recv_order(rank)]).tolist()]

    # 2. gradients: loss = sum(w * y) with w depending on the global example id -> grad_x = w(x)
    xg = x.clone().requires_grad_(True)
    zg = (x[:, :1] * 3).clone().requires_grad_(True)
    (y2, z2), _ = rebalance([xg, zg], cu, plan)
    ((torch.sin(y2) * (y2 + 1)).sum() + (z2**2).sum()).backward()
    ref = (torch.cos(x) * (x + 1) + torch.sin(x)).detach()
    assert torch.allclose(xg.grad, ref, rtol=0, atol=1e-12)
    assert torch.allclose(zg.grad, 2 * zg.detach(), rtol=0, atol=1e-12)

    # 3. composition == sequential application (a vision plan, then the LLM plan)
    vis_all = np.random.default_rng(seed + 2).integers(0, 9, size=lengths.size)
    pv = post_balance(vis_all, world, src_ranks=src)
    pl = post_balance(lengths, world, src_ranks=src)
    v_mine = vis_all[src == rank]
    v = torch.arange(int(v_mine.sum()), dtype=torch.float64)[:, None] + 1000 * rank
    v_cu = torch.zeros(v_mine.size + 1, dtype=torch.int32)
    v_cu[1:] = torch.from_numpy(np.cumsum(v_mine)).to(torch.int32)
    enc, enc_cu = rebalance(v, v_cu, pv)  # now in the encoder layout
    direct, direct_cu = rebalance(enc, enc_cu, pl.with_lengths(vis_all).compose(pv.inverse()))
    home, home_cu = rebalance(enc, enc_cu, pv.inverse())
    assert torch.equal(home, v)
    two, two_cu = rebalance(home, home_cu, pl.with_lengths(vis_all))
    assert torch.equal(direct, two) and torch.equal(direct_cu, two_cu)

    # 4. a plan that differs on one rank raises on every rank (no deadlock)
    from mmbalance.balancing import Plan

    shift = 1 if rank == world - 1 else 0  # the last rank's plan sends every example one rank on
    bad = Plan.from_destinations(lengths, (src + shift) % world, world, src)
    try:
        rebalance(x, cu, bad)
    except (RuntimeError, ValueError) as exc:
        out["mismatch"] = str(exc)
    else:
        raise AssertionError("a mismatched plan did not raise")

    # 5. inputs that disagree with the plan (rank 0 claims one example too many) raise everywhere
    wrong_cu = torch.cat([cu, cu[-1:]]) if rank == 0 else cu
    fresh = post_balance(lengths, world, src_ranks=src, tolerance=0.0)
    try:
        rebalance(x, wrong_cu, fresh)
        raised = False
    except RuntimeError as exc:
        raised = "rank 0: cu_seqlens describes" in str(exc)
    out["shape_mismatch_raised"] = raised
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rebalance(world):
    results = run_distributed(_worker, world, 10 + world, timeout=180)
    assert all("plan differs between ranks" in r["mismatch"] for r in results), results
    assert all(r["shape_mismatch_raised"] for r in results)
