"""One text step of dynamic context parallelism: :func:`shard_text`, what
:meth:`~.handle.DynamicCPHandle.shard` runs for a text decoder. Every rank reads its batch into
sequences, the lengths are gathered (with the agreement, so a bad batch raises on every rank), every
rank computes the same plan (:func:`~.plan.plan_layout`) and one all-to-all moves every zigzag piece
straight to the rank that holds it (:func:`~mmbalance.collectives.rebalance`); the rank's shard and
model keywords come out. :class:`RingGroups` holds the process groups of the plans' CP groups.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import CostModel, Plan
from mmbalance.collectives import GroupPool, rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.exchange.alltoall import gather_table
from mmbalance.collectives.group import comm_device
from mmbalance.collectives.inflight import gather_objects

from ..attention import CP_KEYWORD
from .inputs import IGNORE, Sequences, check_attention, model_device, pad_id, positions, split_sequences
from .plan import Layout, cost_key, labels_of, plan_layout, shard_of, step_stats
from .shard import CPShard, idle_shard

__all__ = ["RingGroups", "model_kwargs", "shard_text"]


class RingGroups:
    """The process groups of a handle's CP groups: one per rank set, created once (in the same
    order on every rank, as ``new_group`` needs) and reused; a group of every rank runs on the
    handle's own communicator, never on DDP's."""

    def __init__(self, own, pool: GroupPool):
        self.own = own
        self.pool = pool
        self.groups: dict[tuple[int, ...], object] = {}

    def of(self, layout: Layout) -> dict[int, object]:
        """The process group of every group of degree > 1 of ``layout``, by its index."""
        base_ranks = dist.get_process_group_ranks(self.own)
        wanted = {}
        for gi, g in enumerate(layout.schedule):
            if g.degree > 1:
                wanted[gi] = tuple(base_ranks[r] for r in g.ranks)
        new = [r for r in wanted.values() if r not in self.groups and len(r) < len(base_ranks)]
        if len(base_ranks) < dist.get_world_size():
            # new_group is collective over the world: every rank creates every rank set any
            # data-parallel group needs, in one order
            new = sorted({r for sets in gather_objects(new) for r in sets})
        for ranks in new:
            if ranks not in self.groups:
                self.groups[ranks] = self.pool.get(ranks)
        return {gi: self.own if len(r) == len(base_ranks) else self.groups[r] for gi, r in wanted.items()}


def model_kwargs(out: Tensor, shard: CPShard, items: int, has_labels: bool, device) -> dict:
    """The model keywords of a shard from its moved token columns ``out [T, 4]`` (ids, labels,
    shifted labels, positions)."""
    out = out.to(device)
    kw = {
        "input_ids": out[:, 0].unsqueeze(0),
        "position_ids": out[:, 3].unsqueeze(0),
        "use_cache": False,
        CP_KEYWORD: shard,
    }
    if has_labels:
        kw["labels"] = out[:, 1].unsqueeze(0)
        kw["shift_labels"] = out[:, 2].unsqueeze(0)
        kw["num_items_in_batch"] = items
    return kw


def shard_text(handle, batch: Mapping) -> dict:
    """:meth:`~.handle.DynamicCPHandle.shard` of a text model: this rank's model keywords; sets
    ``handle.stats``."""
    device = model_device(handle.model)
    seqs: Sequences | None = None
    if handle.own is None:  # one process: every sequence whole, on this rank
        return shard_alone(handle, split_sequences(batch), device)
    world = dist.get_world_size(handle.own)
    with Entry("apply_dynamic_cp.shard", handle.own) as e:
        e.fields = {"max_tokens_per_rank": handle.max_tokens_per_rank, "cost": cost_key(handle.cost)}
        check_attention(handle.model)
        seqs = split_sequences(batch)
    table_in = None
    if seqs is not None:
        flag = np.full(seqs.lengths.size, int(seqs.has_labels), dtype=np.int64)
        table_in = np.stack([seqs.lengths, seqs.labelled, flag], axis=1)
    table, src = gather_table(table_in, handle.own, entry=e)
    assert seqs is not None
    lengths, labelled = table[:, 0], table[:, 1]
    has_labels = labels_of(table[:, 2], src, seqs.has_labels)
    layout = plan_layout(
        lengths, src, world, handle.max_tokens_per_rank, handle.cost, handle.context_parallel
    )
    rank = dist.get_rank(handle.own)
    groups = handle.groups.of(layout)
    payload = torch.stack([seqs.input_ids, seqs.labels, seqs.shift_labels, positions(seqs.lengths)], dim=1)
    mine = layout.piece_src == rank
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(layout.piece_len[mine])]).astype(np.int64))
    plan = Plan.from_destinations(layout.piece_len, layout.piece_dst, world, layout.piece_src)
    comm = comm_device(handle.own)
    out, _ = rebalance(payload.to(comm), cu.to(comm), plan, handle.own)
    out = out.cpu()
    shard = shard_of(layout, lengths, rank, groups, int(out.shape[0]))
    if shard is None:
        shard = idle_shard()
        out = torch.tensor([[pad_id(handle.model), IGNORE, IGNORE, 0]], dtype=torch.int64)
    handle.stats = step_stats(handle.cost, lengths, src, labelled, layout, world, plan)
    handle.stats["local_sequences"] = int(seqs.lengths.size)
    return model_kwargs(out, shard, int(labelled.sum()), has_labels, device)


def shard_alone(handle, seqs: Sequences, device) -> dict:
    """One process: every sequence whole, on this rank (degree 1)."""
    check_attention(handle.model)
    lengths = seqs.lengths
    budget = handle.max_tokens_per_rank
    if budget is not None and int(lengths.sum()) > budget:
        raise ValueError(
            f"max_tokens_per_rank={budget}: one process holds all {int(lengths.sum())} tokens of the batch"
        )
    payload = torch.stack([seqs.input_ids, seqs.labels, seqs.shift_labels, positions(lengths)], dim=1)
    if not lengths.size:
        payload = torch.tensor([[pad_id(handle.model), IGNORE, IGNORE, 0]], dtype=torch.int64)
        lengths = np.array([1], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    shard = CPShard(1, 0, None, cu, int(cu[-1]), torch.from_numpy(cu.astype(np.int32)), int(lengths.max()))
    t = handle.cost.time(seqs.lengths) if isinstance(handle.cost, CostModel) else 0.0
    handle.stats = {
        "degrees": [1], "largest_shard": int(cu[-1]), "before": 1.0, "after": 1.0, "max_before": t,
        "mean_before": t, "max_after": t, "mean_after": t, "moved_tokens": 0, "plan_ms": 0.0,
        "sequences": int(seqs.lengths.size), "num_items_in_batch": int(seqs.labelled.sum()),
        "local_sequences": int(seqs.lengths.size),
    }  # fmt: skip
    return model_kwargs(payload, shard, int(seqs.labelled.sum()), seqs.has_labels, device)
