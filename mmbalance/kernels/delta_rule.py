"""The state transition of a gated delta rule over a chunk of tokens: the summary a context-parallel
group passes along instead of the sequence.

Math. Gated DeltaNet (Qwen3.5, Qwen3-Next) keeps per head a state ``S`` (``K x V``) and updates it
token by token (decay ``a_t = exp(g_t)``, write strength ``beta_t``, key ``k_t``, value ``v_t``):

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T
        = A_t S_{t-1} + beta_t k_t v_t^T,      A_t = a_t (I - beta_t k_t k_t^T)

which is affine in the state, so a chunk of tokens maps the state it starts from to the one it
leaves as ``S_out = M S_in + U`` with ``M = A_L ... A_1`` (``K x K``) and ``U`` the state the chunk
leaves from ``S_in = 0`` (``K x V``). Both are the same recurrence run on the columns of
``[I | 0]``: a column ``x`` of ``M`` takes ``x <- a x + beta k (0 - a k^T x)``, a column of ``U``
``x <- a x + beta k (v_j - a k^T x)``. A rank that holds one chunk of a sequence computes its
``(M, U)``, the group exchanges them (``K (K + V)`` values a head, whatever the chunk's length), and
every rank composes the states its chunks start from (``pyops/delta_rule.py``).

Layout: tokens packed ``[T, H, *]`` (last dimension contiguous, other strides are arguments) with
``cu_seqlens`` (``P + 1`` int32/int64 boundaries of the chunks); outputs float32 ``M [P, H, K, K]``
and ``U [P, H, K, V]``, contiguous. Grid: ``(P * H, column blocks of [M | U])``; one program keeps a
``K x BLOCK_C`` block of columns in registers and walks the chunk's tokens, one rank-1 update a
token, in float32. An empty chunk gives ``M = I``, ``U = 0``.

Backward (``delta_rule_chunk_state_bwd``): given ``dM`` and ``dU`` it walks each chunk back to
front with ``G_t = dL/dX_t`` (``X`` the block of ``[M | U]`` columns after token ``t``):
``G_{t-1} = a_t (G_t - beta_t k_t (G_t^T k_t)^T)``, and per token, with ``r_t = w_t - a_t X_{t-1}^T
k_t`` (``w_t = [0 | v_t]``): ``dv_t = beta_t (G_t^T k_t)`` on the value columns, ``dbeta_t = (G_t^T
k_t) . r_t``, ``dg_t = a_t (<G_t, X_{t-1}> - beta_t (G_t^T k_t) . (X_{t-1}^T k_t))`` and ``dk_t =
beta_t G_t r_t - a_t beta_t X_{t-1} (G_t^T k_t)``. The states ``X_{t-1}`` are recomputed, not kept:
a first walk stores the state at the start of every segment of ``S`` tokens (``S`` the square
root of ``max_seqlen``, rounded up), then each segment, last first, is walked again from its
checkpoint into a scratch of ``S`` states and back. The terms of ``dk``, ``dbeta`` and ``dg`` are
sums over all columns, so every column block writes its own partial and the launcher adds them
(deterministic, no atomics). Memory: ``(max_seqlen / S + S)`` blocks of ``K x BLOCK_C`` per
program (every chunk's programs are sized for ``max_seqlen``) and ``blocks x (K + 2)`` float32 a
token and head for the partials, against one ``K x (K + V)`` state a token and head that autograd
keeps through the recurrence; the work is three walks. A chunk longer than ``max_seqlen`` gets NaN
gradients rather than a write outside the buffers.

Where the idea comes from: the gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh,
2024) and the chunk-state passing of flash-linear-attention's chunked kernels, here turned into an
exchange of per-chunk affine maps, so that a context-parallel group of any degree passes
``O(K (K + V))`` values per chunk instead of gathering the sequence.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, launchable

__all__ = [
    "delta_rule_chunk_state",
    "delta_rule_chunk_state_kernel",
    "chunk_state_config",
    "delta_rule_chunk_state_bwd",
    "delta_rule_chunk_state_bwd_kernel",
    "segment_length",
    "backward_buffers",
    "backward_config",
]


@triton.jit
def _token(
    k_ptr, v_ptr, g_ptr, beta_ptr, t, head, rows, row_ok, v_col, v_ok,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_b_tok,
):  # fmt: skip
    """Token ``t``'s key (``BLOCK_K``), decay ``a``, write strength ``b`` and the block's columns of
    ``w = [0 | v_t]``, in float32."""
    kt = tl.load(k_ptr + t * stride_k_tok + head * stride_k_head + rows, mask=row_ok, other=0.0).to(
        tl.float32
    )
    a = tl.exp(tl.load(g_ptr + t * stride_g_tok + head).to(tl.float32))
    b = tl.load(beta_ptr + t * stride_b_tok + head).to(tl.float32)
    w = tl.load(v_ptr + t * stride_v_tok + head * stride_v_head + v_col, mask=v_ok, other=0.0).to(tl.float32)
    return kt, a, b, w


@triton.jit
def _step(x, kt, a, b, w):
    """One token on a block of columns: ``x <- a x + b k (w - a k^T x)``."""
    kx = tl.sum(kt[:, None] * x, axis=0)  # k^T x per column
    return a * x + (b * kt)[:, None] * (w - a * kx)[None, :]


@triton.jit
def _block(cu_ptr, n_heads, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_C: tl.constexpr):  # fmt: skip
    """This program's chunk, head and block of ``[M | U]`` columns: the chunk's first and last token,
    the row and column indices with their masks, and each column's index into ``v``."""
    pid = tl.program_id(0)
    piece = pid // n_heads
    head = (pid % n_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, BLOCK_K)
    is_m = cols < KEY_DIM
    col_ok = cols < KEY_DIM + VALUE_DIM
    start = tl.load(cu_ptr + piece).to(tl.int64)
    end = tl.load(cu_ptr + piece + 1).to(tl.int64)
    v_col = tl.where(is_m, 0, cols - KEY_DIM)
    return (
        piece.to(tl.int64),
        head,
        start,
        end,
        rows,
        rows < KEY_DIM,
        cols,
        is_m,
        col_ok,
        col_ok & ~is_m,
        v_col,
    )


