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

Where the idea comes from: the gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh,
2024) and the chunk-state passing of flash-linear-attention's chunked kernels, here turned into an
exchange of per-chunk affine maps, so that a context-parallel group of any degree passes
``O(K (K + V))`` values per chunk instead of gathering the sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, launchable

__all__ = ["delta_rule_chunk_state", "delta_rule_chunk_state_kernel", "chunk_state_config"]


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
    pid = tl.program_id(0)
    piece = pid // n_heads
    head = (pid % n_heads).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # columns of [M | U]
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < KEY_DIM
    is_m = cols < KEY_DIM
    col_ok = cols < KEY_DIM + VALUE_DIM
    v_col = tl.where(is_m, 0, cols - KEY_DIM)
    start = tl.load(cu_ptr + piece).to(tl.int64)
    end = tl.load(cu_ptr + piece + 1).to(tl.int64)
    # [I | 0] on the block's columns
    x = tl.where((rows[:, None] == cols[None, :]) & is_m[None, :], 1.0, 0.0).to(tl.float32)
    for t in range(start, end):
        k = tl.load(k_ptr + t * stride_k_tok + head * stride_k_head + rows, mask=row_ok, other=0.0).to(
            tl.float32
        )
        a = tl.exp(tl.load(g_ptr + t * stride_g_tok + head).to(tl.float32))
        b = tl.load(beta_ptr + t * stride_b_tok + head).to(tl.float32)
        w = tl.load(
            v_ptr + t * stride_v_tok + head * stride_v_head + v_col,
            mask=col_ok & (cols >= KEY_DIM),
            other=0.0,
        ).to(tl.float32)
        kx = tl.sum(k[:, None] * x, axis=0)  # k^T x per column
        x = a * x + (b * k)[:, None] * (w - a * kx)[None, :]
    out = (piece.to(tl.int64) * n_heads + head) * KEY_DIM
    keep = row_ok[:, None] & col_ok[None, :]
    tl.store(m_ptr + (out + rows[:, None]) * KEY_DIM + cols[None, :], x, mask=keep & is_m[None, :])
    tl.store(
        u_ptr + (out + rows[:, None]) * VALUE_DIM + v_col[None, :], x, mask=keep & (cols >= KEY_DIM)[None, :]
    )


def chunk_state_config(key_dim: int, value_dim: int) -> dict:
    """Columns per program: a ``K x BLOCK_C`` float32 block of at most 4096 values in registers."""
    bk = max(16, triton.next_power_of_2(key_dim))
    if INTERPRET:
        return dict(BLOCK_K=bk, BLOCK_C=16, num_warps=4)
    return dict(BLOCK_K=bk, BLOCK_C=max(16, min(64, 4096 // bk)), num_warps=4)


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
