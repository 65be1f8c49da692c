"""A packed varlen attention backend for transformers (``AttentionInterface``): ``"mmbalance_varlen"``.

Balanced batches are best run without padding: each rank's examples packed back to back into
rows, sequence boundaries where ``position_ids`` restart (as transformers' packing collators
produce them, ``DataCollatorWithFlattening``), or given directly as ``cu_seq_lens_q/k``. This
backend runs such batches through mmbalance's varlen attention op
(:func:`mmbalance.pyops.attention_ops.attention_block`): the Triton flash-style kernel on CUDA
(flash-attn when installed and the call allows it), the reference on CPU tensors. So packed
training needs neither flash-attn nor padding.

What a call can express, and how it maps onto the op (one call per layer, every sequence of the
batch packed into it):

* the mask, through our ``AttentionMaskInterface`` function (``mask.py``): causal or
  bidirectional, padding (left, right, or both around generated tokens), a KV cache's offsets
  (queries bottom-right of their keys; a static cache's empty slots masked), sliding windows
  (judged per sequence), Llama4's chunked attention (each chunk its own sequence), packed rows
  with any batch size (every row split where its ``position_ids`` restart), bidirectional
  attention inside image blocks (Gemma3's ``block_sequence_ids``: a second call over each block's
  later keys, merged by log-sum-exp);
* without our mask (a model that builds none, cross-attention): ``is_causal`` (a module without
  it is bidirectional; causal calls with fewer queries than keys are bottom-right, a cache's),
  ``sliding_window`` (flash-attn's semantics), ``cu_seq_lens_q/k`` (causal bottom-right when they
  differ), ``position_ids`` (2-D, or the text row of 3-D M-RoPE ``[4, B, L]`` positions, as
  transformers reads them), 2-D padding masks and 4-D masks of 0/-inf (or bool) whose rows see at
  most two runs of keys (Mllama's ``cross_attention_mask``);
* ``softcap`` (Gemma2) and attention sinks ``s_aux`` (gpt-oss, with their gradient);
* ``torch.autocast``: q, k and v run in the autocast dtype.

Every plan is made once per forward and reused by the layers; under ``torch.compile`` planning
stays outside the graph (``compile.py``).

Everything else a model hands an attention function is refused with an error that names the
backend and the feature, never ignored: attention dropout in training, ``position_bias`` (T5),
``output_attentions``, 4-D masks with an attention bias or one per head, custom masks, other
unions of mask functions (a bidirectional decoder, ``use_bidirectional_attention``), causal calls
with more queries than keys and no ``cu_seq_lens``, paged caches, unknown keywords.

    from mmbalance.integrations.hf import register_attention
    register_attention()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mmbalance_varlen")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmbalance.pyops.attention_ops import attention_block, merge_attention_states

from ..mixers import config_mixers, describe_mixers, kept_apart, mixers_refusal
from .mask import ATTENTION_NAME, VarlenMask, varlen_mask
from .plan import BlockPlan, plan_with_mask, plan_without_mask, refuse, rows_plan, shape_plan

__all__ = [
    "ATTENTION_NAME",
    "CP_KEYWORD",
    "add_block_keys",
    "logit_features",
    "register_attention",
    "register_shard_attention",
    "varlen_attention",
    "varlen_mask",
    "VarlenMask",
]

#: the model keyword that carries a context-parallel shard down to the attention calls: its value
#: runs the call's attention itself, through the runner registered for its type
#: (:func:`register_shard_attention`; dynamic context parallelism registers its shard's ring)
CP_KEYWORD = "mmbalance_cp"
_SHARD_RUNNERS: dict[type, Callable[..., tuple[Tensor, None]]] = {}


def logit_features(kwargs: dict, heads: int) -> dict:
    """The block ops' ``softcap`` and ``sinks`` keywords of a call (Gemma 2's ``softcap``, gpt-oss'
    ``s_aux``); a ValueError names the backend when the sinks are not one logit per query head."""
    out: dict[str, Any] = {}
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap > 0:
        out["softcap"] = float(softcap)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (heads,):
            got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(
                f"{ATTENTION_NAME}: s_aux must have one logit per query head ({heads}), got {got}"
            )
        out["sinks"] = sinks
    return out


def register_shard_attention(kind: type, run: Callable[..., tuple[Tensor, None]]) -> None:
    """Run every call whose :data:`CP_KEYWORD` holds a ``kind`` with
    ``run(module, query, key, value, attention_mask, scaling, shard, kwargs)`` (transformers'
    signature, the shard and the call's other keywords; returns ``(out [1, T, H, Dv], None)``)."""
    _SHARD_RUNNERS[kind] = run


# keywords that shape the attention and are implemented here
_IMPLEMENTED = {
    "is_causal", "sliding_window", "softcap", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_ids",
}  # fmt: skip
# keywords models pass along that carry nothing about attention itself
_INERT = {
    "cache_position", "use_cache", "past_key_values", "past_key_value", "output_hidden_states",
    "output_router_logits", "return_dict", "num_items_in_batch", "layer_idx", "seq_idx",
    "position_embeddings", "target_dtype", "labels", "shift_labels",
    # which positions the language-model head computes logits for (LLaVA-OneVision passes it down)
    "logits_to_keep",
    # which tower layers feed the projector (Molmo2's config defaults reach its towers' attention)
    "vision_feature_layer",
}  # fmt: skip
# keywords refused whenever they ask for something (not None / False)
_REFUSED = {
    "output_attentions": "returning attention weights (output_attentions=True)",
    "position_bias": "an additive attention bias (`position_bias`, e.g. T5's relative bias)",
    "deterministic": "the `deterministic` switch",
    "cache": "paged attention caches (continuous batching)",
    "block_table": "paged attention caches (`block_table`)",
    "k_cache": "paged attention caches (`k_cache`)",
    "v_cache": "paged attention caches (`v_cache`)",
    "cache_seqlens": "paged attention caches (`cache_seqlens`)",
    "head_mask": "head masks (`head_mask`)",
    "layer_head_mask": "head masks (`layer_head_mask`)",
}


def _check_keywords(module, dropout: float, kwargs: dict) -> None:
    if dropout and getattr(module, "training", False):
        raise refuse(f"attention dropout in training (got dropout={dropout})")
    for name, val in kwargs.items():
        if name in _IMPLEMENTED or name in _INERT:
            continue
        if val is None or val is False:
            continue
        if name in _REFUSED:
            raise refuse(_REFUSED[name])
        raise refuse(f"the attention keyword `{name}` (got {type(val).__name__})", NotImplementedError)


# ----------------------------------------------------------------------------- the function
def varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, Lq, D]``, ``key``/``value``
    ``[B, Hkv, Lk, D]`` (GQA: ``H % Hkv == 0``); returns ``(out [B, Lq, H, Dv], None)``.

    Under ``torch.autocast`` the attention runs in the autocast dtype (q, k and v cast to it, as
    transformers' flash-attention path does: HF decoders hand over float32 queries and keys, RoPE
    being float32, and half-precision values); the output has that dtype. Without our mask, a
    module that does not say ``is_causal`` (or says False) is bidirectional.

    With a dynamic context-parallel shard in the keywords (``mmbalance_cp``, from
    :meth:`~mmbalance.integrations.hf.cp.DynamicCPHandle.shard`) it runs the shard's ring or
    varlen attention instead (``cp/attention.py``, registered by :func:`register_shard_attention`)."""
    shard = kwargs.pop(CP_KEYWORD, None)
    _check_keywords(module, dropout, kwargs)
    if shard is not None:
        run = _SHARD_RUNNERS.get(type(shard))
        if run is None:
            raise TypeError(
                f"{ATTENTION_NAME}: {CP_KEYWORD} must be a shard from handle.shard (a CPShard), got {type(shard).__name__}"
            )
        return run(module, query, key, value, attention_mask, scaling, shard, kwargs)
    query, key, value = _one_dtype(query, key, value)
    b, h, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[-1]
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if causal is None else causal)
    sliding = kwargs.get("sliding_window")
    kw_window = None
    if sliding is not None and sliding > 0:
        kw_window = (int(sliding) - 1, -1 if causal else int(sliding) - 1)  # flash-attn's (W - 1, W - 1)
    cu_q: Tensor | None = kwargs.get("cu_seq_lens_q")
    cu_k: Tensor | None = kwargs.get("cu_seq_lens_k")
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    cu = (cu_q, cu_k) if cu_q is not None and cu_k is not None else None
    device = query.device

    if isinstance(attention_mask, VarlenMask):
        spec = attention_mask
        if spec.q_length != lq or spec.kv_length < lk or spec.batch_size not in (b, 1):
            raise ValueError(
                f"{ATTENTION_NAME}: the mask was built for {spec.q_length} queries x {spec.kv_length} keys, "
                f"the call has {lq} x {lk}"
            )
        if kw_window is not None and spec.window is None:
            raise ValueError(
                f"{ATTENTION_NAME}: the layer asks for sliding_window={sliding} but its mask has no sliding "
                "window (the model built a full-attention mask for it)"
            )
        causal = spec.causal
        plain = spec.segments is None and spec.padding is None and spec.q_offset == spec.kv_offset == 0
        position_ids = kwargs.get("position_ids")
        by_positions = cu is None and plain and lq == lk and position_ids is not None
        # the plan of this shape is on the mask after its first layer (under torch.compile: made by
        # the mask function), a lookup Dynamo traces without a graph break
        plan = None if cu is not None or by_positions else spec.plans.get((lq, lk, b, device))
        if plan is None:
            plan = plan_with_mask(spec, b, lq, lk, cu, device, position_ids if by_positions else None)
    elif attention_mask is None or (isinstance(attention_mask, Tensor) and attention_mask.dim() in (2, 4)):
        config = getattr(module, "config", None)
        if getattr(config, "attention_chunk_size", None) and attention_mask is None:
            raise refuse(
                "chunked attention without its own mask function (register_attention() installs it; "
                "a mask passed in from outside carries no chunks)"
            )
        position_ids = kwargs.get("position_ids")
        shaped = None
        if attention_mask is None and cu is None and (lq != lk or position_ids is None):
            shaped = shape_plan(b, lq, lk, causal, kw_window)
        if shaped is not None:  # e.g. cross-attention without a mask: nothing to read, no graph break
            plan = rows_plan(b, lq, lk, shaped, device)
        else:
            plan, causal = plan_without_mask(
                attention_mask, b, lq, lk, causal, kw_window, cu, position_ids, device
            )
    else:
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise refuse(
            f"{type(attention_mask).__name__} attention masks of shape {shape} (custom masks); models get its "
            "own mask function from register_attention()"
        )

    _check_mixers(module, plan, b, lq, cu, kwargs.get("position_ids"), attention_mask)
    extra: dict[str, Any] = logit_features(kwargs, h)
    if plan.window != (-1, -1):
        extra.update(window_left=plan.window[0], window_right=plan.window[1])

    width = max(d, dv)  # MLA: value head dim != query head dim -> pad to one width, crop after
    q = query.transpose(1, 2).reshape(b * lq, h, d)
    k = key.transpose(1, 2).reshape(b * lk, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * lk, value.shape[1], dv)
    if width != d:
        q, k = (torch.nn.functional.pad(t, (0, width - d)) for t in (q, k))
    if width != dv:
        v = torch.nn.functional.pad(v, (0, width - dv))
    scale = float(scaling) if scaling is not None else d**-0.5
    kq, vq = k, v
    if plan.k_index is not None:
        kq, vq = k.index_select(0, plan.k_index), v.index_select(0, plan.k_index)
    out, lse = attention_block(
        q, kq, vq, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, softmax_scale=scale, causal=causal,
        causal_offset=plan.causal_offset, q_runs=plan.q_runs, k_runs=plan.k_runs, **extra,
    )  # fmt: skip
    if plan.blocks is not None:
        out = add_block_keys(out, lse, q, k, v, plan.blocks, scale, extra.get("softcap"))
    out = out.view(b, lq, h, width)
    if width != dv:
        out = out[..., :dv]
    return out, None


def _check_mixers(module, plan, rows: int, length: int, cu, position_ids, attention_mask) -> None:
    """A model whose decoder mixes tokens outside attention (``mixers.py``) is refused when a row
    holds several sequences (its other layers would not keep them apart), and when this call
    cannot tell (the model hands its attention neither positions, sequence boundaries nor a
    padding mask, as GraniteMoeHybrid does: a packed row would look like one sequence)."""
    packed = plan.cu_q.shape[0] - 1 > rows
    blind = (
        length > 1
        and cu is None
        and position_ids is None
        and (
            attention_mask is None
            or (
                isinstance(attention_mask, VarlenMask)
                and attention_mask.segments is None
                and attention_mask.padding is None
            )
        )
    )
    if not (packed or blind):
        return
    if (
        getattr(module, "is_causal", True) is False
    ):  # an encoder's attention (a vision tower beside a hybrid LM)
        return
    config = getattr(module, "config", None)
    if packed and kept_apart(config):  # its every mixer runs the row's sequences apart (keep_sequences_apart)
        return
    mixers = config_mixers(config, module)
    if not mixers:
        return
    owner = (type(module).__name__.replace("Attention", "") or type(module).__name__) + " model"
    if packed:
        raise ValueError(f"{ATTENTION_NAME}: {mixers_refusal('packed rows', owner, mixers)}")
    raise ValueError(
        f"{ATTENTION_NAME}: {owner} mixes tokens outside attention ({describe_mixers(mixers)}) and hands its "
        "attention neither positions, sequence boundaries nor a padding mask, so a packed row cannot be told "
        "from one sequence, and its other layers would not keep packed sequences apart: run it with "
        "attn_implementation='sdpa' (unpacked batches)"
    )


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def _one_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v in one dtype: the autocast dtype inside ``torch.autocast`` (float64 stays), else
    they must share one already (a TypeError naming the backend)."""
    device_type = query.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE else t for t in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"{ATTENTION_NAME}: query, key and value must share a dtype outside torch.autocast, got {query.dtype}, "
            f"{key.dtype} and {value.dtype}. Mixed-precision training runs the model under torch.autocast "
            "(TrainingArguments(bf16=True) or fp16=True do), where they are cast to the autocast dtype; else "
            "cast the model to one dtype"
        )
    return query, key, value


