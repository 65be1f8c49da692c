"""Varlen pack / unpack / segment gather as ``torch.ops.mmbalance`` custom ops, plus index helpers.

Ops (schemas)::

    mmbalance::pack(Tensor padded, Tensor seqlens, SymInt total_tokens) -> Tensor
    mmbalance::unpack(Tensor packed, Tensor cu_seqlens, SymInt max_seqlen, float pad_value=0.) -> Tensor
    mmbalance::segment_gather(Tensor packed, Tensor cu_seqlens, Tensor order, SymInt out_tokens) -> Tensor
    mmbalance::segment_scatter(Tensor src, Tensor cu_seqlens, Tensor order, SymInt total_tokens) -> Tensor

Layout: packed tokens ``[T, *]`` with ``cu_seqlens`` (``n + 1`` entries, ``cu[0] = 0``,
non-decreasing, ``cu[-1] = T``); zero-length segments are legal. Sizes that shape an output are
host ints from the plan, so no op syncs with the device or has a data-dependent shape, and
``torch.compile`` traces every op through its fake implementation without graph breaks.

Dispatch (one rule for every op): CUDA tensors run the Triton kernels of ``kernels/varlen.py``; CPU
tensors run them only under ``TRITON_INTERPRET=1`` and otherwise take the references of
``pyops/varlen_ref.py``. Autograd: ``pack`` and ``unpack`` are each other's adjoint, as are
``segment_gather`` and ``segment_scatter`` (the scatter with the same ``order`` is the inverse
rearrangement; segments not in ``order`` receive zeros), so double backward works too.

Where the idea comes from: flash-attention's ``bert_padding`` helpers (``unpad_input`` /
``pad_input``) without their ``nonzero`` and ``.item()`` syncs, and OrchMLLM's rearrangement of
examples by destination rank around the all-to-all (OrchMLLM section 5.2.1); the rearrangement
is consequence-invariant (section 3.3), so gathering examples forward and scattering gradients back
with the adjoint leaves the step's gradients unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmbalance.kernels import varlen as _kernels
from mmbalance.kernels.dispatch import use_triton

from . import varlen_ref as _ref
from .checks import debug_enabled, value_checks_enabled

__all__ = [
    "pack",
    "unpack",
    "segment_gather",
    "segment_scatter",
    "cu_seqlens_from_lengths",
    "position_ids_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "gathered_cu_seqlens",
    "inverse_permutation",
    "direct_eligible",
]


def _new_output(like: Tensor, shape: tuple) -> Tensor:
    """Allocation of every kernel-path output (one place, so tests can poison it)."""
    return like.new_empty(shape)


def _rows(x: Tensor, lead: int) -> Tensor:
    """``x`` as ``[*x.shape[:lead], row_elems]`` with last stride 1 (copies only when the trailing
    dims cannot be flattened or the last one is strided); bool viewed as uint8 for the kernel."""
    if x.dim() == lead + 1 and (x.stride(-1) == 1 or x.shape[-1] <= 1):
        y = x  # already rows (the usual case): no reshape to pay for
    else:
        row_elems = math.prod(x.shape[lead:])
        y = x.reshape(*x.shape[:lead], row_elems)
        if row_elems > 1 and y.stride(-1) != 1:
            y = y.contiguous()
    return y.view(torch.uint8) if y.dtype == torch.bool else y


# Eager calls on plain CUDA tensors run their kernel straight, through :class:`_Direct` for
# autograd, instead of through ``torch.ops`` dispatch: the dispatch of a Python custom op costs tens
# of microseconds of host time, several times these kernels' own time on small inputs. The custom
# ops stay what ``torch.compile``, fake tensors, tensor subclasses and ``MMBALANCE_DEBUG`` (its
# value checks) go through; both run the same implementation and the same checks.
_PLAIN = (Tensor, torch.nn.Parameter)


def direct_eligible(x) -> bool:
    """Whether a call on ``x`` runs its kernel straight (see above): not while a dispatch or torch
    function mode is active (``make_fx``, ``FlopCounterMode``, debug modes must see the op)."""
    return (
        type(x) in _PLAIN
        and x.is_cuda
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and not debug_enabled()
    )


class _Direct(torch.autograd.Function):
    """Autograd of a direct call: the op's implementation forward, its registered backward."""

    @staticmethod
    def forward(ctx, impl, setup, backward, *args):
        out = impl(*args)
        setup(ctx, args, out)
        ctx.backward_fn = backward
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *ctx.backward_fn(ctx, grad))


