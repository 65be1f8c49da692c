"""The Trainer's side of dynamic context parallelism on vision-language models: cut without
talking. :func:`~mmbalance.integrations.hf.balance_trainer`'s collator gives every member of a CP
group the same collated batch; :class:`GroupCutter` cuts this rank's part of it (sequences, M-RoPE
positions and the :class:`PendingMedia` of its encoder share) with no communication, and the forward
pre-hook that :func:`install_media_hook` installs runs it (:func:`resolve_media`): encode, one
all-to-all of feature rows within the group, the features to the model. A plain loop's
:meth:`~.dynamic_cp.DynamicCPHandle.shard` leaves the same :class:`PendingMedia` to the forward
under FSDP2 (:mod:`.dynamic_cp_vlm_step`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import Plan
from mmbalance.collectives import rebalance
from mmbalance.collectives.group import comm_device
from mmbalance.pyops import cu_seqlens_from_lengths

from .balance import ZeroLink
from .cp_attention import CP_KEYWORD, MEDIA_KEYWORD
from .cp_plan import Sequences, model_device, pieces
from .dynamic_cp_vlm import check_feature_rows, encoder_seconds, place_embedded, vlm_family
from .dynamic_cp_vlm_plan import PlaceholderRuns, feature_segments, piece_coords, read_alone, spread_items
from .encoder_adapter import EncoderAdapter, adapters_for
from .models.common import core, pooled

__all__ = [
    "MEDIA_KEYWORD",
    "GroupCutter",
    "PendingEntry",
    "PendingMedia",
    "install_media_hook",
    "remove_media_hook",
    "resolve_media",
]


@dataclass
class PendingEntry:
    """One encoder's part of a :class:`PendingMedia`."""

    adapter: EncoderAdapter
    payload: list[Tensor]  # inputs of the items this rank encodes, in order
    meta: np.ndarray  # their metadata
    options: dict
    segments: np.ndarray  # rows of this rank's outputs per segment it sends, in order
    plan: Plan | None  # the feature move (over the group's ranks; the world's under encoder balancing)
    index: dict[str, Tensor]  # stream -> rows of the received buffer, in the shard's placeholder order
    rows: int  # input rows this rank encodes


@dataclass(eq=False)
class PendingMedia:
    """The encoder work of one shard that :func:`~mmbalance.integrations.hf.balance_trainer`'s
    collator leaves for the forward (the collator cuts shards without communication): every rank
    encodes its share of its CP group's items (a stand-in where it has none), and one all-to-all
    over the group sends the feature rows to the members holding their placeholders. The forward
    pre-hook :func:`resolve_media` runs it. A plain loop's ``shard`` under FSDP2 leaves one too,
    with the communicator of its feature move (``mover``: the CP group's, or the world's under
    encoder balancing)."""

    entries: list[PendingEntry]
    degree: int
    streams: list[tuple[str, int]]
    mover: Any = None  # ``.move(tensors, rows per segment, plan)``; None: over the shard's ring group

    def __repr__(self) -> str:
        return f"PendingMedia(degree={self.degree}, items={[int(e.meta.shape[0]) for e in self.entries]})"


class GroupCutter:
    """Cuts this rank's part of its CP group's collated processor batch (the same batch on every
    member): the sequences, their M-RoPE positions (``get_rope_index`` on every whole sequence)
    and the :class:`PendingMedia` of this rank; items are spread over the members as
    :func:`~.dynamic_cp_vlm_step.shard_vlm` spreads them without encoder balancing."""

    def __init__(self, model, cost, encoder_cost="auto"):
        family = vlm_family(model)
        if family is None:
            raise ValueError(f"model: {type(model).__name__} is not a vision-language model GroupCutter cuts")
        self.model = model
        self.family = family
        self.cost = cost
        self.encoder_cost = encoder_cost
        self.adapters = adapters_for(model)

    def cut(
        self, batch: Mapping, degree: int, group_rank: int
    ) -> tuple[Sequences, Tensor | None, PendingMedia]:
        from mmbalance.balancing.cp_schedule import CPGroup

        local, step = read_alone(self, self.family, self.adapters, batch)
        adapters = self.adapters
        n = step.lengths.size
        group = CPGroup(int(degree), tuple(range(degree)), np.arange(n, dtype=np.int64), 0.0)
        plen, _, pdst, _ = pieces(step.lengths, np.zeros(n, dtype=np.int64), [group], degree)
        piece_seq, piece_off = piece_coords(step.lengths, plen)
        runs = PlaceholderRuns(step, n)
        layout = _GroupLayout([group])
        load = np.zeros(degree)
        streams = self.family.streams(self.model)
        entries = []
        for k, adapter in enumerate(adapters):
            got = local.items[k]
            n_items = step.seq[k].size
            empty = adapter.empty_payload(self.model)
            if not n_items or got is None:
                entries.append(PendingEntry(adapter, empty, np.zeros((0, len(adapter.meta_columns)), np.int64),
                                             local.options[k], np.zeros(0, np.int64), None, {}, 0))  # fmt: skip
                continue
            seconds = encoder_seconds(self, self.family, adapter, step.meta[k], step.rows[k])
            enc = spread_items(step, k, layout, seconds, load)
            slot = np.zeros(n_items, dtype=np.int64)
            for e in range(degree):
                of = np.flatnonzero(enc == e)
                slot[of] = np.arange(of.size)
            seg = feature_segments(step, k, runs, piece_seq, piece_off, plen, pdst, enc, slot)
            plan = Plan.from_destinations(seg["len"], seg["dst"], degree, seg["src"])
            mine = np.flatnonzero(enc == group_rank)
            starts = np.concatenate([[0], np.cumsum(got.rows)]).astype(np.int64)
            spans = [np.arange(starts[i], starts[i + 1]) for i in mine.tolist()]
            take = torch.from_numpy(np.concatenate(spans + [np.zeros(0, np.int64)]).astype(np.int64))
            payload = [t.index_select(0, take) for t in got.payload]
            recv = plan.recv_order(group_rank)
            offs = np.concatenate([[0], np.cumsum(seg["len"][recv])]).astype(np.int64)
            index = {}
            for st in np.unique(step.stream[k]).tolist():
                sel = np.flatnonzero(seg["stream"][recv] == st)
                if sel.size:
                    sel = sel[np.lexsort((seg["row"][recv][sel], seg["piece"][recv][sel]))]
                    index[streams[st][0]] = torch.from_numpy(
                        np.concatenate([np.arange(offs[j], offs[j + 1]) for j in sel.tolist()])
                    )
            entries.append(PendingEntry(adapter, payload, step.meta[k][mine], local.options[k],
                                         seg["len"][seg["src"] == group_rank], plan, index,
                                         int(step.rows[k][mine].sum())))  # fmt: skip
        return local.seqs, local.positions, PendingMedia(entries, int(degree), streams)