def add_block_keys(out, lse, q, k, v, bp: BlockPlan, scale: float, softcap) -> Tensor:
    """Merge each block query's attention over its block's later keys into ``out`` (``[T, H, D]``,
    with its float32 ``lse [H, T]``); ``k``/``v`` are the rows ``bp.k_index`` points into (this
    call's keys, or a context-parallel group's gathered block keys)."""
    extra: dict[str, Any] = {} if softcap is None else {"softcap": softcap}
    out2, lse2 = attention_block(
        q.index_select(0, bp.q_index), k.index_select(0, bp.k_index), v.index_select(0, bp.k_index),
        bp.cu_q, bp.cu_k, bp.max_q, bp.max_k, softmax_scale=scale, causal=True, q_runs=bp.q_runs,
        k_runs=bp.k_runs, out_dtype=torch.float32, **extra,
    )  # fmt: skip
    merged, _ = merge_attention_states(out.index_select(0, bp.q_index), lse[:, bp.q_index], out2, lse2)
    return out.index_copy(0, bp.q_index, merged.to(out.dtype))


def register_attention() -> str:
    """Register ``"mmbalance_varlen"`` with transformers' ``AttentionInterface`` and its mask
    function (:func:`varlen_mask`) with ``AttentionMaskInterface``; returns the name. Idempotent.

    Select it with ``attn_implementation="mmbalance_varlen"`` (``from_pretrained``,
    ``from_config``) or ``model.set_attn_implementation("mmbalance_varlen")``. For packed batches
    pass ``position_ids`` that restart at every sequence (any batch size) or ``cu_seq_lens_q/k``,
    and ``use_cache=False`` when training.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, varlen_mask)
    return ATTENTION_NAME