@triton.jit
def delta_rule_chunk_state_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    cu_ptr,
    m_ptr,
    u_ptr,
    n_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_g_tok,
    stride_b_tok,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    piece, head, start, end, rows, row_ok, cols, is_m, col_ok, v_ok, v_col = _block(
        cu_ptr, n_heads, KEY_DIM, VALUE_DIM, BLOCK_K, BLOCK_C
    )
    # [I | 0] on the block's columns
    x = tl.where((rows[:, None] == cols[None, :]) & is_m[None, :], 1.0, 0.0).to(tl.float32)
    for t in range(start, end):
        kt, a, b, w = _token(
            k_ptr, v_ptr, g_ptr, beta_ptr, t, head, rows, row_ok, v_col, v_ok,
            stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_b_tok,
        )  # fmt: skip
        x = _step(x, kt, a, b, w)
    out = (piece * n_heads + head) * KEY_DIM
    keep = row_ok[:, None] & col_ok[None, :]
    tl.store(m_ptr + (out + rows[:, None]) * KEY_DIM + cols[None, :], x, mask=keep & is_m[None, :])
    tl.store(u_ptr + (out + rows[:, None]) * VALUE_DIM + v_col[None, :], x, mask=keep & v_ok[None, :])


@triton.jit
def delta_rule_chunk_state_bwd_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    cu_ptr,
    dm_ptr,
    du_ptr,
    dk_ptr,
    dv_ptr,
    dg_ptr,
    db_ptr,
    ckpt_ptr,
    scratch_ptr,
    n_heads,
    n_tokens,
    seg_len,
    n_segs,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_g_tok,
    stride_b_tok,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    piece, head, start, end, rows, row_ok, cols, is_m, col_ok, v_ok, v_col = _block(
        cu_ptr, n_heads, KEY_DIM, VALUE_DIM, BLOCK_K, BLOCK_C
    )
    blk = tl.program_id(1)
    tile = rows[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    prog = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + blk
    ckpt = ckpt_ptr + prog * n_segs * BLOCK_K * BLOCK_C
    scratch = scratch_ptr + prog * seg_len * BLOCK_K * BLOCK_C
    # this block's partial sums over columns: [column blocks, T, H, *]
    part = blk.to(tl.int64) * n_tokens * n_heads
    if end - start > seg_len * n_segs:
        # a chunk longer than the max_seqlen the buffers were sized for: NaN gradients, never a write
        # outside the buffers (the op refuses such a max_seqlen where it checks values)
        for t in range(start, end):
            row = part + t * n_heads + head
            tl.store(dk_ptr + row * KEY_DIM + rows, tl.full([BLOCK_K], float("nan"), tl.float32), mask=row_ok)
            tl.store(db_ptr + row, float("nan"))
            tl.store(dg_ptr + row, float("nan"))
            tl.store(
                dv_ptr + (t * n_heads + head) * VALUE_DIM + v_col, tl.full([BLOCK_C], float("nan"), tl.float32),
                mask=v_ok,
            )  # fmt: skip
    else:
        # walk 1: the state at the start of every segment
        x = tl.where((rows[:, None] == cols[None, :]) & is_m[None, :], 1.0, 0.0).to(tl.float32)
        for t in range(start, end):
            if (t - start) % seg_len == 0:
                tl.store(ckpt + ((t - start) // seg_len) * BLOCK_K * BLOCK_C + tile, x)
            kt, a, b, w = _token(
                k_ptr, v_ptr, g_ptr, beta_ptr, t, head, rows, row_ok, v_col, v_ok,
                stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_b_tok,
            )  # fmt: skip
            x = _step(x, kt, a, b, w)
        # G at the chunk's end: dM on the M columns, dU on the U columns
        out = (piece * n_heads + head) * KEY_DIM
        keep = row_ok[:, None] & col_ok[None, :]
        gm = tl.load(
            dm_ptr + (out + rows[:, None]) * KEY_DIM + cols[None, :], mask=keep & is_m[None, :], other=0.0
        )
        gu = tl.load(
            du_ptr + (out + rows[:, None]) * VALUE_DIM + v_col[None, :], mask=keep & v_ok[None, :], other=0.0
        )
        grad = gm + gu
        segs = (end - start + seg_len - 1) // seg_len
        for i in range(0, segs):
            s = segs - 1 - i
            t0 = start + s * seg_len
            t1 = tl.minimum(t0 + seg_len, end)
            # walk 2: the segment's states from its checkpoint, each before its token
            x = tl.load(ckpt + s * BLOCK_K * BLOCK_C + tile)
            for t in range(t0, t1):
                tl.store(scratch + (t - t0) * BLOCK_K * BLOCK_C + tile, x)
                kt, a, b, w = _token(
                    k_ptr, v_ptr, g_ptr, beta_ptr, t, head, rows, row_ok, v_col, v_ok,
                    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_b_tok,
                )  # fmt: skip
                x = _step(x, kt, a, b, w)
            # walk 3: back over the segment
            for j in range(0, t1 - t0):
                t = t1 - 1 - j
                x = tl.load(scratch + (t - t0) * BLOCK_K * BLOCK_C + tile)
                kt, a, b, w = _token(
                    k_ptr, v_ptr, g_ptr, beta_ptr, t, head, rows, row_ok, v_col, v_ok,
                    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok, stride_b_tok,
                )  # fmt: skip
                kx = tl.sum(kt[:, None] * x, axis=0)  # X^T k
                r = w - a * kx
                kg = tl.sum(kt[:, None] * grad, axis=0)  # G^T k
                dk = b * tl.sum(grad * r[None, :], axis=1) - a * b * tl.sum(x * kg[None, :], axis=1)
                db = tl.sum(kg * r, axis=0)
                dg = a * (tl.sum(tl.sum(grad * x, axis=1), axis=0) - b * tl.sum(kg * kx, axis=0))
                row = part + t * n_heads + head
                tl.store(dk_ptr + row * KEY_DIM + rows, dk, mask=row_ok)
                tl.store(db_ptr + row, db)
                tl.store(dg_ptr + row, dg)
                tl.store(dv_ptr + (t * n_heads + head) * VALUE_DIM + v_col, b * kg, mask=v_ok)
                grad = a * (grad - (b * kt)[:, None] * kg[None, :])


def segment_length(max_seqlen: int) -> int:
    """Tokens per checkpoint segment of the backward: about the square root of the longest chunk
    (fewest states kept: ``chunk / S`` checkpoints plus ``S`` in the scratch)."""
    return max(1, math.isqrt(max(int(max_seqlen), 1) - 1) + 1)


def chunk_state_config(key_dim: int, value_dim: int) -> dict:
    """Columns per program: a ``K x BLOCK_C`` float32 block of at most 4096 values in registers."""
    bk = max(16, triton.next_power_of_2(key_dim))
    if INTERPRET:
        return dict(BLOCK_K=bk, BLOCK_C=16, num_warps=4)
    return dict(BLOCK_K=bk, BLOCK_C=max(16, min(64, 4096 // bk)), num_warps=4)


def backward_config(key_dim: int, value_dim: int) -> dict:
    """The backward's columns per program: a ``K x BLOCK_C`` block of up to 8192 float32 values,
    8 warps past 4096 (at keys of 128: 64 columns, 239 registers and no spills on sm_90, where 128
    columns spill), so the column blocks' partial sums of ``dk`` are half the forward's blocks."""
    bk = max(16, triton.next_power_of_2(key_dim))
    if INTERPRET:
        return dict(BLOCK_K=bk, BLOCK_C=16, num_warps=4)
    bc = max(16, min(64, 8192 // bk))
    return dict(BLOCK_K=bk, BLOCK_C=bc, num_warps=8 if bk * bc > 4096 else 4)


def delta_rule_chunk_state(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    m: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel; returns float32 ``M [P, H, K, K]`` and ``U [P, H, K, V]``. Inputs are
    assumed validated by ``pyops/delta_rule.py`` (``k [T, H, K]``, ``v [T, H, V]`` with unit last
    strides, ``g`` and ``beta [T, H]`` with unit head strides)."""
    pieces = int(cu_seqlens.numel()) - 1
    _, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if m is None:
        m = torch.empty((pieces, heads, key_dim, key_dim), dtype=torch.float32, device=k.device)
    if u is None:
        u = torch.empty((pieces, heads, key_dim, value_dim), dtype=torch.float32, device=k.device)
    if pieces == 0 or heads == 0 or key_dim == 0:
        return m, u
    cfg = chunk_state_config(key_dim, value_dim)
    grid = (pieces * heads, triton.cdiv(key_dim + value_dim, cfg["BLOCK_C"]))
    launchable(delta_rule_chunk_state_kernel)[grid](
        k, v, g, beta, cu_seqlens, m, u, heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=cfg["BLOCK_K"], BLOCK_C=cfg["BLOCK_C"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return m, u


def backward_buffers(
    pieces: int, heads: int, key_dim: int, value_dim: int, tokens: int, max_seqlen: int
) -> dict[str, tuple[int, ...]]:
    """The float32 buffers the backward allocates besides its outputs: every program's segment
    checkpoints (``ckpt``) and segment scratch (``scratch``), and the column blocks' partial sums
    of ``dk``, ``dg`` and ``dbeta``."""
    cfg = backward_config(key_dim, value_dim)
    bk, bc = cfg["BLOCK_K"], cfg["BLOCK_C"]
    blocks = triton.cdiv(key_dim + value_dim, bc)
    seg = segment_length(max_seqlen)
    segs = max(1, triton.cdiv(int(max_seqlen), seg))
    programs = pieces * heads * blocks
    return {
        "ckpt": (programs, segs, bk, bc),
        "scratch": (programs, seg, bk, bc),
        "dk": (blocks, tokens, heads, key_dim),
        "dg": (blocks, tokens, heads),
        "dbeta": (blocks, tokens, heads),
    }


def delta_rule_chunk_state_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dm: torch.Tensor | None,
    du: torch.Tensor | None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward; returns float32 ``dk [T, H, K]``, ``dv [T, H, V]``, ``dg`` and
    ``dbeta [T, H]``. ``dm``/``du`` are the outputs' gradients (``None``: zero); the inputs as for
    :func:`delta_rule_chunk_state`, with ``max_seqlen`` at least the longest chunk. ``dv`` may be
    given (every entry is written)."""
    pieces = int(cu_seqlens.numel()) - 1
    tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    dev = k.device
    if dv is None:
        dv = torch.empty((tokens, heads, value_dim), dtype=torch.float32, device=dev)
    if pieces == 0 or heads == 0 or key_dim == 0 or tokens == 0:
        zeros = [
            torch.zeros((tokens, heads, *tail), dtype=torch.float32, device=dev)
            for tail in ((key_dim,), (), ())
        ]
        dv.zero_()
        return zeros[0], dv, zeros[1], zeros[2]
    if dm is None:
        dm = torch.zeros((pieces, heads, key_dim, key_dim), dtype=torch.float32, device=dev)
    if du is None:
        du = torch.zeros((pieces, heads, key_dim, value_dim), dtype=torch.float32, device=dev)
    dm = dm.to(torch.float32).contiguous()
    du = du.to(torch.float32).contiguous()
    cfg = backward_config(key_dim, value_dim)
    shapes = backward_buffers(pieces, heads, key_dim, value_dim, tokens, max_seqlen)
    ckpt, scratch, dk_part, dg_part, db_part = (
        torch.empty(shapes[n], dtype=torch.float32, device=dev)
        for n in ("ckpt", "scratch", "dk", "dg", "dbeta")
    )
    seg, segs, blocks = scratch.shape[1], ckpt.shape[1], dk_part.shape[0]
    launchable(delta_rule_chunk_state_bwd_kernel)[(pieces * heads, blocks)](
        k, v, g, beta, cu_seqlens, dm, du, dk_part, dv, dg_part, db_part, ckpt, scratch,
        heads, tokens, seg, segs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_K=cfg["BLOCK_K"], BLOCK_C=cfg["BLOCK_C"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dk_part.sum(0), dv, dg_part.sum(0), db_part.sum(0)
