"""The data side of dynamic context parallelism in transformers' ``Trainer`` on map-style data
(``balance_trainer(..., context_parallel=True)``; streams are in ``stream.py``).

:class:`CPBatchSampler`: every rank computes the same epoch plan as
:class:`~mmbalance.integrations.data.BalancedBatchSampler` (the same examples in every optimizer
step, split into its ``gradient_accumulation_steps`` micro-batch slots: the sampler's balanced
ones where each can be laid out under ``max_tokens_per_rank``, else re-formed under that limit,
:func:`~.slots.plan_slots`), then schedules each slot's examples with the dynamic-CP planner
(:func:`~.plan.plan_layout`: CP groups of any degree under ``max_tokens_per_rank``). Every rank loads only its group's examples, whole, and its
collator cuts this rank's zigzag shard out of them (:class:`CPCollator`): nothing is exchanged,
and the batch the model gets is already the shard, so Trainer counts the step's labelled tokens
(``shift_labels``) on the shards, once each. For a vision-language model the collator also gives
the M-RoPE positions of the whole sequences and the encoder work of this rank
(:class:`~.vlm_plan.PendingMedia`), which a forward pre-hook runs (:mod:`.media`): every image and
frame is encoded by one member of its group, and one all-to-all over the group moves the feature
rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mmbalance.collectives.ring.plan import ring_plan
from mmbalance.integrations.data import BalancedBatchSampler

from ..attention import CP_KEYWORD
from .inputs import IGNORE, split_sequences
from .plan import layout_fits
from .shard import MEDIA_KEYWORD, CPShard, in_blocks
from .slots import plan_slots

__all__ = ["CPBatchSampler", "CPCollator", "SlotMeta", "TaggedDataset"]


@dataclass(frozen=True)
class SlotMeta:
    """This rank's place in one micro-batch slot: its group's degree, its index in the group, the
    group's ranks, and every group of degree > 1 of the slot (to create them in one order)."""

    degree: int
    group_rank: int
    ranks: tuple[int, ...]
    step_groups: tuple[tuple[int, ...], ...]
    idle: bool = False


