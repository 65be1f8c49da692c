"""Merge of partial attention states ``(out, lse)`` in float32.

Math. Two softmax-attention results over disjoint key sets, each with its log-sum-exp, combine to
the result over the union:

    lse = log(exp(lse_a) + exp(lse_b)) = m + log(exp(lse_a - m) + exp(lse_b - m)),  m = max(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A side with ``lse = -inf`` (no key) has weight 0; when both are ``-inf`` the result is ``out = 0``,
``lse = -inf`` (``m`` is replaced by 0 in the subtraction so no ``-inf - -inf`` NaN appears).

Layout: ``out_* [T, H, D]`` (last dimension contiguous, other strides are arguments), ``lse_*
[H, T]``. The output is float32 whatever the partial dtypes: a ring accumulates its running result
in float32 and rounds once at the end, avoiding the repeated bf16 rounding of ring
implementations that merge in the activation dtype. Grid: (token blocks, H); one program handles
``BLOCK_T`` rows of one head. Writing into ``out_a``/``lse_a`` in place is safe (each element is
read before it is written by the same program).

Where the idea comes from: the blockwise softmax rescaling of ring attention (Liu et al., 2023;
DHP section 3.2) and flash-attention's split-KV combine step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, launchable


@triton.jit
def merge_attn_fwd_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    n_tokens,
    stride_oa_tok,
    stride_oa_head,
    stride_ob_tok,
    stride_ob_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_a_head,
    stride_lse_b_head,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < n_tokens
    mask = t_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    head = pid_h.to(tl.int64)
    lse_a = tl.load(lse_a_ptr + head * stride_lse_a_head + offs_t, mask=t_ok, other=float("-inf")).to(
        tl.float32
    )
    lse_b = tl.load(lse_b_ptr + head * stride_lse_b_head + offs_t, mask=t_ok, other=float("-inf")).to(
        tl.float32
    )
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    empty = total == 0.0
    inv = 1.0 / tl.where(empty, 1.0, total)
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, total)))
    rows = offs_t.to(tl.int64)[:, None]
    o_a = tl.load(
        out_a_ptr + rows * stride_oa_tok + head * stride_oa_head + offs_d[None, :], mask=mask, other=0.0
    )
    o_b = tl.load(
        out_b_ptr + rows * stride_ob_tok + head * stride_ob_head + offs_d[None, :], mask=mask, other=0.0
    )
    out = o_a.to(tl.float32) * (w_a * inv)[:, None] + o_b.to(tl.float32) * (w_b * inv)[:, None]
    tl.store(out_ptr + rows * stride_o_tok + head * stride_o_head + offs_d[None, :], out, mask=mask)
    tl.store(lse_ptr + head * stride_lse_head + offs_t, lse, mask=t_ok)


def merge_config(head_dim: int) -> dict:
    """Rows per program: about 4 KB of each partial in flight per program on a GPU."""
    if INTERPRET:
        return dict(BLOCK_T=16, num_warps=4)
    bd = max(16, triton.next_power_of_2(head_dim))
    return dict(BLOCK_T=max(1, min(64, 4096 // bd)), num_warps=4)


def merge_attn_fwd(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the merge; returns float32 ``out [T, H, D]`` and ``lse [H, T]``.

    ``out``/``lse`` may be given (float32, e.g. ``out_a``/``lse_a`` for an in-place update);
    otherwise they are allocated. Inputs are assumed validated by ``pyops/attention_ops.py``.
    """
    n_tokens, n_heads, head_dim = out_a.shape
    if out is None:
        out = torch.empty((n_tokens, n_heads, head_dim), dtype=torch.float32, device=out_a.device)
    if lse is None:
        lse = torch.empty((n_heads, n_tokens), dtype=torch.float32, device=out_a.device)
    if n_tokens == 0 or n_heads == 0:
        return out, lse
    cfg = merge_config(head_dim)
    grid = (triton.cdiv(n_tokens, cfg["BLOCK_T"]), n_heads)
    launchable(merge_attn_fwd_kernel)[grid](
        out_a, lse_a, out_b, lse_b, out, lse, n_tokens,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_T=cfg["BLOCK_T"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out, lse
