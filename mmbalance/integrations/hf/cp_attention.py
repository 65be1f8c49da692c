"""Attention of a dynamic context-parallel shard inside a Hugging Face model.

:meth:`~mmbalance.integrations.hf.dynamic_cp.DynamicCPHandle.shard` returns, next to the model
inputs, a :class:`CPShard` under the keyword ``mmbalance_cp``. transformers hands model keywords
down to every attention call, so ``mmbalance_varlen`` finds the shard there and runs:

* degree 1 (the rank holds whole sequences): causal varlen attention over its packed sequences;
* degree ``d > 1``: ring attention (:func:`mmbalance.collectives.ring.ring_attention`, zigzag
  layout) over the CP group of the shard: every sequence of the group is split over the group's
  ranks, and every rank of the group calls attention with the same layers in the same order.

The shard travels with the call (not with global state), so gradient checkpointing's recompute
and several models in one process see the right shard. What the ring cannot run yet is refused by
name (:func:`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.collectives.group import group_timeout
from mmbalance.collectives.ring import ring_attention
from mmbalance.pyops.attention_ops import attention_block

from .attention_compile import outside_graph
from .attention_mask import ATTENTION_NAME, VarlenMask

__all__ = ["CP_KEYWORD", "MEDIA_KEYWORD", "CPShard", "cp_attention"]

#: the model keyword that carries a :class:`CPShard` down to the attention calls
CP_KEYWORD = "mmbalance_cp"
#: the model keyword that carries a shard's pending media to the model's media pre-hook
#: (:mod:`.dynamic_cp_vlm_trainer`); seen by an attention call only when that hook did not run
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
            shard holds no placeholder token (:mod:`.dynamic_cp_vlm`).
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

    def process_group(self):
        """The ring's process group (created at first use from :attr:`step_groups`)."""
        if self.group is None and self.step_groups:
            for ranks in self.step_groups:
                if ranks not in _GROUPS:
                    timeout = group_timeout()
                    kw = {} if timeout is None else {"timeout": timeout}
                    _GROUPS[ranks] = dist.new_group(list(ranks), **kw)  # type: ignore[arg-type]
            if self.degree > 1:
                self.group = _GROUPS[self.ranks]
            self.step_groups = ()
        return self.group

    def __repr__(self) -> str:
        return (
            f"CPShard(degree={self.degree}, group_rank={self.group_rank}, sequences={len(self.cu_seqlens) - 1}, "
            f"tokens={self.tokens})"
        )


# ring groups named by ranks (CPShard.step_groups): created once per rank set, in the same order on
# every rank (every rank's shards of a step list the same sets), reused afterwards
_GROUPS: dict[tuple[int, ...], object] = {}


def _not_run(feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"{ATTENTION_NAME} does not run {feature} under dynamic context parallelism (apply_dynamic_cp) yet"
    )


def refusal(module, attention_mask, kwargs: dict) -> NotImplementedError | None:
    """The error for a feature of this call that the ring cannot run, or ``None``."""
    sliding = kwargs.get("sliding_window")
    if sliding is not None and sliding > 0:
        return _not_run(f"sliding-window attention (sliding_window={sliding})")
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap > 0:
        return _not_run(f"logit softcapping (softcap={softcap})")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return _not_run("attention sinks (s_aux)")
    config = getattr(module, "config", None)
    if getattr(config, "attention_chunk_size", None):
        return _not_run("chunked attention (attention_chunk_size)")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal  # as varlen_attention reads it
    if not causal:
        return _not_run("bidirectional or cross-attention (is_causal=False)")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _not_run("explicit cu_seq_lens_q/k (the shard defines the sequences)")
    if isinstance(attention_mask, VarlenMask):
        if attention_mask.window is not None:
            return _not_run("sliding-window attention (a sliding-window mask)")
        if attention_mask.chunk is not None:
            return _not_run("chunked attention (a chunked mask)")
        if attention_mask.blocks is not None:
            return _not_run("block masks (bidirectional blocks, block_sequence_ids)")
        if attention_mask.padding is not None and not bool(attention_mask.padding.all()):
            return _not_run("padding masks (pass the shard's inputs without attention_mask)")
        if not attention_mask.causal:
            return _not_run("a non-causal mask")
    elif isinstance(attention_mask, Tensor):
        if attention_mask.dim() != 2:
            return _not_run(f"{attention_mask.dim()}-D attention masks (block masks)")
        if not bool(attention_mask.to(torch.bool).all()):
            return _not_run("padding masks (pass the shard's inputs without attention_mask)")
    elif attention_mask is not None:
        return _not_run(f"{type(attention_mask).__name__} attention masks (block masks)")
    return None