class CPBatchSampler(Sampler[list]):
    """Per-rank micro-batches of ``(dataset index, SlotMeta)`` pairs: this rank's CP group's
    examples of every slot, whole, in sampling order (the same list on every rank of the group).

    ``base`` gives the steps and slots (its epoch plan); ``max_tokens_per_rank`` and ``cost``
    (a :class:`~mmbalance.balancing.CostModel` or callable) the CP schedule of each slot.
    ``len()`` and ``set_epoch`` are ``base``'s. :attr:`stats` holds the last slot's ``degrees``
    and ``largest_shard``.
    """

    def __init__(self, base: BalancedBatchSampler, max_tokens_per_rank: int, cost):
        self.base = base
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.cost = cost
        self.stats: dict = {}
        self._cache: tuple[int, list[tuple]] | None = None

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.base)

    def slots(self) -> list[tuple]:
        """Every slot of the epoch: ``(example indices in sampling order, layout)`` (all ranks).

        The whole epoch is planned at once when it starts (the seeded order is known then), so a
        step that cannot fit is refused before the epoch's first step, never in its middle. Each
        step keeps its examples; its micro-batch slots are the sampler's balanced ones where every
        slot can be laid out under ``max_tokens_per_rank``, else re-formed under that limit
        (:func:`~.slots.plan_slots`)."""
        if self._cache is not None and self._cache[0] == self.base.epoch:
            return self._cache[1]
        plan = self.base.plan_epoch()
        out = []
        for s in range(self.base.num_steps):
            out.extend(self._step_slots(s, plan.indices[s], plan.micro[s]))
        self._cache = (self.base.epoch, out)
        return out

    def _step_slots(self, s: int, idx: np.ndarray, micro: np.ndarray) -> list[tuple]:
        """The ``(indices, layout)`` of every slot of step ``s`` (``idx`` in sampling order)."""
        base, world, budget = self.base, self.base.num_replicas, self.max_tokens_per_rank
        tokens = base.table[idx, -1].astype(np.int64)
        layouts: dict[tuple[int, ...], object] = {}
        fits = layout_fits(tokens, np.zeros(tokens.size, dtype=np.int64), world, budget, self.cost, layouts)
        costs = base.alpha * tokens + base.beta * tokens.astype(np.float64) ** 2
        found = plan_slots(tokens, costs, base.grad_accum, world * budget, fits, start=micro)
        if found.slots is None:
            raise ValueError(self._refusal(s, idx, tokens, found))
        out = []
        for k in range(base.grad_accum):
            members = np.flatnonzero(found.slots == k)
            key = tuple(members.tolist())
            if key not in layouts:  # (fits was called on every slot of the split it returned)
                fits(members)
            out.append((idx[members], layouts[key]))
        return out

    def _refusal(self, s: int, idx: np.ndarray, tokens: np.ndarray, found) -> str:
        base, world, budget = self.base, self.base.num_replicas, self.max_tokens_per_rank
        cap = world * budget
        where = f"step {s} of epoch {base.epoch}"
        if tokens.size and int(tokens.max()) > cap:
            j = int(np.argmax(tokens))
            return (
                f"{where}: example {int(idx[j])} holds {int(tokens[j])} tokens, more than the {world} ranks hold "
                f"together ({world} x max_tokens_per_rank={budget} = {cap}); raise max_tokens_per_rank to at "
                f"least {-(-int(tokens[j]) // world)} or leave the example out"
            )
        what = (
            f"no split of its {idx.size} examples ({int(tokens.sum())} tokens, the longest {int(tokens.max())}) "
            f"into gradient_accumulation_steps={base.grad_accum} micro-batches fits {world} x "
            f"max_tokens_per_rank={budget} = {cap} tokens each (after zigzag rounding)"
        )
        if found.exhausted:
            what = f"no split found in {found.nodes} tries ({what.replace('no split of', 'splitting')})"
        return (
            f"{where}: {what}; raise max_tokens_per_rank or gradient_accumulation_steps, or lower "
            f"per_device_train_batch_size (a step draws {base.batch_size} x {world} ranks x "
            f"{base.grad_accum} = {base.step_size} examples)"
        )

    def __iter__(self) -> Iterator[list]:
        rank = self.base.rank
        for idx, lay in self.slots():
            sets = tuple(sorted(tuple(g.ranks) for g in lay.schedule if g.degree > 1))
            gi = int(lay.group_of_rank[rank])
            self.stats = {
                "degrees": [int(g.degree) for g in lay.schedule],
                "largest_shard": int(lay.shard_tokens.max(initial=0)),
            }
            if gi < 0:
                yield [(-1, SlotMeta(1, 0, (rank,), sets, idle=True))]
                continue
            g = lay.schedule[gi]
            meta = SlotMeta(int(g.degree), int(lay.rank_in_group[rank]), tuple(g.ranks), sets)
            yield [(int(idx[m]), meta) for m in np.sort(np.asarray(g.sequences))]


