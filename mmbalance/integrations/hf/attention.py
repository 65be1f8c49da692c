"""A packed varlen attention backend for transformers (``AttentionInterface``): ``"mmbalance_varlen"``.

Balanced batches are best run without padding: each rank's examples packed back to back into
one row, sequence boundaries where ``position_ids`` restart (as transformers' packing collators
produce them, ``DataCollatorWithFlattening``), or given directly as ``cu_seq_lens_q/k``. This
backend runs such batches through mmbalance's varlen attention op
(:func:`mmbalance.pyops.attention.attention_block`): the Triton flash-style kernel on CUDA
(flash-attn when installed), the reference on CPU tensors. So packed training needs neither
flash-attn nor padding.

Also handled: ordinary batches with a 2-D padding mask (left or right padding, and decoding with a
cache, where each row's queries sit at the end of its keys), and full-attention calls without a
mask (vision towers). Sliding-window attention, attention dropout and 4-D custom masks are refused
with a ``ValueError`` rather than computed wrongly.

    from mmbalance.integrations.hf import register_attention
    register_attention()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mmbalance_varlen")
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmbalance.pyops.attention import attention_block

__all__ = ["ATTENTION_NAME", "register_attention", "varlen_attention"]

ATTENTION_NAME = "mmbalance_varlen"


def _cu(lengths: np.ndarray, device) -> Tensor:
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    return torch.from_numpy(cu).to(device)


def _lengths_from_position_ids(position_ids: Tensor) -> np.ndarray:
    """Sequence lengths of one packed row: a new sequence starts wherever the position restarts."""
    pos = position_ids.reshape(-1).cpu().numpy()
    starts = np.flatnonzero(np.concatenate([[True], pos[1:] <= pos[:-1]]))
    return np.diff(np.concatenate([starts, [pos.size]]))


def varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, Lq, D]``, ``key``/``value``
    ``[B, Hkv, Lk, D]`` (GQA: ``H % Hkv == 0``); returns ``(out [B, Lq, H, D], None)``."""
    if dropout and module.training:
        raise ValueError(f"{ATTENTION_NAME} does not implement attention dropout (got {dropout})")
    window = kwargs.get("sliding_window")
    if window is not None and window > 0 and key.shape[2] > window:
        raise ValueError(f"{ATTENTION_NAME} does not implement sliding-window attention (window {window})")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"{ATTENTION_NAME} takes a 2-D padding mask (register it with register_attention(), which "
            f"installs the matching mask function), got shape {tuple(attention_mask.shape)}"
        )
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    b, h, lq, d = query.shape
    lk = key.shape[2]
    q = query.transpose(1, 2)  # [B, Lq, H, D]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    scale = float(scaling) if scaling is not None else d**-0.5
    device = query.device
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if cu_q is not None or (b == 1 and lq == lk and attention_mask is None and position_ids is not None):
        # one packed row: boundaries given, or where the positions restart
        if b != 1:
            raise ValueError(f"packed sequences need batch size 1, got {b}")
        if cu_q is not None:
            cu_q = cu_q.to(device=device, dtype=torch.int32)
            cu_k = cu_q if cu_k is None else cu_k.to(device=device, dtype=torch.int32)
            lens_q = np.diff(cu_q.cpu().numpy())
            lens_k = np.diff(cu_k.cpu().numpy())
        else:
            lens_q = lens_k = _lengths_from_position_ids(position_ids)
            cu_q = cu_k = _cu(lens_q, device)
        out, _ = attention_block(
            q[0], k[0], v[0], cu_q, cu_k, int(lens_q.max(initial=0)), int(lens_k.max(initial=0)),
            softmax_scale=scale, causal=causal,
        )  # fmt: skip
        return out.unsqueeze(0), None
    # One sequence per row: its valid keys (all, or where the 2-D mask is set) and its queries,
    # which are the last Lq of them (bottom-right aligned, as with a cache).
    if attention_mask is None:
        valid_k = torch.ones(b, lk, dtype=torch.bool, device=device)
    else:
        valid_k = attention_mask[:, -lk:].to(device=device, dtype=torch.bool)
    valid_q = valid_k[:, lk - lq :]
    n_k = valid_k.sum(1).cpu().numpy().astype(np.int64)
    n_q = valid_q.sum(1).cpu().numpy().astype(np.int64)
    qp, kp, vp = q[valid_q], k[valid_k], v[valid_k]  # [tokens, heads, D], row-major
    runs = None
    if causal:
        # positions: keys 0..n_k-1, queries the last n_q of them (a per-row causal offset)
        q_runs = np.stack([n_k - n_q, n_q, n_k], 1).astype(np.int32)
        k_runs = np.stack([np.zeros_like(n_k), n_k, n_k], 1).astype(np.int32)
        runs = dict(q_runs=torch.from_numpy(q_runs).to(device), k_runs=torch.from_numpy(k_runs).to(device))
    out, _ = attention_block(
        qp, kp, vp, _cu(n_q, device), _cu(n_k, device), int(n_q.max(initial=0)), int(n_k.max(initial=0)),
        softmax_scale=scale, causal=causal, **(runs or {}),
    )  # fmt: skip
    full = out.new_zeros(b, lq, h, d)
    full[valid_q] = out
    return full, None


def register_attention() -> str:
    """Register ``"mmbalance_varlen"`` with transformers' ``AttentionInterface`` (and its
    2-D padding-mask function with ``AttentionMaskInterface``); returns the name. Idempotent.

    Select it with ``attn_implementation="mmbalance_varlen"`` (``from_pretrained``,
    ``from_config``) or ``model.set_attn_implementation("mmbalance_varlen")``. For packed batches
    pass ``position_ids`` that restart at every sequence (or ``cu_seq_lens_q/k``) with batch size 1,
    and ``use_cache=False`` when training.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)
    return ATTENTION_NAME