def _call_direct(impl, setup, backward, *args):
    if torch.is_grad_enabled() and args[0].requires_grad:
        return _Direct.apply(impl, setup, backward, *args)
    return impl(*args)


# ----------------------------------------------------------------------------------------------
# pack


def _check_pack(padded, seqlens, total_tokens) -> None:
    _ref.check_payload("padded", padded, 2)
    _ref.check_index("seqlens", seqlens, padded, "padded")
    if seqlens.shape[0] != padded.shape[0]:
        raise ValueError(
            f"seqlens has {seqlens.shape[0]} entries but padded has batch size {padded.shape[0]}"
        )
    _ref.check_size("total_tokens", total_tokens)


def _pack_impl(padded: Tensor, seqlens: Tensor, total_tokens: int) -> Tensor:
    _check_pack(padded, seqlens, total_tokens)
    if value_checks_enabled(padded):
        _ref.check_lengths_values("seqlens", seqlens)
        if seqlens.numel() and int(seqlens.max()) > padded.shape[1]:
            b = int(seqlens.argmax())
            raise ValueError(f"seqlens[{b}] = {int(seqlens[b])} exceeds padded.shape[1] = {padded.shape[1]}")
        if int(seqlens.sum()) != total_tokens:
            raise ValueError(
                f"total_tokens = {total_tokens} does not match seqlens.sum() = {int(seqlens.sum())}"
            )
    if not use_triton(padded):
        return _ref.pack_ref(padded, seqlens, total_tokens)
    out = _new_output(padded, (total_tokens, *padded.shape[2:]))
    cu = _ref.exclusive_cumsum(seqlens, seqlens.dtype)
    _kernels.pack_fwd(_rows(padded, 2), cu, _rows(out, 1))
    return out


@torch.library.custom_op("mmbalance::pack", mutates_args=())
def _pack_op(padded: Tensor, seqlens: Tensor, total_tokens: int) -> Tensor:
    return _pack_impl(padded, seqlens, total_tokens)


@_pack_op.register_fake
def _pack_fake(padded, seqlens, total_tokens):
    _check_pack(padded, seqlens, total_tokens)
    return padded.new_empty((total_tokens, *padded.shape[2:]))


def _pack_setup(ctx, inputs, output):
    padded, seqlens, _ = inputs
    ctx.save_for_backward(seqlens)
    ctx.max_len = padded.shape[1]


def _pack_backward(ctx, grad):
    (seqlens,) = ctx.saved_tensors
    cu = _ref.exclusive_cumsum(seqlens, seqlens.dtype)
    return unpack(grad, cu, ctx.max_len, 0.0), None, None


torch.library.register_autograd("mmbalance::pack", _pack_backward, setup_context=_pack_setup)


def pack(padded: Tensor, seqlens: Tensor, total_tokens: int) -> Tensor:
    """Pack a padded batch into varlen layout (flash-attn ``unpad_input`` without the host sync).

    Args:
        padded: ``[B, S, *]``, any float, integer or bool dtype; only the last dim must be
            contiguous.
        seqlens: ``[B]`` int32 or int64, ``0 <= seqlens[b] <= S`` (zero is legal), same device.
        total_tokens: ``T = seqlens.sum()`` as a host int (known from the plan).

    Returns:
        ``[T, *]`` in ``padded``'s dtype: the first ``seqlens[b]`` rows of every example, in
        batch order. ``B = 0`` or ``T = 0`` gives an empty ``[0, *]`` tensor and launches nothing.

    Raises ValueError/TypeError naming the argument; the value checks (lengths in range, the sum)
    run on CPU always and on CUDA with ``MMBALANCE_DEBUG=1``. Backward: ``unpack`` of the gradient.
    """
    _ref.check_size("total_tokens", total_tokens)
    if direct_eligible(padded):
        return _call_direct(_pack_impl, _pack_setup, _pack_backward, padded, seqlens, total_tokens)
    return torch.ops.mmbalance.pack(padded, seqlens, total_tokens)


