"""The gated delta rule's state hand-off across a context-parallel group, as ``torch.ops.mmbalance``.

Ops (schemas)::

    mmbalance::delta_rule_chunk_state(Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens,
                                      SymInt max_seqlen, str backend) -> (Tensor, Tensor)
    mmbalance::delta_rule_chunk_state_backward(Tensor k, Tensor v, Tensor g, Tensor beta,
                                               Tensor cu_seqlens, SymInt max_seqlen, Tensor? dm,
                                               Tensor? du) -> (Tensor, Tensor, Tensor, Tensor)

``delta_rule_chunk_state`` gives every chunk of packed tokens (``cu_seqlens``) the affine map its
tokens apply to a Gated DeltaNet state, ``S_out = M S_in + U`` per head (``kernels/delta_rule.py``
has the math): ``M [P, H, K, K]`` and ``U [P, H, K, V]``, float32 (float64 for float64 inputs),
whatever the chunks' lengths. ``compose_chunk_states`` (plain torch, differentiable) runs the
chunks of one sequence in order: the state each starts from and the one the last leaves. A rank of
a context-parallel group computes the maps of its chunks, the group exchanges them (``K (K + V)``
values per chunk and head, against the whole sequence's ``T (2K + V)`` for gathering it), and each
rank composes the states its chunks start from; the chunk then runs from that state, forward and
backward, as the sequence would run whole.

Inputs: ``k [T, H, K]`` (the layer's normalized keys), ``v [T, H, V]``, ``g [T, H]`` (log decay,
``a = exp(g)``), ``beta [T, H]`` (write strength), any float dtype; ``cu_seqlens`` int32 or int64
``[P + 1]`` (``cu[0] = 0``, non-decreasing, ``cu[-1] = T``; empty chunks give ``M = I``, ``U = 0``);
``max_seqlen`` at least the longest chunk (a host int, so no call syncs). Value checks follow
``pyops/checks.py``.

Dispatch: ``backend="auto"`` runs the Triton kernel on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``) and the torch reference otherwise; ``"triton"`` and ``"reference"`` force one
(a ``ValueError`` says why it cannot run). Autograd, for ``k``, ``v``, ``g`` and ``beta``: where the
forward ran the kernel, the backward is its fused kernel (``kernels/delta_rule.py``: the states
recomputed from checkpoints every ``sqrt(max_seqlen)`` tokens, so it keeps about ``2 sqrt(max_seqlen)``
states a chunk and head, plus per-column-block partial sums of ``K + 2`` floats a token and head,
not a state a token); elsewhere (the torch reference, float64) it differentiates the
reference, recomputed (one rank-1 step per token of the longest chunk, all chunks and heads at
once; autograd keeps every step's state).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mmbalance.kernels import delta_rule as _kernel
from mmbalance.kernels.dispatch import INTERPRET

from .checks import value_checks_enabled

__all__ = ["delta_rule_chunk_state", "compose_chunk_states", "delta_rule_chunk_state_ref"]

_BACKENDS = ("auto", "triton", "reference")


def _out_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _check(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, max_seqlen: int, backend: str) -> None:
    for name, t, dims in (("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != dims or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a {dims}-D floating tensor, got {t.dim()}-D {t.dtype}")
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    tokens, heads = k.shape[:2]
    if v.shape[:2] != (tokens, heads):
        raise ValueError(f"v must have shape [T, H, V] = [{tokens}, {heads}, V], got {tuple(v.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (tokens, heads):
            raise ValueError(f"{name} must have shape [T, H] = [{tokens}, {heads}], got {tuple(t.shape)}")
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise TypeError("cu_seqlens must be a 1-D int32 or int64 tensor")
    if cu.device != k.device:
        raise ValueError(f"cu_seqlens is on {cu.device} but k is on {k.device}")
    if cu.numel() < 1:
        raise ValueError("cu_seqlens must have at least one entry (P + 1 with P >= 0)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if not value_checks_enabled(cu):
        return
    vals = cu.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != tokens:
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the number of tokens {tokens}, got {vals}"
        )
    longest = max((b - a for a, b in zip(vals, vals[1:])), default=0)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen is {max_seqlen} but a chunk of cu_seqlens has {longest} tokens")


def _kernel_reasons(k: Tensor) -> list[str]:
    if k.device.type == "cuda" or (k.device.type == "cpu" and INTERPRET):
        return []
    return [
        f"the Triton kernel runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1), not {k.device.type}"
    ]


def _use_kernel(k: Tensor, backend: str) -> bool:
    if backend == "reference":
        return False
    reasons = _kernel_reasons(k)
    if backend == "triton" and reasons:
        raise ValueError(f"backend='triton' cannot run delta_rule_chunk_state here: {'; '.join(reasons)}")
    return not reasons


def _full_precision(device: torch.device):
    """No autocast inside (a state handed along a sequence keeps its float32 under Trainer's
    ``bf16=True``, as flash-linear-attention's kernels keep theirs)."""
    if device.type in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def delta_rule_chunk_state_ref(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, max_seqlen: int
) -> tuple[Tensor, Tensor]:
    """The torch reference (differentiable): every chunk padded to ``max_seqlen`` with identity
    steps (``g = 0``, ``beta = 0``), one rank-1 update a step for all chunks and heads at once, in
    the inputs' precision whatever autocast says."""
    with _full_precision(k.device):
        return _chunk_state_ref(k, v, g, beta, cu_seqlens, max_seqlen)


def _chunk_state_ref(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, max_seqlen: int
) -> tuple[Tensor, Tensor]:
    dtype = _out_dtype(k, v, g, beta)
    pieces = cu_seqlens.numel() - 1
    heads, key_dim, value_dim = k.shape[1], k.shape[2], v.shape[2]
    eye = torch.eye(key_dim, dtype=dtype, device=k.device)
    x = torch.cat(
        [
            eye.expand(pieces, heads, key_dim, key_dim),
            k.new_zeros((pieces, heads, key_dim, value_dim), dtype=dtype),
        ],
        dim=-1,
    )
    if pieces == 0 or max_seqlen == 0 or k.shape[0] == 0:
        return _split(x, key_dim)
    cu = cu_seqlens.to(torch.int64)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    steps = torch.arange(max_seqlen, device=k.device)
    valid = steps[None, :] < lengths[:, None]  # [P, L]
    index = torch.where(valid, starts[:, None] + steps[None, :], 0)
    kk, vv = k.to(dtype)[index], v.to(dtype)[index]  # [P, L, H, *]
    zero = torch.zeros((), dtype=dtype, device=k.device)
    gg = torch.where(valid[..., None], g.to(dtype)[index], zero)
    bb = torch.where(valid[..., None], beta.to(dtype)[index], zero)
    pad = kk.new_zeros((pieces, heads, key_dim))
    for j in range(max_seqlen):
        a = gg[:, j].exp()[..., None]  # [P, H, 1]
        kj = kk[:, j]  # [P, H, K]
        w = torch.cat([pad, vv[:, j]], dim=-1)  # [P, H, K + V]
        kx = torch.einsum("phk,phkc->phc", kj, x)
        x = a[..., None] * x + (bb[:, j, :, None] * kj)[..., None] * (w - a * kx)[:, :, None, :]
    return _split(x, key_dim)


def _split(x: Tensor, key_dim: int) -> tuple[Tensor, Tensor]:
    """``[M | U]`` into two fresh contiguous tensors (never views of one buffer)."""
    return x[..., :key_dim].clone(memory_format=torch.contiguous_format), x[..., key_dim:].clone(
        memory_format=torch.contiguous_format
    )


@torch.library.custom_op("mmbalance::delta_rule_chunk_state", mutates_args=())
def _chunk_state_op(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, max_seqlen: int, backend: str
) -> tuple[Tensor, Tensor]:
    _check(k, v, g, beta, cu_seqlens, max_seqlen, backend)
    if not _use_kernel(k, backend) or _out_dtype(k, v, g, beta) == torch.float64:
        m, u = delta_rule_chunk_state_ref(k, v, g, beta, cu_seqlens, max_seqlen)
        return m, u
    k_ = k if k.stride(-1) == 1 or k.shape[-1] <= 1 else k.contiguous()
    v_ = v if v.stride(-1) == 1 or v.shape[-1] <= 1 else v.contiguous()
    g_ = g if g.stride(-1) == 1 or g.shape[-1] <= 1 else g.contiguous()
    b_ = beta if beta.stride(-1) == 1 or beta.shape[-1] <= 1 else beta.contiguous()
    return _kernel.delta_rule_chunk_state(k_, v_, g_, b_, cu_seqlens)


@_chunk_state_op.register_fake
def _chunk_state_fake(k, v, g, beta, cu_seqlens, max_seqlen, backend):
    _check(k, v, g, beta, cu_seqlens, max_seqlen, backend)
    pieces = cu_seqlens.shape[0] - 1
    heads, key_dim, value_dim = k.shape[1], k.shape[2], v.shape[2]
    dtype = _out_dtype(k, v, g, beta)
    return (
        k.new_empty((pieces, heads, key_dim, key_dim), dtype=dtype),
        k.new_empty((pieces, heads, key_dim, value_dim), dtype=dtype),
    )


def _check_backward(k, v, g, beta, cu, max_seqlen, dm, du) -> None:
    """The forward's checks, the kernel's availability, and ``dm``/``du`` of the maps' shapes."""
    _check(k, v, g, beta, cu, max_seqlen, "triton")
    _use_kernel(k, "triton")
    pieces, (heads, key_dim), value_dim = cu.shape[0] - 1, k.shape[1:], v.shape[2]
    for name, t, shape in (
        ("dm", dm, (pieces, heads, key_dim, key_dim)),
        ("du", du, (pieces, heads, key_dim, value_dim)),
    ):
        if t is None:
            continue
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point or t.device != k.device:
            raise ValueError(f"{name} must be a floating tensor on {k.device}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (the maps'), got {tuple(t.shape)}")


@torch.library.custom_op("mmbalance::delta_rule_chunk_state_backward", mutates_args=())
def _chunk_state_backward_op(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dm: Tensor | None,
    du: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fused backward (``kernels/delta_rule.py``): float32 ``dk``, ``dv``, ``dg``, ``dbeta``."""
    _check_backward(k, v, g, beta, cu_seqlens, max_seqlen, dm, du)
    k_, v_, g_, b_ = (t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in (k, v, g, beta))
    return _kernel.delta_rule_chunk_state_bwd(k_, v_, g_, b_, cu_seqlens, max_seqlen, dm, du)


@_chunk_state_backward_op.register_fake
def _chunk_state_backward_fake(k, v, g, beta, cu_seqlens, max_seqlen, dm, du):
    _check_backward(k, v, g, beta, cu_seqlens, max_seqlen, dm, du)
    return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in (k, v, g, beta))


def _setup(ctx, inputs, output):
    k, v, g, beta, cu, max_seqlen, backend = inputs
    ctx.save_for_backward(k, v, g, beta, cu)
    ctx.max_seqlen = max_seqlen
    # the fused backward wherever the forward ran the kernel
    ctx.fused = _use_kernel(k, backend) and _out_dtype(k, v, g, beta) != torch.float64
    ctx.set_materialize_grads(False)


def _backward(ctx, dm, du):
    k, v, g, beta, cu = ctx.saved_tensors
    wanted = [i for i in range(4) if ctx.needs_input_grad[i]]
    grads: list[Tensor | None] = [None] * 4
    if wanted and (dm is not None or du is not None) and ctx.fused:
        dk, dv, dg, db = torch.ops.mmbalance.delta_rule_chunk_state_backward(
            k, v, g, beta, cu, ctx.max_seqlen, dm, du
        )
        for i in wanted:
            grads[i] = (dk, dv, dg, db)[i].to((k, v, g, beta)[i].dtype)
    elif wanted and (dm is not None or du is not None):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(i in wanted) for i, t in enumerate((k, v, g, beta))]
            m, u = delta_rule_chunk_state_ref(*leaves, cu, ctx.max_seqlen)
            outs = [o for o, d in ((m, dm), (u, du)) if d is not None]
            ins = [d for d in (dm, du) if d is not None]
            got = torch.autograd.grad(outs, [leaves[i] for i in wanted], ins, allow_unused=True)
        for i, gr in zip(wanted, got, strict=True):
            grads[i] = torch.zeros_like(leaves[i]) if gr is None else gr.to(leaves[i].dtype)
    return (*grads, None, None, None)


torch.library.register_autograd("mmbalance::delta_rule_chunk_state", _backward, setup_context=_setup)


def delta_rule_chunk_state(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, max_seqlen: int, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """``(M, U)`` of every chunk (module docstring): ``S_out = M @ S_in + U`` per chunk and head."""
    return torch.ops.mmbalance.delta_rule_chunk_state(k, v, g, beta, cu_seqlens, max_seqlen, backend)


def compose_chunk_states(m: Tensor, u: Tensor, initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The chunks of one sequence, in order (``m [C, H, K, K]``, ``u [C, H, K, V]``): the state
    each chunk starts from (``[C, H, K, V]``; the first starts from ``initial`` or zeros) and the
    state the last leaves (``[H, K, V]``). Differentiable (torch), ``C`` small matrix products, in
    the inputs' precision whatever autocast says."""
    if m.dim() != 4 or u.dim() != 4 or m.shape[:3] != u.shape[:3] or m.shape[2] != m.shape[3]:
        raise ValueError(
            f"m must be [C, H, K, K] and u [C, H, K, V] with the same C, H, K, got {tuple(m.shape)} and "
            f"{tuple(u.shape)}"
        )
    state = u.new_zeros(u.shape[1:]) if initial is None else initial.to(u.dtype)
    if state.shape != u.shape[1:]:
        raise ValueError(f"initial must have shape {tuple(u.shape[1:])}, got {tuple(state.shape)}")
    starts = []
    with _full_precision(u.device):
        for c in range(m.shape[0]):
            starts.append(state)
            state = m[c] @ state + u[c]
    return (torch.stack(starts) if starts else u.new_zeros(u.shape)), state
