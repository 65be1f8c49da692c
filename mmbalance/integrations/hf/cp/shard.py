"""What a rank of a dynamic context-parallel step holds: its :class:`CPShard`, which travels to
the attention calls under the model keyword ``mmbalance_cp`` (the attention room's
``CP_KEYWORD``); the keyword of the media a shard leaves to the model's forward; the stand-in of a
rank with nothing to run.

The shard travels with the call (not with global state), so gradient checkpointing's recompute
and several models in one process see the right shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mmbalance.collectives.pool import ranks_group
from mmbalance.collectives.ring.plan import ring_plan

__all__ = ["MEDIA_KEYWORD", "CPShard", "idle_shard", "in_blocks"]

#: the model keyword that carries a shard's pending media to the model's media pre-hook
#: (:mod:`.media`); seen by an attention call only when that hook did not run
MEDIA_KEYWORD = "mmbalance_media"


@dataclass(eq=False)
class CPShard:
    """What the attention layers of one rank need to know about the shard it holds.

    Attributes:
        degree: ranks of this rank's CP group (1: whole sequences, plain varlen attention).
        group_rank: this rank's index in the group (its zigzag chunks).
        group: the group's process group (``None`` for degree 1).
        cu_seqlens: int64 ``[B + 1]`` boundaries of the group's sequences, unsplit (the ring's
            global view; for degree 1 the rank's own sequences).
        tokens: tokens this rank holds (the query length every attention call must have).
        local_cu_seqlens: int32 ``[B + 1]`` boundaries of the rank's local pieces (degree 1).
        max_seqlen: longest local sequence (degree 1).
        anchor: a zero scalar (or ``None``) that every attention call adds to its output: it
            depends on the shard's encoder features and stand-in encodings, so every rank's
            backward runs the collectives that send their gradients back, also a rank whose
            shard holds no placeholder token (:mod:`.vlm_step`).
        blocks: int64 ``[n, 2]`` spans ``[start, end)`` of the bidirectional image blocks in the
            coordinates of :attr:`cu_seqlens` (Gemma 3: each image's tokens see one another), or
            ``None`` for a model without them (:mod:`.blocks`).
    """

    degree: int
    group_rank: int
    group: object
    cu_seqlens: np.ndarray
    tokens: int
    local_cu_seqlens: Tensor | None = None
    max_seqlen: int = 0
    device_cu: dict = field(default_factory=dict, repr=False)
    anchor: Tensor | None = field(default=None, repr=False)
    #: global ranks of this rank's group, and every group of degree > 1 of the step (sorted): a
    #: shard made where no process group can be made (a data-loader worker) names its group by
    #: ranks; the first attention call creates the step's groups, in one order on every rank
    ranks: tuple[int, ...] = ()
    step_groups: tuple[tuple[int, ...], ...] = ()
    blocks: np.ndarray | None = field(default=None, repr=False)

    def process_group(self):
        """The ring's process group (created at first use from :attr:`step_groups`)."""
        if self.group is None and self.step_groups:
            # created in one order on every rank (every rank's shards of a step list the same sets)
            for ranks in self.step_groups:
                ranks_group(ranks)
            if self.degree > 1:
                self.group = ranks_group(self.ranks)
            self.step_groups = ()
        return self.group

    def __repr__(self) -> str:
        return (
            f"CPShard(degree={self.degree}, group_rank={self.group_rank}, sequences={len(self.cu_seqlens) - 1}, "
            f"tokens={self.tokens})"
        )


def in_blocks(shard: CPShard) -> np.ndarray:
    """bool ``[tokens]``: which of the shard's tokens lie in one of its :attr:`~CPShard.blocks`
    (all ``False`` without blocks)."""
    if shard.blocks is None or not len(shard.blocks):
        return np.zeros(shard.tokens, dtype=bool)
    if shard.degree > 1:
        where = ring_plan(shard.cu_seqlens, shard.degree, "zigzag").global_index(shard.group_rank)
    else:
        where = np.arange(shard.tokens, dtype=np.int64)
    spans = np.asarray(shard.blocks, dtype=np.int64).reshape(-1, 2)
    j = np.searchsorted(spans[:, 0], where, side="right") - 1
    return (j >= 0) & (where < spans[np.maximum(j, 0), 1])


def idle_shard() -> CPShard:
    """The shard of a rank with nothing to run: one stand-in token (label ``-100``)."""
    cu = np.array([0, 1], dtype=np.int64)
    return CPShard(1, 0, None, cu, 1, torch.tensor([0, 1], dtype=torch.int32), 1)