# ----------------------------------------------------------------------------------------------
# unpack


def _check_unpack(packed, cu_seqlens, max_seqlen, pad_value) -> None:
    _ref.check_payload("packed", packed, 1)
    _ref.check_cu_seqlens("cu_seqlens", cu_seqlens, packed, "packed")
    _ref.check_size("max_seqlen", max_seqlen)
    _ref.check_pad_value(pad_value, packed.dtype)


def _unpack_impl(packed: Tensor, cu_seqlens: Tensor, max_seqlen: int, pad_value: float = 0.0) -> Tensor:
    _check_unpack(packed, cu_seqlens, max_seqlen, pad_value)
    if value_checks_enabled(packed):
        _ref.check_cu_seqlens_values("cu_seqlens", cu_seqlens, packed.shape[0], "packed.shape[0]")
        if cu_seqlens.shape[0] > 1:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            if longest > max_seqlen:
                raise ValueError(f"max_seqlen = {max_seqlen} is smaller than the longest segment ({longest})")
    if not use_triton(packed):
        return _ref.unpack_ref(packed, cu_seqlens, max_seqlen, pad_value)
    n = cu_seqlens.shape[0] - 1
    out = _new_output(packed, (n, max_seqlen, *packed.shape[1:]))
    pad = _rows(torch.full((1,), pad_value, dtype=packed.dtype, device=packed.device), 0)
    _kernels.unpack_fwd(_rows(packed, 1), cu_seqlens.contiguous(), _rows(out, 2), pad)
    return out


@torch.library.custom_op("mmbalance::unpack", mutates_args=())
def _unpack_op(packed: Tensor, cu_seqlens: Tensor, max_seqlen: int, pad_value: float = 0.0) -> Tensor:
    return _unpack_impl(packed, cu_seqlens, max_seqlen, pad_value)


@_unpack_op.register_fake
def _unpack_fake(packed, cu_seqlens, max_seqlen, pad_value=0.0):
    _check_unpack(packed, cu_seqlens, max_seqlen, pad_value)
    return packed.new_empty((cu_seqlens.shape[0] - 1, max_seqlen, *packed.shape[1:]))


def _unpack_setup(ctx, inputs, output):
    packed, cu_seqlens, _, _ = inputs
    ctx.save_for_backward(cu_seqlens)
    ctx.total = packed.shape[0]


def _unpack_backward(ctx, grad):
    (cu,) = ctx.saved_tensors
    return pack(grad, cu[1:] - cu[:-1], ctx.total), None, None, None


torch.library.register_autograd("mmbalance::unpack", _unpack_backward, setup_context=_unpack_setup)


def unpack(packed: Tensor, cu_seqlens: Tensor, max_seqlen: int, pad_value: float = 0.0) -> Tensor:
    """Unpack varlen tokens into a padded batch (flash-attn ``pad_input``, one fused copy).

    Args:
        packed: ``[T, *]``, any float, integer or bool dtype; only the last dim must be contiguous.
        cu_seqlens: ``[B + 1]`` int32 (int64 accepted), ``cu[0] = 0``, non-decreasing,
            ``cu[-1] = T``; zero-length segments are legal.
        max_seqlen: host int ``>=`` the longest segment; the padded length of the output.
        pad_value: value of the rows past each segment's end; must be representable in the
            payload dtype (an integer in range for integer dtypes, 0 or 1 for bool).

    Returns:
        ``[B, max_seqlen, *]`` in ``packed``'s dtype. ``B = 0`` or ``max_seqlen = 0`` gives an empty
        tensor; ``T = 0`` gives all ``pad_value``.

    Value checks as for :func:`pack`. Backward: ``pack`` of the gradient (pad rows get none).
    """
    _ref.check_size("max_seqlen", max_seqlen)
    if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)):
        raise TypeError(f"pad_value must be a float, got {type(pad_value).__name__}")
    if direct_eligible(packed):
        return _call_direct(_unpack_impl, _unpack_setup, _unpack_backward, packed, cu_seqlens, max_seqlen,
                            float(pad_value))  # fmt: skip
    return torch.ops.mmbalance.unpack(packed, cu_seqlens, max_seqlen, float(pad_value))


# ----------------------------------------------------------------------------------------------
# segment gather / scatter


