"""Bidirectional blocks inside a dynamic context-parallel shard (Gemma 3's and Gemma 4's images,
PaliGemma's prefix of images and prompt).

Their masks let every token of a block see the whole block: causal attention, widened by the
*later* keys of the query's own block. A shard's attention runs the causal part as usual (varlen
attention for a group of one, the ring otherwise, with its log-sum-exp) and then adds each block
query's later keys as a second op call, merged by the log-sum-exps, as the packed backend does
(``attention/plan.py``'s :class:`~..attention.BlockPlan`: in reversed token order "later" becomes
causal).

Under a ring the later keys of a block may sit on other ranks of the group, so the group first
gathers the keys and values of its block tokens only (one all-gather per layer, the image
tokens: a small part of a long sequence), and the backward sums their gradients over the group
(one all-reduce) before each rank keeps its own rows.

The blocks come from the shard (:attr:`~.shard.CPShard.blocks`, spans of the group's unsplit
sequences, read from the placeholder runs or prefixes every rank gathered), not from the model's
mask: a split sequence's local rows are two pieces, whose contiguity says nothing about the
block's.
Which local rows lie in blocks is checked against the model's own mask on every call.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.collectives.inflight import run
from mmbalance.collectives.ring.plan import ring_plan

from ..attention import ATTENTION_NAME, BlockPlan, VarlenMask, add_block_keys
from .shard import CPShard

__all__ = ["ShardBlocks", "shard_blocks", "with_block_keys"]


class ShardBlocks:
    """A shard's block geometry, made once per shard (every layer shares it).

    Attributes:
        local: int64 rows of this rank's tokens that lie in a block, in local order.
        counts: block tokens per member of the group (the gather's sizes; one entry for degree 1).
        order: int64, the gathered rows (every member's ``local`` rows, member after member) in
            the order of their places in the group's sequences.
        plan: the second op call (``None`` when no query of this rank has a later key in its
            block): its ``k_index`` points into the gathered rows in that order.
    """

    def __init__(self, local: np.ndarray, counts: list[int], order: np.ndarray, plan: BlockPlan | None):
        self.local, self.counts, self.order, self.plan = local, counts, order, plan
        self.on_device: dict = {}

    def indices(self, device) -> tuple[Tensor, Tensor]:
        """``local`` and ``order`` on ``device``."""
        got = self.on_device.get(device)
        if got is None:
            got = self.on_device[device] = (
                torch.from_numpy(self.local).to(device),
                torch.from_numpy(self.order).to(device),
            )
        return got


def _runs(sorted_values: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of the maximal runs of consecutive integers in ``sorted_values``."""
    if not sorted_values.size:
        return []
    cut = np.flatnonzero(np.diff(sorted_values) != 1) + 1
    bounds = np.concatenate([[0], cut, [sorted_values.size]])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def shard_blocks(shard: CPShard, device) -> ShardBlocks:
    """The block geometry of ``shard`` (cached on it): which local rows are block tokens, what the
    group gathers, and the plan of the later keys."""
    cached = shard.__dict__.get("_blocks")
    if cached is not None:
        return cached
    spans = np.asarray(shard.blocks, dtype=np.int64).reshape(-1, 2)
    if shard.degree > 1:
        ring = ring_plan(shard.cu_seqlens, shard.degree, "zigzag")
        where = [ring.global_index(r) for r in range(shard.degree)]
    else:
        where = [np.arange(shard.tokens, dtype=np.int64)]
    starts, ends = spans[:, 0], spans[:, 1]
    if not spans.size:  # no block in the group: nothing to gather, no second call
        out = ShardBlocks(np.zeros(0, np.int64), [0] * len(where), np.zeros(0, np.int64), None)
        shard.__dict__["_blocks"] = out
        return out

    def block_of(coords: np.ndarray) -> np.ndarray:
        j = np.searchsorted(starts, coords, side="right") - 1
        inside = (j >= 0) & (coords < ends[np.maximum(j, 0)])
        return np.where(inside, j, -1)

    # the gathered block rows: every member's block tokens, in member then local order
    member_rows = [np.flatnonzero(block_of(g) >= 0) for g in where]
    gathered_coord = np.concatenate([g[rows] for g, rows in zip(where, member_rows)]).astype(np.int64)
    order = np.argsort(gathered_coord, kind="stable")
    sorted_coord = gathered_coord[order]
    mine = where[shard.group_rank]
    local = member_rows[shard.group_rank]
    q_rows: list = []
    k_rows: list = []
    q_first: list = []
    blk = block_of(mine[local])
    for b in np.unique(blk).tolist():
        e = int(ends[b])
        rows = local[blk == b]
        coords = mine[rows]
        sort = np.argsort(coords, kind="stable")
        rows, coords = rows[sort], coords[sort]
        for i, j in _runs(coords):
            qlo, qhi = int(coords[i]), int(coords[j - 1]) + 1
            if qlo + 1 >= e:
                continue  # the block's last token: no later key
            q_rows.append(rows[i:j][::-1])
            k_rows.append(np.searchsorted(sorted_coord, np.arange(e - 1, qlo, -1, dtype=np.int64)))
            q_first.append(e - qhi)  # reversed: query c at e - 1 - c, key c' at e - c' (the first at 1)
    plan = BlockPlan.from_runs(q_rows, k_rows, q_first, [1] * len(q_rows), device)
    out = ShardBlocks(local, [int(r.size) for r in member_rows], order.astype(np.int64), plan)
    shard.__dict__["_blocks"] = out
    return out


class _GatherBlockRows(torch.autograd.Function):
    """Every member's block rows, in coordinate order, on every member; backward: the group's
    summed gradient of this rank's rows."""

    @staticmethod
    def forward(ctx, rows: Tensor, counts: list[int], rank: int, order: Tensor, group):
        ctx.counts, ctx.rank, ctx.order, ctx.group = counts, rank, order, group
        buf = rows.new_zeros((max(counts), *rows.shape[1:]))
        buf[: rows.shape[0]] = rows
        parts = [torch.empty_like(buf) for _ in counts]
        run(dist.all_gather, parts, buf.contiguous(), group=group)
        cat = torch.cat([p[:n] for p, n in zip(parts, counts)])
        return cat.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        full = torch.empty_like(grad).index_copy_(0, ctx.order, grad).contiguous()
        run(dist.all_reduce, full, group=ctx.group)
        lo = sum(ctx.counts[: ctx.rank])
        return full[lo : lo + ctx.counts[ctx.rank]], None, None, None, None


def _check_mask(mask: VarlenMask, geometry: ShardBlocks, tokens: int) -> None:
    assert mask.blocks is not None
    ids = mask.blocks.detach().reshape(-1)[:tokens].cpu().numpy()
    if not np.array_equal(np.flatnonzero(ids >= 0), geometry.local):
        raise ValueError(
            f"{ATTENTION_NAME}: the model's image blocks (token_type_ids) do not match the shard's image "
            "placeholders: call the model with the kwargs handle.shard returned, unchanged"
        )


def with_block_keys(out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, shard: CPShard, mask: VarlenMask,
                    group, scale: float, softcap) -> Tensor:  # fmt: skip
    """``out`` (the shard's causal attention, ``[T, H, D]``, with its ``lse [H, T]``) with every
    block query's later keys of its block added. Every member of the group calls it (degree > 1:
    one all-gather of the group's block keys and values)."""
    if shard.blocks is None:
        raise NotImplementedError(
            f"{ATTENTION_NAME} does not run block masks (bidirectional image blocks) in a shard made without "
            "them: this model's shards come from a path that does not carry its images' blocks"
        )
    geometry = shard_blocks(shard, q.device)
    _check_mask(mask, geometry, q.shape[0])
    if not sum(geometry.counts):  # no block token in the group (a global fact: every member returns)
        return out
    local, order = geometry.indices(q.device)
    kv = torch.cat([k, v], dim=-1).index_select(0, local)
    if shard.degree > 1:  # every member, with block rows or not, joins the gather
        kv = _GatherBlockRows.apply(kv, geometry.counts, shard.group_rank, order, group)
    else:
        kv = kv.index_select(0, order)
    if geometry.plan is None:  # still in the graph: every member's backward joins the gather's all-reduce
        return out + (kv.sum() * 0).to(out.dtype) if kv.requires_grad else out
    keys, values = kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]
    return add_block_keys(out, lse, q, keys, values, geometry.plan, scale, softcap)
