"""Bidirectional image blocks inside a context-parallel shard (``cp/blocks.py``): a shard's causal
attention (varlen for a group of one, the ring otherwise) plus the later keys of each query's own
block, against dense float64 attention under the mask ``(causal OR same block) AND window`` on
the whole sequences: outputs and the gradients of q, k and v, on 1, 2 and 3 ranks, with blocks cut
by the zigzag pieces, blocks of one token, blocks only in one rank's pieces (the other members
still join the gather and its backward), sequences without blocks, GQA, softcap and a window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmbalance.collectives import cp_shard, ring_attention
from mmbalance.collectives.ring.plan import ring_plan
from mmbalance.integrations.hf.attention import VarlenMask
from mmbalance.integrations.hf.cp.blocks import with_block_keys
from mmbalance.integrations.hf.cp.shard import CPShard
from mmbalance.pyops.attention_ops import attention_block
from tests.dist_utils import run_distributed

# (lengths, block spans in the packed coordinates, heads, kv heads, head dim, softcap, window_left)
CASES = [
    ([37, 11, 20], [(3, 12), (15, 16), (30, 37), (37, 44), (60, 68)], 2, 1, 8, 0.0, -1),
    ([53], [(0, 5)], 2, 2, 4, 0.0, -1),  # the only block in the first piece: rank 0's
    ([29, 7], [(26, 29)], 4, 2, 8, 20.0, -1),  # a block at a sequence's end, softcap
    ([64, 9], [(10, 22), (40, 41), (50, 57), (66, 70)], 2, 1, 8, 0.0, 9),  # a window of 10
    ([31, 17], [], 2, 1, 8, 0.0, -1),  # no block anywhere: nothing gathered
]


def _tensors(lengths, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    t = int(sum(lengths))
    q, k, v = (torch.randn(t, n, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv))
    w = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    return q, k, v, w


def _reference(q, k, v, w, lengths, spans, softcap, window):
    """Dense float64 attention per sequence under (causal OR same block) AND window; the output
    and the gradients of ``(out * w).sum()``."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    block = torch.full((q.shape[0],), -1, dtype=torch.int64)
    for b, (a, e) in enumerate(spans):
        block[a:e] = b
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        same = (block[sl][:, None] == block[sl][None, :]) & (block[sl][:, None] >= 0)
        allowed = (j <= i) | same
        if window >= 0:
            allowed &= j >= i - window
        kk = k[sl].repeat_interleave(h // hkv, dim=1)
        vv = v[sl].repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[sl], kk) * d**-0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), vv))
        start += n
    out = torch.cat(outs)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _mask(shard_rows: np.ndarray, spans) -> VarlenMask:
    """The model's mask of a shard: its rows in blocks carry ids >= 0 (their values do not matter)."""
    ids = torch.full((1, shard_rows.size), -1, dtype=torch.int64)
    for b, (a, e) in enumerate(spans):
        ids[0, torch.from_numpy((shard_rows >= a) & (shard_rows < e))] = b
    mask = VarlenMask(batch_size=1, q_length=shard_rows.size, kv_length=shard_rows.size, causal=True)
    mask.blocks = ids
    return mask


def _shard_step(rank: int, world: int, case: int):
    import torch.distributed as dist

    lengths, spans, h, hkv, d, softcap, window = CASES[case]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    q, k, v, w = (x.float() for x in _tensors(lengths, h, hkv, d, seed=case))
    q, k, v, w = (cp_shard(x, cu, rank=rank, degree=world) for x in (q, k, v, w))
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    rows = ring_plan(cu, world, "zigzag").global_index(rank) if world > 1 else np.arange(int(cu[-1]))
    blocks = np.array(spans, dtype=np.int64).reshape(-1, 2)
    extra = {"softcap": softcap} if softcap else {}
    if window >= 0:
        extra["window_left"] = window
    if world > 1:
        group = dist.group.WORLD
        shard = CPShard(world, rank, group, cu, int(rows.size), blocks=blocks)
        out, lse = ring_attention(q, k, v, cu, causal=True, group=group, return_lse=True, **extra)
    else:
        group = None
        local = torch.from_numpy(cu.astype(np.int32))
        shard = CPShard(1, 0, None, cu, int(rows.size), local, int(max(lengths)), blocks=blocks)
        out, lse = attention_block(q, k, v, local, local, int(max(lengths)), int(max(lengths)),
                                   softmax_scale=d**-0.5, causal=True, **extra)  # fmt: skip
    out = with_block_keys(out, lse, q, k, v, shard, _mask(rows, spans), group, d**-0.5, softcap or None)
    (out * w).sum().backward()
    return rows, *(x.numpy() for x in (out.detach(), q.grad, k.grad, v.grad))


def _check(case: int, results: list) -> None:
    lengths, spans, h, hkv, d, softcap, window = CASES[case]
    want = _reference(*_tensors(lengths, h, hkv, d, seed=case), lengths, spans, softcap, window)
    got = [torch.zeros_like(x) for x in want]
    seen = np.zeros(int(sum(lengths)), dtype=np.int64)
    for rows, *parts in results:
        seen[rows] += 1
        for g, p in zip(got, parts):
            g[torch.from_numpy(rows)] = torch.as_tensor(p).double()
    assert (seen == 1).all()
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((g - x).abs().max()) / max(float(x.abs().max()), 1e-30)
        assert err <= 2e-5, f"case {case}: {name} off by {err:.2e} (relative to its largest entry)"


def _all_cases(rank: int, world: int):
    return [_shard_step(rank, world, c) for c in range(len(CASES))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_group_of_one_adds_the_later_keys_of_each_block(case):
    _check(case, [_shard_step(0, 1, case)])


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_adds_the_later_keys_of_blocks_cut_by_the_pieces(world):
    by_rank = run_distributed(_all_cases, world)
    for case in range(len(CASES)):
        _check(case, [by_rank[r][case] for r in range(world)])


def test_a_block_without_the_shard_s_spans_is_refused():
    lengths = [9]
    cu = np.array([0, 9])
    q = k = v = torch.randn(9, 2, 8)
    local = torch.from_numpy(cu.astype(np.int32))
    out, lse = attention_block(q, k, v, local, local, 9, 9, softmax_scale=8**-0.5, causal=True)
    bare = CPShard(1, 0, None, cu, 9, local, 9)
    with pytest.raises(NotImplementedError, match="block masks"):
        with_block_keys(out, lse, q, k, v, bare, _mask(np.arange(9), [(2, 5)]), None, 8**-0.5, None)
    other = CPShard(1, 0, None, cu, 9, local, 9, blocks=np.array([[2, 5]]))
    with pytest.raises(ValueError, match="token_type_ids"):  # the model's blocks are elsewhere
        with_block_keys(out, lse, q, k, v, other, _mask(np.arange(9), [(3, 6)]), None, 8**-0.5, None)
    assert sum(lengths) == 9