def _check_segments(x, x_name, cu_seqlens, order, size, size_name) -> None:
    _ref.check_payload(x_name, x, 1)
    _ref.check_cu_seqlens("cu_seqlens", cu_seqlens, x, x_name)
    _ref.check_index("order", order, x, x_name)
    _ref.check_size(size_name, size)


def _check_segment_values(cu_seqlens, order, packed_tokens, packed_name, out_tokens, out_name) -> None:
    _ref.check_cu_seqlens_values("cu_seqlens", cu_seqlens, packed_tokens, packed_name)
    _ref.check_order_values(order, cu_seqlens.shape[0] - 1)
    _ref.check_order_total(order, cu_seqlens, out_tokens, out_name)


def _segment_gather_impl(packed: Tensor, cu_seqlens: Tensor, order: Tensor, out_tokens: int) -> Tensor:
    _check_segments(packed, "packed", cu_seqlens, order, out_tokens, "out_tokens")
    if value_checks_enabled(packed):
        _check_segment_values(cu_seqlens, order, packed.shape[0], "packed.shape[0]", out_tokens, "out_tokens")
    if not use_triton(packed):
        return _ref.segment_gather_ref(packed, cu_seqlens, order, out_tokens)
    out = _new_output(packed, (out_tokens, *packed.shape[1:]))
    cu = cu_seqlens.contiguous()
    dst_cu = _ref.exclusive_cumsum(cu.diff().index_select(0, order), cu.dtype)
    _kernels.segment_gather_fwd(_rows(packed, 1), cu, dst_cu, order.contiguous(), _rows(out, 1))
    return out


@torch.library.custom_op("mmbalance::segment_gather", mutates_args=())
def _segment_gather_op(packed: Tensor, cu_seqlens: Tensor, order: Tensor, out_tokens: int) -> Tensor:
    return _segment_gather_impl(packed, cu_seqlens, order, out_tokens)


@_segment_gather_op.register_fake
def _segment_gather_fake(packed, cu_seqlens, order, out_tokens):
    _check_segments(packed, "packed", cu_seqlens, order, out_tokens, "out_tokens")
    return packed.new_empty((out_tokens, *packed.shape[1:]))


def _segment_scatter_impl(src: Tensor, cu_seqlens: Tensor, order: Tensor, total_tokens: int) -> Tensor:
    _check_segments(src, "src", cu_seqlens, order, total_tokens, "total_tokens")
    if value_checks_enabled(src):
        _check_segment_values(cu_seqlens, order, total_tokens, "total_tokens", src.shape[0], "src.shape[0]")
    if not use_triton(src):
        return _ref.segment_scatter_ref(src, cu_seqlens, order, total_tokens)
    out = _new_output(src, (total_tokens, *src.shape[1:]))
    cu = cu_seqlens.contiguous()
    src_cu = _ref.exclusive_cumsum(cu.diff().index_select(0, order), cu.dtype)
    where = _inverse(order, cu.shape[0] - 1)
    _kernels.segment_gather_fwd(_rows(src, 1), src_cu, cu, where, _rows(out, 1))
    return out


@torch.library.custom_op("mmbalance::segment_scatter", mutates_args=())
def _segment_scatter_op(src: Tensor, cu_seqlens: Tensor, order: Tensor, total_tokens: int) -> Tensor:
    return _segment_scatter_impl(src, cu_seqlens, order, total_tokens)


@_segment_scatter_op.register_fake
def _segment_scatter_fake(src, cu_seqlens, order, total_tokens):
    _check_segments(src, "src", cu_seqlens, order, total_tokens, "total_tokens")
    return src.new_empty((total_tokens, *src.shape[1:]))


def _segments_setup(ctx, inputs, output):
    x, cu_seqlens, order, _ = inputs
    ctx.save_for_backward(cu_seqlens, order)
    ctx.in_tokens = x.shape[0]


def _segment_gather_backward(ctx, grad):
    cu, order = ctx.saved_tensors
    return segment_scatter(grad, cu, order, ctx.in_tokens), None, None, None


def _segment_scatter_backward(ctx, grad):
    cu, order = ctx.saved_tensors
    return segment_gather(grad, cu, order, ctx.in_tokens), None, None, None


