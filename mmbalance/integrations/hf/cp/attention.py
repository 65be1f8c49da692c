"""Attention of a dynamic context-parallel shard inside a Hugging Face model.

:meth:`~mmbalance.integrations.hf.cp.DynamicCPHandle.shard` returns, next to the model inputs, a
:class:`~.shard.CPShard` under the keyword ``mmbalance_cp``. transformers hands model keywords
down to every attention call, so ``mmbalance_varlen`` finds the shard there and runs
:func:`cp_attention` (registered with the attention backend on import):

* degree 1 (the rank holds whole sequences): causal varlen attention over its packed sequences;
* degree ``d > 1``: ring attention (:func:`mmbalance.collectives.ring_attention`, zigzag
  layout) over the CP group of the shard: every sequence of the group is split over the group's
  ranks, and every rank of the group calls attention with the same layers in the same order.

Both run what the layer asks for on top of the causal mask: a sliding window (``sliding_window``
or the mask's own window, per layer as Gemma 2/3 and gpt-oss mix them; the ring skips the shards
a window cannot reach, and a window at least as long as every sequence of the step is plain causal
attention), logit softcapping (``softcap``, Gemma 2), attention sinks (``s_aux``, gpt-oss; once
per query) and Gemma 3's bidirectional image blocks (the later keys of a query's own image, a
second op call over the group's gathered image keys: :mod:`.blocks`). What cannot run is refused by name: by the model's config when the handle is made
(:func:`model_refusal`), and per call as a backstop (:func:`refusal`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmbalance.collectives.group import comm_device
from mmbalance.collectives.ring import ring_attention
from mmbalance.pyops.attention_ops import attention_block

from ..attention import (
    ATTENTION_NAME,
    CP_KEYWORD,
    VarlenMask,
    logit_features,
    outside_graph,
    register_shard_attention,
)
from ..compat import language_model
from ..loss import router_aux_loss
from ..mixers import describe_mixers, model_mixers
from .blocks import with_block_keys
from .families import vlm_family
from .inputs import check_attention, text_config
from .linear import CP_LINEAR, install_linear_cp, remove_linear_cp
from .shard import MEDIA_KEYWORD, CPShard

__all__ = [
    "cp_attention", "install_attention_check", "model_refusal", "refusal", "remove_attention_check",
]  # fmt: skip


def _not_run(feature: str) -> NotImplementedError:
    return NotImplementedError(
        f"{ATTENTION_NAME} does not run {feature} under dynamic context parallelism (apply_dynamic_cp)"
    )


def model_refusal(model) -> str | None:
    """What of ``model``'s attention (its text config) dynamic context parallelism cannot run, or
    ``None``: read before anything moves, so every rank refuses alike at ``apply_dynamic_cp`` (and
    ``balance_trainer``) instead of at the first forward."""
    config = text_config(model)
    mixers = {
        cls: layers for cls, layers in model_mixers(language_model(model)).items() if cls not in CP_LINEAR
    }
    if mixers:
        return (
            f"{type(model).__name__}, whose decoder mixes tokens outside attention ({describe_mixers(mixers)}): "
            "those layers do not see where a split sequence continues, so each piece would restart their state "
            "(a wrong loss, without an error); train it without context parallelism"
        )
    aux = router_aux_loss(model)
    if aux is not None:
        return (
            f"the router's auxiliary loss ({aux}): a mean over each forward's tokens, which a shard holds "
            "pieces of; set output_router_logits=False to train it with context parallelism"
        )
    if getattr(config, "attention_chunk_size", None):
        return f"chunked attention (attention_chunk_size={config.attention_chunk_size})"
    try:
        family = vlm_family(model)
    except ValueError:  # a multimodal model apply_dynamic_cp refuses by itself, with its reason
        family = None
    # PaliGemma's text config says bidirectional for its prefix: the model's own mask is causal
    # with the prefix as a block, and the shard runs that block (blocks.py); Gemma 4's "vision"
    # is its images' blocks, the same way
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    if bidirectional in (True, "all") and not (family is not None and family.prefix_blocks):
        return f"bidirectional attention (use_bidirectional_attention={bidirectional!r})"
    if getattr(config, "is_causal", True) is False:
        return "bidirectional attention (config.is_causal=False)"
    return None


def install_attention_check(model, module=None) -> None:
    """A forward pre-hook on ``model``: a call that carries a shard (``mmbalance_cp``) raises
    ValueError (:func:`~.inputs.check_attention`) before the forward when a layer's attention is not
    ``mmbalance_varlen``, instead of returning a wrong loss. Every rank checks its own forward (the
    same model on every rank: every rank raises; ``shard`` checks the same with its agreement).
    The hook goes on ``module``, the module the loop calls (default ``model``; a peft wrapper calls
    the model's forward past its hooks). One hook however often it is installed;
    :func:`remove_attention_check` once per installation."""
    module = model if module is None else module
    install_linear_cp(model)  # the Gated DeltaNet layers take the shard too (linear.py)
    users = module.__dict__.get("_mmbalance_attention_check_users", 0)
    module.__dict__["_mmbalance_attention_check_users"] = users + 1
    if module.__dict__.get("_mmbalance_attention_check") is not None:
        return

    @torch.compiler.disable
    def hook(module, args, kwargs):
        shard = kwargs.get(CP_KEYWORD)
        if shard is not None:
            agree_on_attention(model, shard)
        return None

    module.__dict__["_mmbalance_attention_check"] = module.register_forward_pre_hook(hook, with_kwargs=True)


def agree_on_attention(model, shard: CPShard) -> None:
    """Every member of the shard's CP group checks its own attention (:func:`~.inputs.check_attention`)
    and the group agrees on the answers (one small all-reduce, degree > 1 only) before any ring
    runs: a rank whose attention was switched after ``shard`` raises its ValueError, and every
    other member raises one naming that rank and the attention, at once, instead of waiting in the
    ring for it until the process group's timeout."""
    try:
        check_attention(model)
        mine: ValueError | None = None
    except ValueError as exc:
        mine = exc
    group = shard.process_group()  # collectively made on every rank, whatever its degree
    if shard.degree > 1 and group is not None:
        import torch.distributed as dist

        flags = torch.zeros(shard.degree, dtype=torch.int32)
        flags[shard.group_rank] = 0 if mine is None else 1
        flags = flags.to(comm_device(group))
        dist.all_reduce(flags, group=group)
        bad = [int(r) for r in torch.nonzero(flags.cpu()).flatten()]
        if mine is None and bad:
            who = ", ".join(f"rank {dist.get_global_rank(group, i)}" for i in bad)
            raise ValueError(
                f"model: {who} of this rank's context-parallel group runs another attention than "
                f"{ATTENTION_NAME!r} (switched after handle.shard), so its ring would never start: every rank "
                f"of the group stops here. Keep model.set_attn_implementation({ATTENTION_NAME!r}) on every rank, "
                "or handle.remove() first on every rank to train without context parallelism"
            )
    if mine is not None:
        raise mine


def remove_attention_check(module) -> None:
    """Undo one :func:`install_attention_check` on ``module``: the last installer's removal takes
    the hook off."""
    remove_linear_cp(module)
    users = module.__dict__.get("_mmbalance_attention_check_users", 0) - 1
    module.__dict__["_mmbalance_attention_check_users"] = max(users, 0)
    if users > 0:
        return
    handle = module.__dict__.pop("_mmbalance_attention_check", None)
    if handle is not None:
        handle.remove()


def refusal(module, attention_mask, kwargs: dict, shard: CPShard | None = None) -> NotImplementedError | None:
    """The error for a feature of this call that the ring cannot run, or ``None`` (bidirectional
    image blocks run when ``shard`` carries them: :mod:`.blocks`)."""
    config = getattr(module, "config", None)
    if getattr(config, "attention_chunk_size", None):
        return _not_run("chunked attention (attention_chunk_size)")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", False) if causal is None else causal  # as varlen_attention reads it
    if isinstance(attention_mask, VarlenMask):  # the mask's own causality wins, as in varlen_attention
        causal = attention_mask.causal
    if not causal:
        return _not_run("bidirectional or cross-attention (is_causal=False)")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _not_run("explicit cu_seq_lens_q/k (the shard defines the sequences)")
    if isinstance(attention_mask, VarlenMask):
        if attention_mask.window is not None and attention_mask.window[1] >= 0:
            return _not_run(f"a two-sided sliding window (the mask's window {attention_mask.window})")
        if attention_mask.chunk is not None:
            return _not_run("chunked attention (a chunked mask)")
        if attention_mask.blocks is not None and getattr(shard, "blocks", None) is None:
            return _not_run(
                "block masks (bidirectional blocks, block_sequence_ids) in a shard made without its image blocks"
            )
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


def features(attention_mask, kwargs: dict, h: int, longest: int) -> dict:
    """The block ops' feature keywords of a call: ``window_left`` (``sliding_window - 1``, from the
    call or its mask; left out when the window covers every sequence: plain causal), ``softcap``
    and ``sinks``. Raises ValueError when the call and its mask disagree on the window or the
    sinks do not have one logit per query head."""
    out = logit_features(kwargs, h)
    sliding = kwargs.get("sliding_window")
    left = None
    if sliding is not None and sliding > 0:
        left = int(sliding) - 1  # transformers: key j allowed iff i - j < sliding_window
    mask_window = attention_mask.window if isinstance(attention_mask, VarlenMask) else None
    if mask_window is not None:
        if left is not None and left != mask_window[0]:
            raise ValueError(
                f"{ATTENTION_NAME}: the layer asks for sliding_window={sliding} but its mask has the window "
                f"{mask_window[0] + 1}"
            )
        left = mask_window[0]
    if left is not None and left < longest - 1:  # else every key of every sequence is in the window
        out["window_left"] = left
    return out


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
    if MEDIA_KEYWORD in kwargs:  # the model's media pre-hook did not run: the features would be lost
        raise RuntimeError(
            f"{ATTENTION_NAME}: the shard's media ({MEDIA_KEYWORD}) reached the attention unresolved: call the model "
            "itself (model(**kwargs), so its forward pre-hooks run), not model.forward or an inner module"
        )
    group = shard.process_group()  # on every rank, whatever its degree: groups are made collectively
    err = refusal(module, attention_mask, kwargs, shard)
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
    longest = int(np.diff(shard.cu_seqlens).max(initial=0))
    extra = features(attention_mask, kwargs, h, longest)
    if "sinks" in extra:
        extra["sinks"] = extra["sinks"].to(q.device)
    if shard.degree == 1:
        cu = shard.device_cu.get(q.device)
        if cu is None:
            assert shard.local_cu_seqlens is not None
            cu = shard.device_cu[q.device] = shard.local_cu_seqlens.to(q.device)
        out, lse = attention_block(
            q, k, v, cu, cu, shard.max_seqlen, shard.max_seqlen, softmax_scale=scale, causal=True, **extra
        )
    else:
        out, lse = ring_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), shard.cu_seqlens, causal=True, softmax_scale=scale,
            group=group, layout="zigzag", return_lse=True, **extra,
        )  # fmt: skip
    if isinstance(attention_mask, VarlenMask) and attention_mask.blocks is not None:
        out = with_block_keys(out, lse, q, k, v, shard, attention_mask, group, scale, extra.get("softcap"))
    out = out.unsqueeze(0)
    if width != dv:
        out = out[..., :dv]
    if shard.anchor is not None:
        out = out + shard.anchor.to(device=out.device, dtype=out.dtype)
    return out, None


register_shard_attention(CPShard, cp_attention)