@dataclass
class _GroupLayout:
    schedule: list


def resolve_media(model, kwargs: dict) -> dict:
    """The forward's part of a :class:`PendingMedia` in ``kwargs``: encode, exchange within the CP
    group (or along ``mover``), and give the features to the model (``mm_encoder_outputs``), with the anchor that keeps
    every member's backward in the exchange. Returns the new keywords."""
    pending = kwargs.pop(MEDIA_KEYWORD, None)
    if pending is None:
        return kwargs
    if not isinstance(pending, PendingMedia):
        raise TypeError(f"{MEDIA_KEYWORD} must be a PendingMedia (from balance_trainer's collator)")
    shard = kwargs.get(CP_KEYWORD)
    group = shard.process_group() if shard is not None else None
    device = model_device(model)
    tower = model_device(core(model))
    mm: dict[str, object] = dict(kwargs.get("mm_encoder_outputs") or {})
    links: list[Tensor] = []
    for e in pending.entries:
        if e.meta.shape[0]:
            outputs = e.adapter.encode(model, [t.to(tower) for t in e.payload], e.meta, **e.options)
        else:  # a stand-in item: every rank runs the encoder once, whatever its share
            d_payload, d_meta = e.adapter.dummy(model)
            dummy = e.adapter.encode(model, d_payload, d_meta, **e.options)
            links.extend(dummy)
            outputs = [t[:0] for t in dummy]
        if e.plan is None:
            continue
        if int(e.segments.sum()) != int(outputs[0].shape[0]):
            raise AssertionError("the encoder outputs do not match the feature move")  # a planner bug
        if pending.mover is not None:
            received = pending.mover.move(outputs, e.segments, e.plan)
        elif pending.degree > 1:
            comm = comm_device(group)
            cu = cu_seqlens_from_lengths(e.segments.astype(np.int64), device=comm)
            received, _ = rebalance([t.to(comm) for t in outputs], cu, e.plan, group)
        else:
            received = outputs
        links.extend(received)
        for name, index in e.index.items():
            idx = index.to(received[0].device)
            feats = [t.index_select(0, idx).to(device) for t in received]
            mm[name] = pooled((feats[0],), [(f,) for f in feats[1:]] if len(feats) > 1 else None)
    ids = kwargs.get("input_ids")
    if ids is not None:
        check_feature_rows(ids, pending.streams, mm)
    if mm:
        kwargs["mm_encoder_outputs"] = mm
        family = vlm_family(model)
        if family is not None:  # streams the model reads from its input embeddings (Omni's audio)
            kwargs = place_embedded(family, model, (), kwargs)
    links = [t for t in links if t.requires_grad]
    if links and shard is not None:
        shard.anchor = ZeroLink.apply(*links)
    return kwargs


def install_media_hook(model) -> bool:
    """Make ``model``'s forward resolve :class:`PendingMedia`: a forward pre-hook, so DDP and the
    other wrappers call it, and the forward's signature stays the model's; kept out of compiled
    graphs (it runs collectives and numpy). Idempotent: returns whether this call installed it."""
    if getattr(model, "_mmbalance_media_hook", None) is not None:
        return False

    @torch.compiler.disable
    def hook(module, args, kwargs):
        if MEDIA_KEYWORD not in kwargs:
            return None
        return args, resolve_media(module, dict(kwargs))

    model._mmbalance_media_hook = model.register_forward_pre_hook(hook, with_kwargs=True)
    return True


def remove_media_hook(model) -> None:
    """Undo :func:`install_media_hook` (idempotent)."""
    handle = model.__dict__.pop("_mmbalance_media_hook", None)
    if handle is not None:
        handle.remove()