torch.library.register_autograd(
    "mmbalance::segment_gather", _segment_gather_backward, setup_context=_segments_setup
)
torch.library.register_autograd(
    "mmbalance::segment_scatter", _segment_scatter_backward, setup_context=_segments_setup
)


def segment_gather(packed: Tensor, cu_seqlens: Tensor, order: Tensor, out_tokens: int) -> Tensor:
    """Concatenate segments of ``packed`` in the order given by ``order`` (the rearrangement gather).

    Args:
        packed: ``[T, *]``, any float, integer or bool dtype; only the last dim must be contiguous.
        cu_seqlens: ``[n + 1]`` int32 (int64 accepted) bounding the ``n`` segments of ``packed``
            (``cu[0] = 0``, non-decreasing, ``cu[-1] = T``; zero-length segments are legal).
        order: ``[m]`` int64 (int32 accepted) distinct segment ids in ``[0, n)``: a permutation
            (``m = n``) or a subset, e.g. the examples bound for one rank.
        out_tokens: host int, the total length of the selected segments.

    Returns:
        ``[out_tokens, *]``: segment ``order[0]``, then ``order[1]``, ... Its ``cu_seqlens`` is
        :func:`gathered_cu_seqlens`. Empty ``order`` gives ``[0, *]`` and launches nothing.

    Value checks (monotonic ``cu_seqlens``, ids in range and distinct, ``out_tokens``) run on CPU
    always and on CUDA with ``MMBALANCE_DEBUG=1``. Backward: :func:`segment_scatter`.
    """
    _ref.check_size("out_tokens", out_tokens)
    if direct_eligible(packed):
        return _call_direct(_segment_gather_impl, _segments_setup, _segment_gather_backward, packed, cu_seqlens,
                            order, out_tokens)  # fmt: skip
    return torch.ops.mmbalance.segment_gather(packed, cu_seqlens, order, out_tokens)


def segment_scatter(src: Tensor, cu_seqlens: Tensor, order: Tensor, total_tokens: int) -> Tensor:
    """Undo :func:`segment_gather`: segment ``j`` of ``src`` goes back to segment ``order[j]``.

    Args:
        src: ``[T_out, *]``, the segments of ``order`` back to back (a gather's output).
        cu_seqlens: ``[n + 1]`` of the destination layout (the one passed to the gather).
        order: ``[m]`` distinct segment ids in ``[0, n)``, as given to the gather.
        total_tokens: host int ``cu_seqlens[-1]``, the destination length.

    Returns:
        ``[total_tokens, *]``; segments not in ``order`` are zero (the gather's adjoint).
    """
    _ref.check_size("total_tokens", total_tokens)
    if direct_eligible(src):
        return _call_direct(_segment_scatter_impl, _segments_setup, _segment_scatter_backward, src, cu_seqlens,
                            order, total_tokens)  # fmt: skip
    return torch.ops.mmbalance.segment_scatter(src, cu_seqlens, order, total_tokens)


# ----------------------------------------------------------------------------------------------
# index helpers (plain torch, no host sync; compile-friendly)


def cu_seqlens_from_lengths(lengths, dtype: torch.dtype = torch.int32, *, device=None) -> Tensor:
    """``[n]`` integer lengths -> ``[n + 1]`` cu_seqlens ``[0, l0, l0 + l1, ...]`` in ``dtype``.

    ``lengths`` is a tensor (the result is on its device, computed there with no host sync) or,
    the host-side form, a numpy array or sequence of ints (summed on the host, where plans live,
    and moved to ``device`` in one copy; default CPU). Empty ``lengths`` gives ``[0]``. Negative
    lengths raise ``ValueError`` (checked on CPU and for host lengths, on CUDA with
    ``MMBALANCE_DEBUG=1``), and so does a total that ``dtype`` cannot hold.
    """
    if not isinstance(lengths, Tensor):
        return _host_cu_seqlens(lengths, dtype, device)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise TypeError("lengths must be an integer torch.Tensor")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    if dtype not in _ref.INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if value_checks_enabled(lengths):
        _ref.check_lengths_values("lengths", lengths)
    return _ref.exclusive_cumsum(lengths, dtype)


