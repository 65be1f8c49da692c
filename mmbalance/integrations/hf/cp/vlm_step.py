"""One vision-language step of dynamic context parallelism: :func:`shard_vlm`, what
:meth:`DynamicCPHandle.shard` runs for the models of :mod:`.families` (the step is described
there): the agreement and the gathered table, the plan, the token move, the encoder inputs' move,
one encoder call per rank, the feature move to the shards, the shard's keywords and statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import CostModel, Plan, imbalance
from mmbalance.collectives import rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.exchange.alltoall import gather_table
from mmbalance.collectives.group import comm_device
from mmbalance.pyops import cu_seqlens_from_lengths

from ..attention import CP_KEYWORD
from ..compat import loss_takes_token_count
from ..encoders import EncoderAdapter, ZeroLink, core, encoder_balance_of, encoder_plan
from .families import encoder_seconds
from .family import VLMFamily, check_feature_rows
from .inputs import IGNORE, check_attention, model_device, pad_id, positions
from .plan import cost_key, labels_of, plan_layout, shard_of, step_stats
from .shard import MEDIA_KEYWORD, idle_shard, in_blocks
from .vlm_plan import (
    GatheredStep,
    LocalBatch,
    PendingEntry,
    PendingMedia,
    PlaceholderRuns,
    block_spans,
    feature_segments,
    local_table,
    parse_table,
    piece_coords,
    placeholder_order,
    read_alone,
    read_batch,
    spread_items,
    table_width,
)

__all__ = ["shard_vlm"]


# ---------------------------------------------------------------------------------------- moves
class _Comm:
    """The step's collectives over a process group (the handle's, or a CP group's), or their
    one-process identities (``None``: one rank, or a rank whose CP group is itself)."""

    def __init__(self, own):
        self.own = own
        self.rank = dist.get_rank(own) if own is not None else 0
        self.world = dist.get_world_size(own) if own is not None else 1
        self.device = comm_device(own) if own is not None else torch.device("cpu")

    def within(self, layout, groups: dict) -> tuple[_Comm, np.ndarray]:
        """The communicator of this rank's CP group, and the group's ranks (in the handle's
        numbering; empty for a rank in no group): the feature move stays inside the group, so a
        group starts its LLM phase when its own members have encoded, not when the whole world has."""
        if self.own is None:
            return self, np.zeros(1, dtype=np.int64)
        gi = int(layout.group_of_rank[self.rank])
        if gi < 0:
            return _Comm(None), np.zeros(0, dtype=np.int64)
        ranks = np.asarray(layout.schedule[gi].ranks, dtype=np.int64)
        return (_Comm(groups[gi]) if ranks.size > 1 else _Comm(None)), ranks

    def move(self, tensors: list[Tensor], lengths: np.ndarray, plan: Plan) -> list[Tensor]:
        """``rebalance`` of ``tensors`` (this rank's examples of ``lengths`` rows) along ``plan``."""
        if self.own is None:  # one rank: every plan keeps the order
            if not np.array_equal(plan.recv_order(0), np.arange(plan.num_examples)):
                raise AssertionError("a one-rank plan reorders its examples")
            return list(tensors)
        moved = [t.to(self.device) for t in tensors]
        cu = cu_seqlens_from_lengths(lengths.astype(np.int64), device=self.device)
        out, _ = rebalance(moved, cu, plan, self.own)
        return list(out)


def _gather(handle, family: VLMFamily, adapters: list[EncoderAdapter], batch: Mapping, eh, comm: _Comm,
            defer: bool):  # fmt: skip
    """This rank's batch read, the agreement, and the gathered table: ``(local, step)``."""
    model = handle.model
    if handle.own is None:
        check_attention(model)
        return read_alone(handle, family, adapters, batch)
    own_ranks = tuple(dist.get_process_group_ranks(handle.own))
    enc_ranks = None if eh is None else tuple(dist.get_process_group_ranks(eh.group))
    found: LocalBatch | None = None
    table_in = None
    with Entry("apply_dynamic_cp.shard", handle.own) as e:
        e.fields = {
            "max_tokens_per_rank": handle.max_tokens_per_rank,
            "cost": cost_key(handle.cost),
            "model": type(model).__name__,
            "encoder balance": enc_ranks,
            "encoders in the forward (FSDP2)": defer,
            "adapters": [f"{type(a).__name__}(split_frames={a.splits_frames})" for a in adapters],
        }
        check_attention(model)
        if enc_ranks is not None and enc_ranks != own_ranks:
            raise ValueError(
                "group: apply_encoder_balance on this model balances over other ranks than apply_dynamic_cp; "
                "give both the same group"
            )
        found = read_batch(handle, family, adapters, batch)
        e.fields["encoder options"] = repr([sorted(o.items()) for o in found.options])
        table_in = local_table(found, table_width(adapters))
    table, src = gather_table(table_in, handle.own, entry=e)
    assert found is not None  # a rank whose batch failed has raised in gather_table
    return found, parse_table(table, src, comm.world, adapters)


@dataclass
class _Media:
    """What the media moves leave on this rank."""

    mm: dict[str, object]  # mm_encoder_outputs
    links: list[Tensor]  # what the anchor ties into every rank's backward
    load: np.ndarray  # modelled encoder seconds per rank, as planned
    home: np.ndarray  # ... as sampled (every rank encoding its own media)
    split_items: dict[str, int]
    encoded_rows: int
    encoders: dict[str, dict]
    pending: list[PendingEntry]  # the encoder work left for the forward (``defer``)
    degree: int  # this rank's CP group's size (0: a rank in no group)
    mover: _Comm  # the feature move's communicator (the CP group's, or the world's under encoder balancing)


def _media(handle, family: VLMFamily, adapters, local: LocalBatch, step: GatheredStep, layout, groups, seconds,
           eh, comm: _Comm, defer: bool) -> _Media:  # fmt: skip
    """Encode every item once and send its feature rows to the shards of its placeholders; with
    ``defer``, only the encoder inputs move now, and the encoding and the feature move are left to
    the model's forward (:attr:`_Media.pending`)."""
    model = handle.model
    rank, world = comm.rank, comm.world
    inner, members = comm.within(layout, groups)
    device = model_device(model)
    streams = family.streams(model)
    piece_seq, piece_off = piece_coords(step.lengths, layout.piece_len)
    runs = PlaceholderRuns(step, step.lengths.size)
    res = _Media(
        {},
        [],
        np.zeros(world),
        np.zeros(world),
        {},
        0,
        {},
        [],
        int(members.size),
        inner if eh is None else comm,
    )
    for k, adapter in enumerate(adapters):
        n_items = step.seq[k].size
        if not n_items:  # no rank has an item of this encoder: nobody runs it
            continue
        rows = step.rows[k]
        if eh is not None:  # the encoder balancing's plan, over the whole world
            costs = eh.item_costs(adapter, step.meta[k], rows)
            pix_plan = encoder_plan(costs, step.src[k], world, eh.ranks_per_node)[0].with_lengths(rows)
            enc = pix_plan.dst_rank
            np.add.at(res.load, enc, seconds[k])
        else:  # each group encodes its own sequences' items
            enc = spread_items(step, k, layout, seconds[k], res.load)
            pix_plan = Plan.from_destinations(rows, enc, world, step.src[k])
        np.add.at(res.home, step.src[k], seconds[k])
        slot = np.zeros(n_items, dtype=np.int64)
        for r in range(world):
            o = pix_plan.recv_order(r)
            slot[o] = np.arange(o.size)
        got = local.items[k]
        pay = got.payload if got is not None else adapter.empty_payload(model)
        my_rows = got.rows if got is not None else np.zeros(0, dtype=np.int64)
        moved = comm.move(pay, my_rows, pix_plan)
        recv = pix_plan.recv_order(rank)
        opts = local.options[k]
        seg = feature_segments(
            step, k, runs, piece_seq, piece_off, layout.piece_len, layout.piece_dst, enc, slot
        )
        mine = seg["src"] == rank
        # the feature move, planned before encoding (the encoder outputs follow ``seg[mine]``)
        if eh is not None:  # items were dealt over the world: the rows move over the world
            feat_plan = Plan.from_destinations(seg["len"], seg["dst"], world, seg["src"])
            got_seg = feat_plan.recv_order(rank)
        else:  # encoded inside the group: the rows move inside it
            local_of = np.full(world, -1, dtype=np.int64)
            local_of[members] = np.arange(members.size)
            ours = np.flatnonzero(np.isin(seg["src"], members))
            if (local_of[seg["dst"][ours]] < 0).any():
                raise AssertionError("a feature row leaves its CP group")  # a planner bug
            feat_plan = Plan.from_destinations(
                seg["len"][ours], local_of[seg["dst"][ours]], max(members.size, 1), local_of[seg["src"][ours]]
            )
            if inner.own is not None and inner.rank != int(local_of[rank]):
                raise AssertionError("a CP group's process group numbers its ranks out of order")
            got_seg = ours[feat_plan.recv_order(inner.rank)] if members.size else ours
        # the received rows of every stream, in the order of the shard's placeholders
        index = placeholder_order(seg, got_seg, streams, step.stream[k])
        res.encoded_rows += int(rows[recv].sum())
        if defer:  # encode and move the rows in the model's forward (FSDP2 gathers the towers there)
            res.pending.append(PendingEntry(adapter, list(moved), step.meta[k][recv], opts, seg["len"][mine],
                                             feat_plan, index))  # fmt: skip
        else:
            if recv.size:
                tower = model_device(core(model))
                outputs = adapter.encode(model, [t.to(tower) for t in moved], step.meta[k][recv], **opts)
            else:  # nothing to encode here: a tiny item keeps the encoder calls equal on every rank
                d_payload, d_meta = adapter.dummy(model)
                dummy_out = adapter.encode(model, d_payload, d_meta, **opts)
                res.links.extend(dummy_out)
                outputs = [t[:0] for t in dummy_out]
            if int(seg["len"][mine].sum()) != int(outputs[0].shape[0]):
                raise AssertionError("the encoder outputs do not match the feature move")  # a planner bug
            received = res.mover.move(outputs, seg["len"][mine], feat_plan)
            res.links.extend(received)
            for name, idx in index.items():
                feats = [t.index_select(0, idx.to(t.device)).to(device) for t in received]
                deep = [(f,) for f in feats[1:]] if len(feats) > 1 else None
                res.mm[name] = family.entry(feats[0], deep, name)
        for st in np.unique(step.stream[k]).tolist():  # items whose rows reach more than one rank
            of = seg["stream"] == st
            pairs = np.unique(np.stack([seg["src"][of], seg["slot"][of], seg["dst"][of]], 1), axis=0)
            _, ranks_per_item = np.unique(pairs[:, :2], axis=0, return_counts=True)
            name = streams[st][0]
            res.split_items[name] = res.split_items.get(name, 0) + int((ranks_per_item > 1).sum())
        mine_home = np.bincount(step.src[k], weights=seconds[k], minlength=world)
        mine_load = np.bincount(enc, weights=seconds[k], minlength=world)
        res.encoders[adapter.encoder] = {
            "items": int(n_items), "rows": int(rows.sum()), "before": imbalance(mine_home), "after": imbalance(mine_load),
        }  # fmt: skip
    return res


def _under_fsdp2(model) -> bool:
    """Whether ``model`` is under FSDP2, which gathers a unit's weights only once the root's
    forward has begun: ``shard`` then leaves the encoders to the model's forward (the pending
    media)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_vlm(handle, batch: Mapping) -> dict:
    """:meth:`DynamicCPHandle.shard` for a vision-language model (see the module docstring)."""
    model = handle.model
    family: VLMFamily = handle.vlm
    comm = _Comm(handle.own)
    rank, world = comm.rank, comm.world
    eh = encoder_balance_of(model)
    defer = _under_fsdp2(model)
    adapters = list(eh.adapters.values()) if eh is not None else handle.adapters
    local, step = _gather(handle, family, adapters, batch, eh, comm, defer)
    lengths, labelled = step.lengths, step.labelled
    has_labels = labels_of(step.has_labels, step.seq_src, local.seqs.has_labels)  # before anything moves
    if has_labels and not loss_takes_token_count(model):  # a global fact: every rank refuses alike
        raise ValueError(
            f"batch['labels']: {type(model).__name__} on the installed transformers computes its loss "
            "itself, a mean over each call with the labels shifted inside it, so a shard's loss would be wrong (a "
            "split sequence's labels cross the shards, and the step's token count is ignored); use a release "
            "whose forward takes the shard's shift_labels and num_items_in_batch (Gemma 3: 5.17 on)"
        )

    # ---- the plan: CP groups under the budget, with the encoder phase in the cost
    seconds = [
        encoder_seconds(handle, family, a, step.meta[k], step.rows[k]) if step.rows[k].size else np.zeros(0)
        for k, a in enumerate(adapters)
    ]
    enc_seq = np.zeros(lengths.size)
    for k in range(len(adapters)):
        np.add.at(enc_seq, step.seq[k], seconds[k])
    cost = handle.cost
    shares: list[np.ndarray | None] = [None]
    if enc_seq.any() and eh is None and handle.encoder_cost is not None and isinstance(cost, CostModel):
        # each group encodes its own media and keeps the feature rows inside it, so a group's time
        # is its members' encoder share plus its LLM time: of the plans with that share in each
        # group's time and on the LLM cost alone, the faster under that sum
        shares = [enc_seq, None]
    layouts, refusals = [], []
    for e in shares:  # the plans that fit (the encoder's share may leave none with it, one without)
        try:
            layouts.append(plan_layout(
                lengths, step.seq_src, world, handle.max_tokens_per_rank, cost, handle.context_parallel, e
            ))  # fmt: skip
        except ValueError as exc:
            refusals.append(exc)
    if not layouts:
        raise refusals[0]
    layout = layouts[0]
    if len(layouts) > 1:
        layout = min(
            layouts, key=lambda lay: cost.step_with_encoders(lay.schedule, lengths, enc_seq, exchange="group")
        )
        layout = dataclasses.replace(layout, plan_s=sum(lay.plan_s for lay in layouts))
    groups = handle.groups.of(layout) if handle.own is not None else {}

    # ---- the token columns to their pieces
    seqs = local.seqs
    cols = [seqs.input_ids, seqs.labels, seqs.shift_labels, positions(seqs.lengths)]
    if family.mrope:
        assert local.positions is not None
        cols += [local.positions[:, j] for j in range(3)]
    plan = Plan.from_destinations(layout.piece_len, layout.piece_dst, world, layout.piece_src)
    out = comm.move([torch.stack(cols, dim=1)], layout.piece_len[layout.piece_src == rank], plan)[0].cpu()

    # ---- the media, then the shard
    media = _media(handle, family, adapters, local, step, layout, groups, seconds, eh, comm, defer)
    mm = media.mm
    shard = shard_of(layout, lengths, rank, groups, int(out.shape[0]))
    if shard is None:
        shard = idle_shard()
        stand_in = [pad_id(model), IGNORE, IGNORE, 0] + ([0, 0, 0] if family.mrope else [])
        out = torch.tensor([stand_in], dtype=torch.int64)
        if family.has_blocks:
            shard.blocks = np.zeros((0, 2), dtype=np.int64)
    elif family.has_blocks:  # the blocks' spans in the group's sequences (the shard's attention)
        group = layout.schedule[int(layout.group_of_rank[rank])]
        members = np.asarray(group.sequences, dtype=np.int64)
        shard.blocks = block_spans(step, members, family, family.streams(model))
    if not defer:  # (deferred: the forward checks them when it has them)
        check_feature_rows(out[:, 0], family.streams(model), mm)
    links = [t for t in media.links if t.requires_grad]
    if links and handle.own is not None:
        shard.anchor = ZeroLink.apply(*links)

    # ---- stats: modelled LLM time (the handle's cost) plus every rank's encoder seconds
    before, after = _modelled(handle.cost, lengths, step.seq_src, layout, world)
    if before is not None and after is not None:
        before, after = before + media.home, after + media.load
    handle.stats = step_stats(
        handle.cost, lengths, step.seq_src, labelled, layout, world, plan, before, after
    )
    handle.stats["encoders"] = media.encoders
    handle.stats["split_items"] = media.split_items
    handle.stats["encoded_rows"] = media.encoded_rows
    handle.stats["local_sequences"] = int(seqs.lengths.size)

    out = out.to(model_device(model))
    kw: dict = {"input_ids": out[:, 0].unsqueeze(0), "use_cache": False, CP_KEYWORD: shard}
    if family.mrope:
        kw["position_ids"] = out[:, 3:7].t().contiguous().unsqueeze(1)  # [4, 1, T]: text, t, h, w
    else:
        kw["position_ids"] = out[:, 3].unsqueeze(0)
    if family.has_blocks:  # the model builds its block mask from them
        kw.update(family.block_keywords(model, kw["input_ids"], torch.from_numpy(in_blocks(shard))))
    kw.update(family.token_keywords(model, kw["input_ids"]))
    if mm:
        kw["mm_encoder_outputs"] = mm
    if media.pending:  # the handle installs the media hook that resolves it
        kw[MEDIA_KEYWORD] = PendingMedia(media.pending, media.degree, family.streams(model), media.mover)
    if has_labels:
        kw["labels"] = out[:, 1].unsqueeze(0)
        kw["shift_labels"] = out[:, 2].unsqueeze(0)
        kw["num_items_in_batch"] = int(labelled.sum())
    return kw


def _modelled(cost, lengths, src, layout, world):
    """Modelled LLM time per rank as sampled and as planned, with a :class:`CostModel` (else
    ``(None, None)``: the handle's own statistics)."""
    if not isinstance(cost, CostModel):
        return None, None
    before = np.array([cost.time(lengths[src == r]) if (src == r).any() else 0.0 for r in range(world)])
    after = np.zeros(world)
    for g in layout.schedule:
        t = cost.time(lengths[np.asarray(g.sequences, dtype=np.int64)], g.degree)
        for r in g.ranks:
            after[r] = t
    return before, after