class TaggedDataset(Dataset):
    """``dataset`` read with ``(index, meta)`` pairs: gives ``(example, meta)`` (``None`` for the
    stand-in index ``-1``). Batched reads (``__getitems__``) reach the dataset as batched reads."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item):
        i, meta = item
        return (None if i < 0 else self.dataset[i]), meta

    def __getitems__(self, items):
        real = [i for i, _ in items if i >= 0]
        many = getattr(self.dataset, "__getitems__", None)
        rows = list(many(real)) if callable(many) and real else [self.dataset[i] for i in real]
        it = iter(rows)
        return [((None if i < 0 else next(it)), meta) for i, meta in items]


class CPCollator:
    """The trainer's collator, then this rank's zigzag shard of the collated sequences.

    Returns the model keywords of :meth:`DynamicCPHandle.shard` (``input_ids``, ``position_ids``,
    ``labels``, ``shift_labels``, ``use_cache``, ``mmbalance_cp``) but no ``num_items_in_batch``:
    Trainer counts it from ``shift_labels``. No communication: the ring's process group is named
    by ranks and created at the first attention call.
    """

    def __init__(self, collate: Callable, pad_id: int = 0, vlm=None):
        self.collate = collate
        self.pad_id = int(pad_id)
        #: a vision-language model's GroupCutter (vlm_cut.py): the shard then also carries
        #: M-RoPE positions ``[4, 1, T]`` and the PendingMedia the forward encodes
        self.vlm = vlm

    def __call__(self, items: list) -> dict:
        meta: SlotMeta = items[0][1]
        if meta.idle:
            shard = CPShard(1, 0, None, np.array([0, 1], dtype=np.int64), 1, torch.tensor([0, 1], dtype=torch.int32),
                            1, ranks=meta.ranks, step_groups=meta.step_groups)  # fmt: skip
            one = torch.tensor([[self.pad_id]], dtype=torch.int64)
            ignore = torch.full((1, 1), IGNORE, dtype=torch.int64)
            idle = {"input_ids": one, "position_ids": torch.zeros((1, 1), dtype=torch.int64), "labels": ignore,
                    "shift_labels": ignore.clone(), "use_cache": False, CP_KEYWORD: shard}  # fmt: skip
            if self.vlm is not None:  # no media: the forward encodes a stand-in item
                _, _, media, _ = self.vlm.cut({"input_ids": torch.zeros((1, 0), dtype=torch.int64)}, 1, 0)
                if self.vlm.family.mrope:
                    idle["position_ids"] = torch.zeros((4, 1, 1), dtype=torch.int64)
                idle[MEDIA_KEYWORD] = media
                if self.vlm.family.has_blocks:  # no block
                    shard.blocks = np.zeros((0, 2), dtype=np.int64)
                    idle.update(
                        self.vlm.family.block_keywords(self.vlm.model, one, torch.zeros(1, dtype=torch.bool))
                    )
                idle.update(self.vlm.family.token_keywords(self.vlm.model, one))
            return idle
        batch = self.collate([row for row, _ in items])
        mrope = pending = blocks = None
        if self.vlm is not None:
            seqs, mrope, pending, blocks = self.vlm.cut(batch, meta.degree, meta.group_rank)
        else:
            seqs = split_sequences(batch)
        cu = np.concatenate([[0], np.cumsum(seqs.lengths)]).astype(np.int64)
        rp = ring_plan(cu, meta.degree, "zigzag")
        index = torch.from_numpy(rp.global_index(meta.group_rank))
        tokens = int(index.numel())
        if meta.degree == 1:
            shard = CPShard(1, 0, None, cu, tokens, torch.from_numpy(cu.astype(np.int32)),
                            int(seqs.lengths.max(initial=0)), ranks=meta.ranks, step_groups=meta.step_groups)  # fmt: skip
        else:
            shard = CPShard(meta.degree, meta.group_rank, None, cu, tokens, ranks=meta.ranks,
                            step_groups=meta.step_groups)  # fmt: skip
        pos = torch.from_numpy(rp.positions(meta.group_rank))
        out = {
            "input_ids": seqs.input_ids[index].unsqueeze(0),
            "position_ids": pos.unsqueeze(0),
            "use_cache": False,
            CP_KEYWORD: shard,
        }
        if seqs.has_labels:
            out["labels"] = seqs.labels[index].unsqueeze(0)
            out["shift_labels"] = seqs.shift_labels[index].unsqueeze(0)
        if blocks is not None and self.vlm is not None:  # the blocks' spans, and the model's block mask
            shard.blocks = blocks
            marks = torch.from_numpy(in_blocks(shard))
            out.update(self.vlm.family.block_keywords(self.vlm.model, out["input_ids"], marks))
        if self.vlm is not None:
            out.update(self.vlm.family.token_keywords(self.vlm.model, out["input_ids"]))
        if pending is not None:
            if mrope is not None:  # [4, 1, T]: the position in the sequence, then the M-RoPE rows
                out["position_ids"] = torch.cat([pos.unsqueeze(0), mrope[index].t()]).unsqueeze(1)
            out[MEDIA_KEYWORD] = pending
        return out