def _host_cu_seqlens(lengths, dtype: torch.dtype, device) -> Tensor:
    import numpy as np

    if dtype not in _ref.INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise TypeError("lengths must be a tensor or a sequence of non-negative integers") from exc
    if arr.dtype == object or arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"lengths must be non-negative, got {int(arr.min())}")
    cu = np.zeros(arr.size + 1, dtype=np.int64)
    np.cumsum(arr, out=cu[1:])
    if dtype == torch.int32 and cu[-1] > np.iinfo(np.int32).max:
        raise ValueError(
            f"lengths sum to {int(cu[-1])} tokens, more than int32 cu_seqlens hold; pass dtype=torch.int64"
        )
    out = torch.from_numpy(cu.astype(np.int32) if dtype == torch.int32 else cu)
    return out if device is None else out.to(device)


def _check_cu_and_total(cu_seqlens: Tensor, total_tokens: int) -> None:
    _ref.check_cu_seqlens("cu_seqlens", cu_seqlens, cu_seqlens, "cu_seqlens")
    _ref.check_size("total_tokens", total_tokens)
    if value_checks_enabled(cu_seqlens):
        _ref.check_cu_seqlens_values("cu_seqlens", cu_seqlens, total_tokens, "total_tokens")


def segment_ids_from_cu_seqlens(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """Segment index of every token: int64 ``[total_tokens]`` (``[0]*l0 + [1]*l1 + ...``)."""
    _check_cu_and_total(cu_seqlens, total_tokens)
    return _ref.segment_ids(cu_seqlens[1:] - cu_seqlens[:-1], total_tokens)


def position_ids_from_cu_seqlens(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """Position of every token inside its segment: int64 ``[total_tokens]``, restarting at 0.

    The ``position_ids`` of a packed batch for rotary embeddings. ``total_tokens = cu[-1]`` is a
    host int, so there is no sync; ``total_tokens = 0`` gives an empty tensor.
    """
    _check_cu_and_total(cu_seqlens, total_tokens)
    seg = _ref.segment_ids(cu_seqlens[1:] - cu_seqlens[:-1], total_tokens)
    return torch.arange(total_tokens, device=cu_seqlens.device) - cu_seqlens.long()[seg]


def gathered_cu_seqlens(cu_seqlens: Tensor, order: Tensor) -> Tensor:
    """The ``cu_seqlens`` of ``segment_gather(packed, cu_seqlens, order, ...)``: ``[m + 1]``, same dtype."""
    _ref.check_cu_seqlens("cu_seqlens", cu_seqlens, cu_seqlens, "cu_seqlens")
    _ref.check_index("order", order, cu_seqlens, "cu_seqlens")
    if value_checks_enabled(cu_seqlens):
        _ref.check_order_values(order, cu_seqlens.shape[0] - 1)
    return _ref.exclusive_cumsum((cu_seqlens[1:] - cu_seqlens[:-1])[order.long()], cu_seqlens.dtype)


def _inverse(order: Tensor, size: int) -> Tensor:
    inv = torch.full((size,), -1, dtype=torch.int64, device=order.device)
    return inv.scatter(0, order.long(), torch.arange(order.shape[0], device=order.device))


def inverse_permutation(order: Tensor, size: int | None = None) -> Tensor:
    """``inv`` with ``inv[order[j]] = j``: int64 ``[size]`` (default ``size = len(order)``).

    With ``size`` larger than ``len(order)`` (``order`` a subset of ``range(size)``), ids not in
    ``order`` map to ``-1``. For a permutation, ``segment_gather(out, gathered_cu, inv, T)``
    restores the original order. Ids must be distinct and in ``[0, size)`` (checked on CPU, and on
    CUDA with ``MMBALANCE_DEBUG=1``); empty ``order`` with ``size=None`` gives an empty tensor.
    """
    if not isinstance(order, Tensor) or order.dtype not in _ref.INDEX_DTYPES:
        raise TypeError("order must be an int32 or int64 torch.Tensor")
    if order.dim() != 1:
        raise ValueError(f"order must be 1-D, got shape {tuple(order.shape)}")
    if size is None:
        size = order.shape[0]
    _ref.check_size("size", size)
    if order.shape[0] > size:
        raise ValueError(f"order has {order.shape[0]} ids, more than size = {size}")
    if value_checks_enabled(order):
        _ref.check_order_values(order, size, "size")
    return _inverse(order, size)
