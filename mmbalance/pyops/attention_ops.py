"""Attention block ops for ring attention: ``torch.ops.mmbalance.attention_block_fwd``/``_bwd`` and
``merge_attention_states``. The file reads like flash-attn's interface: the ops with their fake
implementations, then autograd, then the public functions.

Ops (schemas)::

    mmbalance::attention_block_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
        SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, SymInt causal_offset,
        Tensor? q_runs, Tensor? k_runs, ScalarType? out_dtype, str backend, SymInt window_left=-1,
        SymInt window_right=-1, float softcap=0., Tensor? sinks=None) -> (Tensor out, Tensor lse)
    mmbalance::attention_block_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
        Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k,
        float softmax_scale, bool causal, SymInt causal_offset, Tensor? q_runs, Tensor? k_runs,
        Tensor? dlse, str backend, SymInt window_left=-1, SymInt window_right=-1, float softcap=0.)
        -> (Tensor dq, Tensor dk, Tensor dv)
    mmbalance::merge_attention_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, str backend)
        -> (Tensor out, Tensor lse)

Semantics (shapes, masks, empty rows) are those of ``kernels/attention_fwd.py``: packed
``q [Tq, H, D]``, ``k``/``v [Tk, Hkv, D]`` (``H`` a multiple of ``Hkv``), int32 ``cu_seqlens``
``[B + 1]``, ``lse [H, Tq]`` float32 in natural log, ``-inf`` (and ``out = 0``) for rows that see no
key. Causal masks compare absolute positions, ``pos_k <= pos_q``; without run tensors query ``i``
sits at ``i + causal_offset`` and key ``j`` at ``j`` (top-left aligned); ``q_runs``/``k_runs``
int32 ``[B, 3]`` give each sequence's positions as two runs ``(start0, len0, start1)``.

Optional features (defaults: off), flash-attn's semantics on these positions: a sliding window
(key ``j`` allowed for query ``i`` only if ``pos_q(i) - window_left <= pos_k(j) <= pos_q(i) +
window_right``, ``-1``: unbounded; combined with the causal rule), logit softcapping (``s =
softcap * tanh(scale * <q, k> / softcap)``, Gemma 2) and per-head attention sinks (a logit
``sinks[h]`` that joins each row's softmax denominator only: the returned ``lse`` includes it, a
row with no allowed key has ``lse = sinks[h]`` and ``out = 0``). The backward op takes no sinks:
it recomputes the probabilities from the ``lse`` that includes them; their gradient is
``sinks_backward``'s, in torch.

Backends (``backend=``, chosen in ``attention_backends.py`` from an ``AttentionInputs`` that
describes the call): ``"auto"`` picks flash-attn on CUDA when it is installed and supports the call
(see ``flash_attn_unsupported_reasons``), then ``torch_flash`` (torch's own FlashAttention varlen
kernels, ``torch_flash_unsupported_reasons``), the Triton kernels on other CUDA calls and on CPU
under ``TRITON_INTERPRET=1``, and the torch reference (``attention_ref.py``) otherwise and for
float64; on Hopper with torch's FlashAttention-2 at head dims 65-128 the Triton kernels come before
``torch_flash`` (``attention_backends.auto_order``: measured faster there). ``"flash_attn"``, ``"torch_flash"``, ``"triton"`` and ``"reference"`` force one and raise
ValueError with the call and the reasons when it cannot run. ``MMBALANCE_ATTN_BACKEND`` sets what ``"auto"`` means for a run.

Autocast: under ``torch.autocast`` (CPU or CUDA) both block ops cast their float16/bfloat16/float32
``q``, ``k``, ``v`` (and ``dout``) to the autocast dtype before they run, as torch's own attention
does, so inputs of mixed dtypes (HF decoders under autocast hand over float32 queries and keys and
bfloat16 values) run in the autocast dtype; ``lse`` stays float32. Outside autocast, q, k and v
must share a dtype.

Autograd: ``attention_block`` (the forward op) differentiates to ``attention_block_bwd``, including
a gradient reaching ``lse``, and to the sinks through ``sinks_backward``; ``merge_attention_states``
has a closed-form backward in torch.

The Triton kernels take the features as keyword arguments (``window_left``, ``window_right``,
``softcap`` forward and backward, ``sinks`` forward), specialized at compile time so a call without
them runs the same code as before they existed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from mmbalance.kernels import attention_bwd, attention_fwd, merge

from .attention_backends import (
    AttentionInputs,
    MergeInputs,
    flash_bwd,
    flash_fwd,
    select_attention_backend,
    select_merge_backend,
    torch_flash_bwd,
    torch_flash_fwd,
)
from .attention_checks import (
    check_block_args,
    check_bwd_args,
    check_features,
    check_host_args,
    check_host_features,
    check_merge_args,
)
from .attention_ref import (
    acc_dtype,
    attention_block_bwd_ref,
    attention_block_fwd_ref,
    merge_attention_states_ref,
    sinks_grad,
)
from .varlen import direct_eligible

__all__ = [
    "attention_block",
    "attention_block_backward",
    "merge_attention_states",
    "sinks_backward",
]


def _new_output(shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocation of every kernel-path output (one place, so tests can poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ------------------------------------------------------------------- ops and their fake kernels
def _attention_block_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int,
    q_runs: Tensor | None,
    k_runs: Tensor | None,
    out_dtype: torch.dtype | None,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    check_block_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, q_runs, k_runs
    )
    check_features(q, window_left, window_right, softcap, sinks)
    inputs = AttentionInputs.of(
        q, k, cu_seqlens_q, cu_seqlens_k, causal=causal, causal_offset=causal_offset, q_runs=q_runs,
        window_left=window_left, window_right=window_right, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    # the kernels index cu_seqlens through its raw pointer: any strided view becomes contiguous
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    window: dict[str, Any] = dict(window_left=window_left, window_right=window_right, softcap=softcap)
    chosen = select_attention_backend(backend, inputs)
    if chosen == "reference":
        return attention_block_fwd_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset, q_runs, k_runs,
            out_dtype, window_left, window_right, softcap, sinks,
        )  # fmt: skip
    if chosen == "flash_attn":
        out, lse = flash_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, **window
        )
        return out.to(out_dtype or q.dtype), lse
    if chosen == "torch_flash":
        out, lse = torch_flash_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                   causal, window_left, window_right)  # fmt: skip
        return out.to(out_dtype or q.dtype), lse
    out = _new_output(q.shape, out_dtype or q.dtype, q.device)
    lse = _new_output((q.shape[1], q.shape[0]), torch.float32, q.device)
    sinks32 = None if sinks is None else sinks.to(torch.float32).contiguous()
    attention_fwd.attn_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, causal, causal_offset, q_runs, k_runs,
        out=out, lse=lse, sinks=sinks32, **window,
    )  # fmt: skip
    return out, lse


@torch.library.custom_op("mmbalance::attention_block_fwd", mutates_args=())
def _attention_block_fwd_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int,
    q_runs: Tensor | None,
    k_runs: Tensor | None,
    out_dtype: torch.dtype | None,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return _attention_block_fwd_impl(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, causal_offset,
        q_runs, k_runs, out_dtype, backend, window_left, window_right, softcap, sinks,
    )  # fmt: skip


@_attention_block_fwd_op.register_fake
def _attention_block_fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, causal_offset,
    q_runs, k_runs, out_dtype, backend, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
):  # fmt: skip
    check_block_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, q_runs, k_runs
    )
    check_features(q, window_left, window_right, softcap, sinks)
    out = q.new_empty(q.shape, dtype=out_dtype or q.dtype)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q))


def _attention_block_bwd_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int,
    q_runs: Tensor | None,
    k_runs: Tensor | None,
    dlse: Tensor | None,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    check_bwd_args(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   q_runs, k_runs, dlse)  # fmt: skip
    check_features(q, window_left, window_right, softcap, None)
    inputs = AttentionInputs.of(
        q, k, cu_seqlens_q, cu_seqlens_k, causal=causal, causal_offset=causal_offset, q_runs=q_runs,
        window_left=window_left, window_right=window_right, softcap=softcap, backward=True, dlse=dlse,
    )  # fmt: skip
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    window: dict[str, Any] = dict(window_left=window_left, window_right=window_right, softcap=softcap)
    chosen = select_attention_backend(backend, inputs)
    if chosen == "reference":
        return attention_block_bwd_ref(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, causal_offset,
            q_runs, k_runs, dlse, window_left, window_right, softcap,
        )  # fmt: skip
    if chosen == "flash_attn":
        return flash_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, **window)  # fmt: skip
    if chosen == "torch_flash":
        return torch_flash_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_left, window_right)  # fmt: skip
    grads = (
        _new_output(q.shape, torch.float32, q.device),
        _new_output(k.shape, torch.float32, q.device),
        _new_output(v.shape, torch.float32, q.device),
    )
    return attention_bwd.attn_bwd(
        dout, q, k, v, out, lse.float(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        causal, causal_offset, q_runs, k_runs, dlse=None if dlse is None else dlse.float(), grads=grads, **window,
    )  # fmt: skip


@torch.library.custom_op("mmbalance::attention_block_bwd", mutates_args=())
def _attention_block_bwd_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int,
    q_runs: Tensor | None,
    k_runs: Tensor | None,
    dlse: Tensor | None,
    backend: str,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    return _attention_block_bwd_impl(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        causal_offset, q_runs, k_runs, dlse, backend, window_left, window_right, softcap,
    )  # fmt: skip


@_attention_block_bwd_op.register_fake
def _attention_block_bwd_fake(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    causal_offset, q_runs, k_runs, dlse, backend, window_left=-1, window_right=-1, softcap=0.0,
):  # fmt: skip
    check_bwd_args(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                   q_runs, k_runs, dlse)  # fmt: skip
    check_features(q, window_left, window_right, softcap, None)
    dtype = acc_dtype(q)
    return (
        q.new_empty(q.shape, dtype=dtype),
        k.new_empty(k.shape, dtype=dtype),
        v.new_empty(v.shape, dtype=dtype),
    )


@torch.library.custom_op("mmbalance::merge_attention_states", mutates_args=())
def _merge_attention_states_op(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    check_merge_args(out_a, lse_a, out_b, lse_b)
    if select_merge_backend(backend, MergeInputs.of(out_a, lse_a, out_b, lse_b)) == "reference":
        return merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    out = _new_output(out_a.shape, torch.float32, out_a.device)
    lse = _new_output((out_a.shape[1], out_a.shape[0]), torch.float32, out_a.device)
    return merge.merge_attn_fwd(out_a, lse_a, out_b, lse_b, out=out, lse=lse)


@_merge_attention_states_op.register_fake
def _merge_attention_states_fake(out_a, lse_a, out_b, lse_b, backend):
    check_merge_args(out_a, lse_a, out_b, lse_b)
    dtype = acc_dtype(out_a, out_b, lse_a, lse_b)
    return out_a.new_empty(out_a.shape, dtype=dtype), lse_a.new_empty(lse_a.shape, dtype=dtype)


# ------------------------------------------------------------------------------------- autograd
def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, offset, q_runs, k_runs, _, backend = inputs[:14]
    window_left, window_right, softcap, sinks = inputs[14:]
    out, lse = output
    # one boundary tensor for queries and keys stays one in the backward (a saved-tensor hook that
    # copies each slot, such as offloading, would otherwise make them two and lose the kernels that
    # need identical boundaries)
    ctx.same_cu = cu_q is cu_k
    ctx.save_for_backward(q, k, v, cu_q, None if ctx.same_cu else cu_k, out, lse, q_runs, k_runs, sinks)
    ctx.args = (max_q, max_k, scale, causal, offset)
    ctx.features = (window_left, window_right, softcap)
    ctx.backend = backend
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, cu_q, cu_k, out, lse, q_runs, k_runs, sinks = ctx.saved_tensors
    if ctx.same_cu:
        cu_k = cu_q
    d_sinks = None
    if sinks is not None and ctx.needs_input_grad[17]:
        d_sinks = sinks_backward(sinks, out, lse, dout, dlse)
    if dout is None:
        dout = torch.zeros_like(q)
    # a gradient of the LSE: no FlashAttention backward takes one, the Triton kernels do
    backend = ctx.backend if dlse is None or ctx.backend not in ("flash_attn", "torch_flash") else "triton"
    # incoming gradients may be expanded views (e.g. of a sum); the kernels need a unit last stride
    dout = dout.to(q.dtype).contiguous()
    dlse = None if dlse is None else dlse.contiguous()
    args = (dout, q, k, v, out, lse, cu_q, cu_k, *ctx.args, q_runs, k_runs, dlse, backend, *ctx.features)
    # a backward that records a graph (create_graph) takes the op, whose missing derivative then says so
    if _direct(q) and not torch.is_grad_enabled():
        dq, dk, dv = _attention_block_bwd_impl(*args)
    else:
        dq, dk, dv = torch.ops.mmbalance.attention_block_bwd(*args)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 14), d_sinks


torch.library.register_autograd("mmbalance::attention_block_fwd", _fwd_backward, setup_context=_fwd_setup)


# Eager calls on plain CUDA tensors run the implementation straight, through
# :class:`_AttentionDirect` for autograd, instead of through ``torch.ops`` dispatch, whose Python
# custom-op path costs the host hundreds of microseconds a forward and backward (measured on an
# H200 host: about 2 ms of host time a step against 0.45 ms of kernels at 32 x 512 tokens). The
# ops stay what ``torch.compile``, fake tensors, tensor subclasses, dispatch and torch-function
# modes, autocast (its casting rules are registered on the ops) and ``MMBALANCE_DEBUG`` go
# through; both paths run the same implementation and the same checks.
def _direct(q: Tensor) -> bool:
    """Whether a call on ``q`` runs its implementation straight (see above)."""
    return direct_eligible(q) and not torch.is_autocast_enabled("cuda")


class _AttentionDirect(torch.autograd.Function):
    """Autograd of a direct forward: the op's implementation, its registered setup and backward."""

    @staticmethod
    def forward(ctx, *args):
        output = _attention_block_fwd_impl(*args)
        _fwd_setup(ctx, args, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _fwd_backward(ctx, dout, dlse)


def _fwd_call(*args) -> tuple[Tensor, Tensor]:
    """The forward op's arguments, through the direct path where it applies, else the op."""
    q = args[0]
    if not _direct(q):
        return torch.ops.mmbalance.attention_block_fwd(*args)
    sinks = args[17]
    wants_grad = any(t is not None and t.requires_grad for t in (q, args[1], args[2], sinks))
    if torch.is_grad_enabled() and wants_grad:
        return _AttentionDirect.apply(*args)
    return _attention_block_fwd_impl(*args)


def _merge_setup(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b, _ = inputs
    out, lse = output
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)


def _merge_backward(ctx, dout, dlse):
    out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
    acc = out.dtype
    w_a = torch.where(lse == -math.inf, 0.0, torch.exp(lse_a.to(acc) - lse))
    w_b = torch.where(lse == -math.inf, 0.0, torch.exp(lse_b.to(acc) - lse))
    # d out / d lse_a = w_a * (out_a - out); d lse / d lse_a = w_a
    row_a = (dout * (out_a.to(acc) - out)).sum(-1).t() + dlse
    row_b = (dout * (out_b.to(acc) - out)).sum(-1).t() + dlse
    d_out_a = (dout * w_a.t()[..., None]).to(out_a.dtype)
    d_out_b = (dout * w_b.t()[..., None]).to(out_b.dtype)
    return d_out_a, (w_a * row_a).to(lse_a.dtype), d_out_b, (w_b * row_b).to(lse_b.dtype), None


torch.library.register_autograd(
    "mmbalance::merge_attention_states", _merge_backward, setup_context=_merge_setup
)


# ------------------------------------------------------------------------------------- autocast
# torch.library.register_autocast casts to one dtype fixed at registration; these rules cast to the
# dtype of the autocast region the call runs in (bfloat16 or float16), like torch's own attention
# (scaled_dot_product_attention is on autocast's lower-precision list). Only the attention inputs
# are cast: lse/dlse stay float32, sinks and out keep their dtype, and merge_attention_states needs
# no rule (it takes any float dtypes and returns float32).
_AUTOCAST_LIB = torch.library.Library("mmbalance", "IMPL")
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def _register_autocast(opname: str, cast: tuple[str, ...]) -> None:
    op = getattr(torch.ops.mmbalance, opname).default
    names = [a.name for a in op._schema.arguments]
    positions = {names.index(n) for n in cast}
    for device_type in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        dispatch_key = getattr(torch._C.DispatchKey, key)

        def run(*args, _device=device_type, _key=dispatch_key, **kwargs):
            dtype = torch.get_autocast_dtype(_device)

            def cast_one(t):
                eligible = (
                    isinstance(t, Tensor) and t.device.type == _device and t.dtype in _AUTOCAST_ELIGIBLE
                )
                return t.to(dtype) if eligible else t

            args = tuple(cast_one(a) if i in positions else a for i, a in enumerate(args))
            kwargs = {n: cast_one(a) if n in cast else a for n, a in kwargs.items()}
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return op(*args, **kwargs)

        op.py_impl(dispatch_key)(run)  # the Python dispatcher's path (torch.compile, make_fx)
        _AUTOCAST_LIB.impl(opname, lambda _keyset, *args, _run=run, **kwargs: _run(*args, **kwargs), key,
                           with_keyset=True)  # fmt: skip


_register_autocast("attention_block_fwd", ("q", "k", "v"))
_register_autocast("attention_block_bwd", ("dout", "q", "k", "v"))


# ------------------------------------------------------------------------------ public functions
def attention_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    causal_offset: int = 0,
    q_runs: Tensor | None = None,
    k_runs: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of packed varlen queries against one block of keys/values, with its LSE.

    Args:
        q: ``[Tq, H, D]`` float16/bfloat16/float32 (float64: reference path only); last dim contiguous.
        k, v: ``[Tk, Hkv, D]``, ``H % Hkv == 0`` (GQA: query head ``h`` uses kv head ``h // (H / Hkv)``).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on q's device; sequence ``b`` pairs query rows
            ``cu_q[b]:cu_q[b+1]`` with key rows ``cu_k[b]:cu_k[b+1]``; empty sequences are legal.
        max_seqlen_q, max_seqlen_k: host ints, at least the longest sequence (grid sizes).
        softmax_scale: default ``D ** -0.5``.
        causal: mask keys whose position exceeds the query's; positions are ``i + causal_offset``
            for queries and ``j`` for keys unless ``q_runs``/``k_runs`` (int32 ``[B, 3]``, rows
            ``(start0, len0, start1)``: token ``t`` at ``start0 + t`` if ``t < len0`` else
            ``start1 + t - len0``, ``start1 >= start0 + len0``) are given.
        out_dtype: dtype of ``out`` (default q's; float32 keeps partial results unrounded).
        backend: ``"auto"``, ``"flash_attn"``, ``"torch_flash"``, ``"triton"`` or ``"reference"``
            (module docstring).
        window_left, window_right: sliding window in positions (flash-attn's semantics): key ``j``
            is allowed for query ``i`` only if ``pos_k(j) >= pos_q(i) - window_left`` (when
            ``window_left >= 0``) and ``pos_k(j) <= pos_q(i) + window_right`` (when
            ``window_right >= 0``), on top of the causal rule; ``-1`` is unbounded. Positions are
            those above, also without ``causal``.
        softcap: when ``> 0`` the logits are ``softcap * tanh(softmax_scale * <q, k> / softcap)``.
        sinks: optional float ``[H]`` per-head sink logit: it joins each row's softmax denominator
            only (``lse = log(exp(sinks[h]) + sum_j exp(s_ij))``); a row with no allowed key gets
            ``out = 0``, ``lse = sinks[h]``. Differentiable.

    Returns:
        ``out [Tq, H, D]`` and ``lse [H, Tq]`` float32 (float64 for float64 inputs). Rows that see
        no key: ``out = 0``, ``lse = -inf`` (``sinks[h]`` with sinks). Differentiable in ``q``,
        ``k``, ``v`` and ``sinks`` through both.
    """
    softmax_scale = check_host_args(q, max_seqlen_q, max_seqlen_k, causal_offset, softmax_scale)
    softcap = check_host_features(window_left, window_right, softcap, sinks)
    return _fwd_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal),
        causal_offset, q_runs, k_runs, out_dtype, backend, window_left, window_right, softcap, sinks,
    )  # fmt: skip


def attention_block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    causal_offset: int = 0,
    q_runs: Tensor | None = None,
    k_runs: Tensor | None = None,
    dlse: Tensor | None = None,
    backend: str = "auto",
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one attention block from the saved ``out`` and ``lse`` (FlashAttention-2 style).

    ``dout`` has q's shape and dtype; ``out`` q's shape (any float dtype); ``lse [H, Tq]`` may be
    the LSE merged over more keys than this block holds, so summing the block gradients of a ring
    gives the gradient of the merged output. ``dlse`` (``[H, Tq]``) is an optional gradient
    reaching the LSE. Mask, window and softcap arguments as in ``attention_block``; sinks need
    nothing here (they are inside ``lse``; ``sinks_backward`` gives their gradient). Returns
    float32 (float64 for float64 inputs) ``dq [Tq, H, D]``, ``dk``, ``dv [Tk, Hkv, D]``: cast once
    after summing.
    """
    softmax_scale = check_host_args(q, max_seqlen_q, max_seqlen_k, causal_offset, softmax_scale)
    softcap = check_host_features(window_left, window_right, softcap)
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            bool(causal), causal_offset, q_runs, k_runs, dlse, backend, window_left, window_right, softcap)  # fmt: skip
    # the op has no derivative: where one could be asked for, the op is called and says so
    recorded = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in args)
    if _direct(q) and not recorded:
        return _attention_block_bwd_impl(*args)
    return torch.ops.mmbalance.attention_block_bwd(*args)


def merge_attention_states(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Combine two partial attention results over disjoint key sets into the result over both.

    ``out_a``, ``out_b``: ``[T, H, D]`` (any float dtypes, e.g. a float32 running result and a
    bfloat16 block); ``lse_a``, ``lse_b``: ``[H, T]`` float32. Returns float32 (float64 if any input
    is float64) ``out`` and ``lse``; a row with ``-inf`` on both sides stays ``out = 0``,
    ``lse = -inf``. ``T = 0`` returns empty tensors. Differentiable in all four inputs.
    """
    return torch.ops.mmbalance.merge_attention_states(out_a, lse_a, out_b, lse_b, backend)


def sinks_backward(
    sinks: Tensor, out: Tensor, lse: Tensor, dout: Tensor | None, dlse: Tensor | None
) -> Tensor:
    """Gradient in the attention sinks ``[H]`` (``sinks``' dtype) from the forward's ``out
    [Tq, H, D]`` and ``lse [H, Tq]`` (which includes the sinks) and the incoming ``dout``/``dlse``
    (None: zero).

    The sink joins every row's denominator: ``d lse_hi / d sink_h = exp(sink_h - lse_hi)`` and
    ``d out_hi / d sink_h = -exp(sink_h - lse_hi) out_hi``, so
    ``d sink_h = sum_i exp(sink_h - lse_hi) * (dlse_hi - rowsum(dout_hi * out_hi))``.
    """
    return sinks_grad(sinks, out, lse, dout, dlse)
