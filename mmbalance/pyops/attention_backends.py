"""Which implementation runs an attention block call, and the flash-attn path.

Three backends, in ``"auto"``'s order of preference: flash-attn (CUDA, when installed and the call
is one it supports: ``flash_attn_unsupported_reasons`` says why not), the Triton kernels (CUDA, or
CPU tensors under ``TRITON_INTERPRET=1``; not float64) and the torch reference, which runs
everything. The choice goes through :func:`mmbalance.kernels.dispatch.select_backend`, so a forced
backend that cannot run a call raises with the reasons, and ``MMBALANCE_ATTN_BACKEND`` forces one
for a whole run.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from torch import Tensor

from mmbalance.kernels.dispatch import Backend, select_backend, triton_unsupported_reasons

__all__ = ["flash_attn_unsupported_reasons"]


@functools.lru_cache(maxsize=1)
def _flash_attn_interface():
    try:
        import flash_attn.flash_attn_interface as fai
    except ImportError:
        return None
    return fai


# Whether the installed flash-attn returns the varlen LSE packed as [H, Tq] (2.x releases since the
# varlen LSE stopped being padded) - learnt from the first forward; its backward is only used then.
_FLASH_LSE_PACKED: dict[str, bool] = {}


def flash_attn_unsupported_reasons(
    q: Tensor,
    causal: bool,
    causal_offset: int,
    has_runs: bool,
    same_cu: bool,
    has_dlse: bool = False,
    backward: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    has_sinks: bool = False,
) -> list[str]:
    """Why flash-attn cannot run this block call (empty list: it can).

    flash-attn aligns causal masks and windows bottom-right per sequence, so only masks over
    identical query and key boundaries without offsets or runs (where both alignments agree) map
    onto it. flash-attn 2 has no attention sinks.
    """
    if not q.is_cuda:
        return ["flash-attn needs CUDA tensors"]
    reasons = []
    if _flash_attn_interface() is None:
        reasons.append("flash-attn is not installed")
    if q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"flash-attn supports float16/bfloat16, not {q.dtype}")
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        reasons.append(f"flash-attn needs a head dim <= 256 and a multiple of 8, got {q.shape[-1]}")
    windowed = window_left >= 0 or window_right >= 0
    if (causal or windowed) and (has_runs or causal_offset != 0 or not same_cu):
        reasons.append("flash-attn has no position runs / causal offset (needs identical cu_seqlens)")
    fai = _flash_attn_interface()
    if fai is not None:
        params = inspect.signature(fai.flash_attn_varlen_func).parameters
        if windowed and "window_size" not in params:
            reasons.append("the installed flash-attn has no sliding window (window_size)")
        if softcap > 0 and "softcap" not in params:
            reasons.append("the installed flash-attn has no softcap")
    if has_sinks:
        reasons.append("flash-attn 2 has no attention sinks")
    if has_dlse:
        reasons.append("flash-attn's backward takes no gradient of the LSE")
    if backward and not _FLASH_LSE_PACKED.get("packed", False):
        reasons.append(
            "flash-attn's backward is used only after a flash-attn forward returned a packed [H, Tq] LSE"
        )
    return reasons


def _triton_reasons(*tensors: Tensor) -> list[str]:
    reasons = triton_unsupported_reasons(tensors[0])
    if any(t.dtype == torch.float64 for t in tensors):
        reasons.append("the Triton kernels take float16, bfloat16 and float32, not float64")
    return reasons


def _select_backend(
    backend: str,
    q: Tensor,
    causal,
    causal_offset,
    has_runs,
    same_cu,
    has_dlse=False,
    backward=False,
    **features,
) -> str:
    """The backend that runs this call (:func:`mmbalance.kernels.dispatch.select_backend`: flash-attn,
    then Triton, then the reference); ``features``: ``flash_attn_unsupported_reasons``' keywords."""
    call = (q, causal, causal_offset, has_runs, same_cu, has_dlse, backward)
    backends = (
        Backend("flash_attn", lambda: flash_attn_unsupported_reasons(*call, **features)),
        Backend("triton", lambda: _triton_reasons(q)),
        Backend("reference", lambda: []),
    )
    return select_backend("attention_block", backends, backend, env="MMBALANCE_ATTN_BACKEND")


def _flash_fwd(
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left=-1, window_right=-1, softcap=0.0
):
    fai = _flash_attn_interface()
    extra = {}
    # only what the call needs, so releases without these arguments still run plain calls
    if window_left >= 0 or window_right >= 0:
        extra["window_size"] = (window_left, window_right)
    if softcap > 0:
        extra["softcap"] = softcap
    out, lse, _ = fai.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        return_attn_probs=True, **extra,
    )  # fmt: skip
    _FLASH_LSE_PACKED["packed"] = lse.dim() == 2
    if lse.dim() == 3:
        # older releases pad the varlen LSE to [B, H, max_seqlen_q]: gather it packed, on the device
        tokens = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype)
        seq = torch.searchsorted(cu_q, tokens, right=True) - 1
        lse = lse[seq.long(), :, (tokens - cu_q[seq]).long()].t()
    # flash-attn marks rows without keys with +inf; this library uses -inf
    return out, torch.where(lse == math.inf, -math.inf, lse.float()).contiguous()


def _flash_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_q,
    max_k,
    scale,
    causal,
    window_left=-1,
    window_right=-1,
    softcap=0.0,
):
    fai = _flash_attn_interface()
    fn = fai._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    values = dict(
        dout=dout.contiguous(), q=q, k=k, v=v, out=out.to(q.dtype).contiguous(),
        softmax_lse=torch.where(lse == -math.inf, math.inf, lse).float().contiguous(),
        dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(window_left, window_right),
        window_size_left=window_left, window_size_right=window_right, softcap=softcap, alibi_slopes=None,
        deterministic=False, rng_state=None,
    )  # fmt: skip
    # the private backward's signature changed across 2.x releases: pass what it names
    params = inspect.signature(fn).parameters
    fn(**{name: values[name] for name in params if name in values})
    return dq.float(), dk.float(), dv.float()