def _cast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One dtype for the op: the autocast dtype under autocast, as transformers' flash path does;
    otherwise v's dtype when the three differ (RoPE in float32 over half-precision values)."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        dt = v.dtype
    return q.to(dt), k.to(dt), v.to(dt)


@outside_graph(ATTENTION_NAME, "the context-parallel attention (the ring's collectives and plan)")
def cp_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling, shard: CPShard,
                 kwargs: dict) -> tuple[Tensor, None]:  # fmt: skip
    """transformers' attention signature over a :class:`CPShard` (``query [1, H, T_r, D]``).

    Kept out of compiled graphs: under ``torch.compile`` each call is one graph break (and
    ``fullgraph=True`` is refused by name), and the ring's collectives, its per-step plan and the
    shard's process group run eagerly (traced, they broke the graph dozens of times and hit
    dynamo's recompile limit in the first step)."""
    if not isinstance(shard, CPShard):
        raise TypeError(
            f"{ATTENTION_NAME}: {CP_KEYWORD} must be a CPShard (from handle.shard), got {type(shard).__name__}"
        )
    if MEDIA_KEYWORD in kwargs:  # the model's media pre-hook did not run: the features would be lost
        raise RuntimeError(
            f"{ATTENTION_NAME}: the shard's media ({MEDIA_KEYWORD}) reached the attention unresolved: call the model "
            "itself (model(**kwargs), so its forward pre-hooks run), not model.forward or an inner module"
        )
    group = shard.process_group()  # on every rank, whatever its degree: groups are made collectively
    err = refusal(module, attention_mask, kwargs)
    if err is not None:
        raise err
    b, h, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[-1]
    if b != 1 or lq != shard.tokens or lk != shard.tokens:
        raise ValueError(
            f"{ATTENTION_NAME}: the call has a batch of {b} x {lq} queries x {lk} keys, but the shard holds "
            f"1 x {shard.tokens} tokens: call the model with the kwargs handle.shard returned, unchanged, and no cache"
        )
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    q, k, v = _cast(q, k, v)
    width = max(d, dv)
    if width != d:
        q, k = (torch.nn.functional.pad(t, (0, width - d)) for t in (q, k))
    if width != dv:
        v = torch.nn.functional.pad(v, (0, width - dv))
    scale = float(scaling) if scaling is not None else d**-0.5
    if shard.degree == 1:
        cu = shard.device_cu.get(q.device)
        if cu is None:
            assert shard.local_cu_seqlens is not None
            cu = shard.device_cu[q.device] = shard.local_cu_seqlens.to(q.device)
        out, _ = attention_block(
            q, k, v, cu, cu, shard.max_seqlen, shard.max_seqlen, softmax_scale=scale, causal=True
        )
    else:
        out = ring_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), shard.cu_seqlens, causal=True, softmax_scale=scale,
            group=group, layout="zigzag",
        )  # fmt: skip
    out = out.unsqueeze(0)
    if width != dv:
        out = out[..., :dv]
    if shard.anchor is not None:
        out = out + shard.anchor.to(device=out.device, dtype=out.dtype)
    return out, None
