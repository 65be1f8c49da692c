"""The Trainer's side of dynamic context parallelism on vision-language models: cut without
talking. :func:`~mmbalance.integrations.hf.balance_trainer`'s collator gives every member of a CP
group the same collated batch; :class:`GroupCutter` cuts this rank's part of it (sequences, M-RoPE
positions and the :class:`~.vlm_plan.PendingMedia` of its encoder share) with no communication;
the forward pre-hook of :mod:`.media` runs that media (encode, one all-to-all of feature rows
within the group, the features to the model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import Plan
from mmbalance.balancing.cp_schedule import CPGroup

from ..encoders import adapters_for
from .families import encoder_seconds, vlm_family
from .inputs import Sequences
from .plan import pieces
from .vlm_plan import (
    PendingEntry,
    PendingMedia,
    PlaceholderRuns,
    block_spans,
    feature_segments,
    piece_coords,
    placeholder_order,
    read_alone,
    spread_items,
)

__all__ = ["GroupCutter"]


class GroupCutter:
    """Cuts this rank's part of its CP group's collated processor batch (the same batch on every
    member): the sequences, their M-RoPE positions (``get_rope_index`` on every whole sequence)
    and the :class:`PendingMedia` of this rank; items are spread over the members as
    :func:`~.vlm_step.shard_vlm` spreads them without encoder balancing."""

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
    ) -> tuple[Sequences, Tensor | None, PendingMedia, np.ndarray | None]:
        """``(sequences, M-RoPE positions or None, this member's media, the bidirectional blocks'
        spans in the group's sequences or None)``."""
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
                                             local.options[k], np.zeros(0, np.int64), None, {}))  # fmt: skip
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
            index = placeholder_order(seg, recv, streams, step.stream[k])
            entries.append(PendingEntry(adapter, payload, step.meta[k][mine], local.options[k],
                                         seg["len"][seg["src"] == group_rank], plan, index))  # fmt: skip
        blocks = None
        if self.family.has_blocks:
            blocks = block_spans(step, np.arange(n, dtype=np.int64), self.family, streams)
        return local.seqs, local.positions, PendingMedia(entries, int(degree), streams), blocks


@dataclass
class _GroupLayout:
    schedule: list
