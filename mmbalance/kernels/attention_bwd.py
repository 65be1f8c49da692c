"""Attention block backward: dq, dk, dv of softmax(scale * q k^T + mask) v, packed varlen.

Math. With ``p_ij = exp(s_ij - lse_i)`` recomputed from ``q``, ``k`` and the saved ``lse``:

    delta_i = sum_d dout_id * out_id  (- dlse_i when the LSE itself receives a gradient)
    dv_j    = sum_i p_ij dout_i
    ds_ij   = p_ij * (dout_i . v_j - delta_i)
    dq_i    = scale * sum_j ds_ij k_j          dk_j = scale * sum_i ds_ij q_i

With logit softcapping (``s = softcap * tanh(x)``, ``x = scale * <q, k> / softcap``) the chain
rule adds one factor: ``ds_ij <- ds_ij * (1 - tanh(x_ij)^2)`` before the two products (the
``1 / softcap`` of ``x`` cancels the ``softcap`` in front). Attention sinks need nothing here: the
forward's ``lse`` includes them, so ``p`` recomputed from it is already the sink-aware share. A
sliding window changes only the mask and the loop bounds (below).

Because ``lse`` may be the *merged* LSE of several blocks (ring attention), the same kernels give
each block's share of the gradient of the merged output: ``p`` is then the block's part of the
global softmax. Rows with ``lse = -inf`` (no key anywhere) have ``p = 0``: the kernels read them
as ``+inf``.

Kernels. ``attn_bwd_preprocess_kernel`` computes ``delta [H, Tq]`` (float32). The gradients come
from two kernels so no atomics are needed and the result is deterministic: ``attn_bwd_dq_kernel``
owns a block of query rows of one head and walks the key blocks; ``attn_bwd_dkdv_kernel`` owns a
block of keys of one kv head, walks the ``H / Hkv`` query heads that share it (GQA) and their query
blocks. Both reuse the forward's loop bounds: positions of a sequence are increasing (one or two
runs, see ``attention_common.py``), so the rows and keys a block can see are closed-form prefix
counts and blocks nobody sees are never loaded. With a window the dq kernel walks the forward's
three key ranges, and a dk/dv program walks only the query rows whose windows reach its keys
(from the first row whose upper bound reaches the block to the last whose lower bound does), so
a window ``W`` costs ``O(L * W)`` here too. The dq kernel runs fully visible key blocks
without mask arithmetic; the dk/dv kernel keeps the (cheap) position compare in its single loop,
because a second, unmasked loop raised register pressure into spills at head dim 128. Rows past
a sequence's end are loaded as ``q = dout = 0``, ``lse = +inf``, so their ``p`` is 0.

Layout: as the forward; ``dq [Tq, H, D]`` and ``dk``/``dv [Tk, Hkv, D]`` are written in float32
so a caller summing several blocks (a ring) rounds once, at the end. Accumulation: float32; ``p``
and ``ds`` are rounded to the input dtype for the tensor-core products, as in flash-attention.

Where the idea comes from: FlashAttention-2 backward (Dao, 2023; the Triton tutorial's split into
a dk/dv pass and a dq pass), ring-attention backward (Liu et al., 2023) that circulates dk/dv with
the key/value blocks (DHP section 3.2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, launchable
from .attention_bwd_dkdv import attn_bwd_dkdv_kernel
from .attention_common import block_d, bwd_config, dot_precision, feature_args, row_bounds, run_position, tanh

__all__ = ["attn_bwd", "attn_bwd_dq_kernel", "attn_bwd_preprocess_kernel"]


@triton.jit
def attn_bwd_preprocess_kernel(
    out_ptr,
    dout_ptr,
    dlse_ptr,
    delta_ptr,
    n_tokens,
    stride_o_tok,
    stride_o_head,
    stride_do_tok,
    stride_do_head,
    stride_dlse_head,
    stride_delta_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < n_tokens
    mask = t_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    o = tl.load(out_ptr + rows * stride_o_tok + pid_h * stride_o_head + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(
        dout_ptr + rows * stride_do_tok + pid_h * stride_do_head + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + pid_h.to(tl.int64) * stride_dlse_head + offs_t, mask=t_ok, other=0.0)
    tl.store(delta_ptr + pid_h.to(tl.int64) * stride_delta_head + offs_t, delta, mask=t_ok)


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    qpos,
    qlo,
    k_base,
    v_base,
    stride_k_tok,
    stride_v_tok,
    seqlen_k,
    k_start0,
    k_len0,
    k_start1,
    lo,
    hi,
    qk_scale,
    softcap_log2e,
    offs_n,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Accumulate ``dq`` (unscaled) over key blocks ``[lo, hi)``; ``qpos``/``qlo`` are each row's
    highest/lowest visible key position, as in the forward's ``_attn_fwd_inner``."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols.to(tl.int64)[None, :] * stride_k_tok + offs_d[:, None]
        vt_ptrs = v_base + cols.to(tl.int64)[None, :] * stride_v_tok + offs_d[:, None]
        if MASKED:
            col_ok = cols < seqlen_k
            kt = tl.load(kt_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            th = tanh(qk)
            qk = th * softcap_log2e
        p = tl.math.exp2(qk - lse2[:, None])
        if MASKED:
            allowed = col_ok[None, :]
            if CAUSAL or WIN_RIGHT or WIN_LEFT:
                kpos = run_position(cols, k_start0, k_len0, k_start1)
                if CAUSAL or WIN_RIGHT:
                    allowed = allowed & (kpos[None, :] <= qpos[:, None])
                if WIN_LEFT:
                    allowed = allowed & (kpos[None, :] >= qlo[:, None])
            p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            # d softcap * tanh(x) / dx = 1 - tanh(x)^2 (with the 1/softcap of x cancelling softcap)
            ds = ds * (1.0 - th * th)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_block(
    m0,
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_q_ptr,
    cu_k_ptr,
    q_runs_ptr,
    k_runs_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_do_tok,
    stride_do_head,
    stride_dq_tok,
    stride_dq_head,
    stride_lse_head,
    stride_delta_head,
    qk_scale,
    sm_scale,
    causal_offset,
    window_left,
    window_right,
    softcap_log2e,
    pid_h,
    pid_hk,
    pid_b,
    q_beg,
    seqlen_q,
    k_beg,
    seqlen_k,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_beg + offs_m).to(tl.int64)[:, None]
    q = tl.load(
        q_ptr + rows * stride_q_tok + pid_h * stride_q_head + offs_d[None, :], mask=io_mask, other=0.0
    )
    do = tl.load(
        dout_ptr + rows * stride_do_tok + pid_h * stride_do_head + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    lse = tl.load(
        lse_ptr + pid_h.to(tl.int64) * stride_lse_head + q_beg + offs_m, mask=row_ok, other=float("inf")
    )
    # a row with no key anywhere (lse = -inf) must get p = 0, not exp(+inf)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(
        delta_ptr + pid_h.to(tl.int64) * stride_delta_head + q_beg + offs_m, mask=row_ok, other=0.0
    )
    k_base = k_ptr + k_beg.to(tl.int64) * stride_k_tok + pid_hk * stride_k_head
    v_base = v_ptr + k_beg.to(tl.int64) * stride_v_tok + pid_hk * stride_v_head

    qpos, qlo, n_full, n_end, lo_first, lo_last, k_start0, k_len0, k_start1 = row_bounds(
        m0, seqlen_q, seqlen_k, q_runs_ptr, k_runs_ptr, pid_b, causal_offset, window_left,
        window_right, offs_m, BLOCK_M, CAUSAL, HAS_RUNS, WIN_LEFT, WIN_RIGHT,
    )  # fmt: skip
    n_split = (n_full // BLOCK_N) * BLOCK_N

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full_lo = 0
    if WIN_LEFT:
        # the forward's three ranges: where some rows' windows start (masked), the keys every row
        # sees, the upper band and tail (masked); keys left of every window are never loaded
        n_full_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse2, delta, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
            k_start0, k_len0, k_start1, (lo_first // BLOCK_N) * BLOCK_N, n_full_lo, qk_scale,
            softcap_log2e, offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION,
            WIN_LEFT, WIN_RIGHT, SOFTCAP,
        )  # fmt: skip
        n_split = tl.maximum(n_split, n_full_lo)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_full_lo, n_split, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_split, n_end, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip
    dq_rows = (q_beg + offs_m).to(tl.int64)[:, None] * stride_dq_tok
    tl.store(dq_ptr + dq_rows + pid_h * stride_dq_head + offs_d[None, :], dq * sm_scale, mask=io_mask)


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_q_ptr,
    cu_k_ptr,
    q_runs_ptr,
    k_runs_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_do_tok,
    stride_do_head,
    stride_dq_tok,
    stride_dq_head,
    stride_lse_head,
    stride_delta_head,
    qk_scale,
    sm_scale,
    causal_offset,
    main_blocks,
    window_left,
    window_right,
    softcap_log2e,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_RUNS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OVERFLOW: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)  # int64: head offsets can pass 2**31 elements
    pid_b = tl.program_id(2)
    q_beg = tl.load(cu_q_ptr + pid_b)
    seqlen_q = tl.load(cu_q_ptr + pid_b + 1) - q_beg
    k_beg = tl.load(cu_k_ptr + pid_b)
    seqlen_k = tl.load(cu_k_ptr + pid_b + 1) - k_beg
    pid_hk = pid_h // GROUP
    if OVERFLOW:
        # query blocks past the main grid: only when max_seqlen_q understated a sequence
        for m0 in range((main_blocks + pid_m) * BLOCK_M, seqlen_q, tl.num_programs(0) * BLOCK_M):
            _attn_bwd_dq_block(
                m0, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
                q_runs_ptr, k_runs_ptr, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                stride_v_tok, stride_v_head, stride_do_tok, stride_do_head, stride_dq_tok,
                stride_dq_head, stride_lse_head, stride_delta_head, qk_scale, sm_scale, causal_offset,
                window_left, window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg,
                seqlen_k, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION,
                WIN_LEFT, WIN_RIGHT, SOFTCAP,
            )  # fmt: skip
    else:
        m0 = pid_m * BLOCK_M
        if m0 < seqlen_q:
            _attn_bwd_dq_block(
                m0, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
                q_runs_ptr, k_runs_ptr, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                stride_v_tok, stride_v_head, stride_do_tok, stride_do_head, stride_dq_tok,
                stride_dq_head, stride_lse_head, stride_delta_head, qk_scale, sm_scale, causal_offset,
                window_left, window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg,
                seqlen_k, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION,
                WIN_LEFT, WIN_RIGHT, SOFTCAP,
            )  # fmt: skip


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    config: dict | None = None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch preprocess, dq and dk/dv kernels; returns float32 ``dq``, ``dk``, ``dv``.

    Inputs are assumed validated (``pyops/attention_ops.py`` does it); ``dout`` and ``out`` are
    ``[Tq, H, D]``, ``lse`` (and ``dlse``) ``[H, Tq]`` float32. ``grads`` may pass preallocated
    float32 ``(dq, dk, dv)``. ``config`` takes :func:`~.attention_common.bwd_config`'s keys
    (default: its choice for this device); ``stages`` stands for both ``dq_stages`` and
    ``kv_stages``. Keys no query can see get zero gradients; an empty batch launches nothing. ``window_left``/``window_right``/``softcap`` must be the forward's; attention sinks
    need nothing here (``lse`` includes them; their own gradient is the caller's, see
    ``attention_fwd.py``).
    """
    tq, n_heads, head_dim = q.shape
    tk, n_kv_heads = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    dev = q.device
    # every row of every sequence is written by exactly one program (cu_seqlens cover all tokens)
    if grads is None:
        dq, dk, dv = (torch.empty((n, h, head_dim), dtype=torch.float32, device=dev)
                      for n, h in ((tq, n_heads), (tk, n_kv_heads), (tk, n_kv_heads)))  # fmt: skip
    else:
        dq, dk, dv = grads
    if batch == 0 or tq == 0 or tk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    feats = feature_args(causal, window_left, window_right, softcap, softmax_scale)
    window = feats["WIN_LEFT"] or feats["WIN_RIGHT"]
    cfg = dict(
        config
        or bwd_config(head_dim, dev, q.dtype, window=window, softcap=feats["SOFTCAP"], causal=bool(causal))
    )
    if "stages" in cfg:  # one pipeline depth for both passes
        cfg.setdefault("dq_stages", cfg["stages"])
        cfg.setdefault("kv_stages", cfg.pop("stages"))
    bd = block_d(head_dim)
    delta = torch.empty((n_heads, tq), dtype=torch.float32, device=dev)
    block_t = 16 if INTERPRET else 64
    launchable(attn_bwd_preprocess_kernel)[(triton.cdiv(tq, block_t), n_heads)](
        out, dout, dlse if dlse is not None else delta, delta, tq,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        dlse.stride(0) if dlse is not None else 0, delta.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_T=block_t, HAS_DLSE=dlse is not None,
    )  # fmt: skip
    has_runs = q_runs is not None
    q_runs_arg = q_runs if has_runs else cu_seqlens_q
    k_runs_arg = k_runs if has_runs else cu_seqlens_k
    common = dict(
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=bd, CAUSAL=causal, HAS_RUNS=has_runs,
        DOT_PRECISION=dot_precision(q.dtype), WIN_LEFT=feats["WIN_LEFT"],
        WIN_RIGHT=feats["WIN_RIGHT"], SOFTCAP=feats["SOFTCAP"],
    )  # fmt: skip
    qk_scale = feats["qk_scale"]
    extra = (feats["window_left"], feats["window_right"], feats["softcap_log2e"])
    # Each kernel runs its main grid (from the host's max_seqlen) and then one program per (head,
    # sequence) for whatever a wrong max_seqlen left out (it exits at once when nothing was), so no
    # gradient row stays unwritten.
    dq_blocks = triton.cdiv(max_seqlen_q, cfg["dq_BLOCK_M"])
    for overflow, m_grid in ((False, dq_blocks), (True, 1)):
        launch = dict(cfg, **cfg.get("overflow", {})) if overflow else cfg
        if m_grid:
            launchable(attn_bwd_dq_kernel)[(m_grid, n_heads, batch)](
                q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, q_runs_arg, k_runs_arg,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), lse.stride(0), delta.stride(0),
                qk_scale, softmax_scale, causal_offset, dq_blocks, *extra,
                BLOCK_M=cfg["dq_BLOCK_M"], BLOCK_N=launch["dq_BLOCK_N"], num_warps=launch["dq_warps"],
                num_stages=launch["dq_stages"],
                OVERFLOW=overflow, **common,
            )  # fmt: skip
    kv_blocks = triton.cdiv(max_seqlen_k, cfg["kv_BLOCK_N"])
    for overflow, n_grid in ((False, kv_blocks), (True, 1)):
        launch = dict(cfg, **cfg.get("overflow", {})) if overflow else cfg
        if n_grid:
            launchable(attn_bwd_dkdv_kernel)[(n_grid, n_kv_heads, batch)](
                q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q_runs_arg, k_runs_arg,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                lse.stride(0), delta.stride(0), qk_scale, softmax_scale, causal_offset, kv_blocks, *extra,
                BLOCK_M=launch["kv_BLOCK_M"], BLOCK_N=cfg["kv_BLOCK_N"], num_warps=launch["kv_warps"],
                num_stages=launch["kv_stages"],
                OVERFLOW=overflow, **common,
            )  # fmt: skip
    return dq, dk, dv
