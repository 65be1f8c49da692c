"""The dk/dv pass of the attention backward (see ``attention_bwd.py`` for the math and the
layout): one program per block of keys of one kv head, walking the query heads that share it (GQA)
and their query blocks. ``attention_bwd.attn_bwd`` launches it after the dq pass."""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import count_at_most, load_runs, run_position, tanh

__all__ = ["attn_bwd_dkdv_kernel"]


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    kpos,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_q_tok,
    stride_do_tok,
    seqlen_q,
    q_start0,
    q_len0,
    q_start1,
    lo,
    hi,
    qk_scale,
    window_left,
    window_right,
    softcap_log2e,
    offs_m,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    WIN_LEFT: tl.constexpr,
    WIN_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Accumulate ``dk`` (unscaled) and ``dv`` of one key block over query blocks ``[lo, hi)``.

    Rows past the sequence are loaded as ``q = dout = 0``, ``lse = +inf``, so their ``p`` is 0 with
    no mask arithmetic; ``MASKED`` adds the element-wise position mask (causal and/or window).
    """
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < seqlen_q
        qt_ptrs = q_base + rows.to(tl.int64)[None, :] * stride_q_tok + offs_d[:, None]
        do_ptrs = do_base + rows.to(tl.int64)[:, None] * stride_do_tok + offs_d[None, :]
        qt = tl.load(qt_ptrs, mask=row_ok[None, :] & d_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        kq = tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            th = tanh(kq)
            kq = th * softcap_log2e
        pt = tl.math.exp2(kq - lse2[None, :])
        if MASKED:
            qpos = run_position(rows, q_start0, q_len0, q_start1)
            if CAUSAL:
                allowed = kpos[:, None] <= qpos[None, :]
                if WIN_LEFT:
                    allowed = allowed & (kpos[:, None] >= qpos[None, :] - window_left)
            elif WIN_RIGHT:
                allowed = kpos[:, None] <= qpos[None, :] + window_right
                if WIN_LEFT:
                    allowed = allowed & (kpos[:, None] >= qpos[None, :] - window_left)
            else:
                allowed = kpos[:, None] >= qpos[None, :] - window_left
            pt = tl.where(allowed, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - th * th)
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_block(
    n0,
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
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
    stride_dk_tok,
    stride_dk_head,
    stride_dv_tok,
    stride_dv_head,
    stride_lse_head,
    stride_delta_head,
    qk_scale,
    sm_scale,
    causal_offset,
    window_left,
    window_right,
    softcap_log2e,
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
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_n < seqlen_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cols = (k_beg + offs_n).to(tl.int64)[:, None]
    k = tl.load(
        k_ptr + cols * stride_k_tok + pid_hk * stride_k_head + offs_d[None, :], mask=io_mask, other=0.0
    )
    v = tl.load(
        v_ptr + cols * stride_v_tok + pid_hk * stride_v_head + offs_d[None, :], mask=io_mask, other=0.0
    )

    if CAUSAL or WIN_LEFT or WIN_RIGHT:
        q_start0, q_len0, q_start1 = load_runs(q_runs_ptr, pid_b, seqlen_q, causal_offset, HAS_RUNS)
        k_start0, k_len0, k_start1 = load_runs(k_runs_ptr, pid_b, seqlen_k, 0, HAS_RUNS)
        kpos = run_position(offs_n, k_start0, k_len0, k_start1)
        k_first_pos = run_position(n0, k_start0, k_len0, k_start1)
        # rows before m_lo see no key of this block (row i sees key j only if pos_k(j) <= its
        # upper bound: pos_q(i) when causal, pos_q(i) + window_right for a right window)
        if CAUSAL:
            m_lo = count_at_most(k_first_pos - 1, seqlen_q, q_start0, q_len0, q_start1)
        elif WIN_RIGHT:
            m_lo = count_at_most(k_first_pos - window_right - 1, seqlen_q, q_start0, q_len0, q_start1)
        else:
            m_lo = 0
        if WIN_LEFT:
            # rows from m_hi on have their window start past this block's last key
            k_last_pos = run_position(tl.minimum(n0 + BLOCK_N, seqlen_k) - 1, k_start0, k_len0, k_start1)
            m_hi = count_at_most(k_last_pos + window_left, seqlen_q, q_start0, q_len0, q_start1)
        else:
            m_hi = seqlen_q
    else:
        q_start0 = 0
        q_len0 = seqlen_q
        q_start1 = 0
        kpos = offs_n
        m_lo = 0
        m_hi = seqlen_q
    # One loop per query head from the first block that sees a key of this block to the end. A
    # second loop without the causal mask for the fully visible blocks would save the compare but
    # costs enough registers to spill at head dim 128, so the mask is applied throughout.
    lo = (m_lo // BLOCK_M) * BLOCK_M

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        pid_h = pid_hk * GROUP + g
        q_base = q_ptr + q_beg.to(tl.int64) * stride_q_tok + pid_h * stride_q_head
        do_base = dout_ptr + q_beg.to(tl.int64) * stride_do_tok + pid_h * stride_do_head
        lse_base = lse_ptr + pid_h.to(tl.int64) * stride_lse_head + q_beg
        delta_base = delta_ptr + pid_h.to(tl.int64) * stride_delta_head + q_beg
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, kpos, q_base, do_base, lse_base, delta_base, stride_q_tok, stride_do_tok,
            seqlen_q, q_start0, q_len0, q_start1, lo, m_hi, qk_scale, window_left, window_right,
            softcap_log2e, offs_m, offs_d, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL or WIN_LEFT or WIN_RIGHT,
            DOT_PRECISION, CAUSAL, WIN_LEFT, WIN_RIGHT, SOFTCAP,
        )  # fmt: skip
    tl.store(dk_ptr + (k_beg + offs_n).to(tl.int64)[:, None] * stride_dk_tok + pid_hk * stride_dk_head
             + offs_d[None, :], dk * sm_scale, mask=io_mask)  # fmt: skip
    tl.store(dv_ptr + (k_beg + offs_n).to(tl.int64)[:, None] * stride_dv_tok + pid_hk * stride_dv_head
             + offs_d[None, :], dv, mask=io_mask)  # fmt: skip


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    dout_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
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
    stride_dk_tok,
    stride_dk_head,
    stride_dv_tok,
    stride_dv_head,
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
    pid_n = tl.program_id(0)
    pid_hk = tl.program_id(1).to(tl.int64)  # int64: head offsets can pass 2**31 elements
    pid_b = tl.program_id(2)
    k_beg = tl.load(cu_k_ptr + pid_b)
    seqlen_k = tl.load(cu_k_ptr + pid_b + 1) - k_beg
    q_beg = tl.load(cu_q_ptr + pid_b)
    seqlen_q = tl.load(cu_q_ptr + pid_b + 1) - q_beg
    if OVERFLOW:
        # key blocks past the main grid: only when max_seqlen_k understated a sequence
        for n0 in range((main_blocks + pid_n) * BLOCK_N, seqlen_k, tl.num_programs(0) * BLOCK_N):
            _attn_bwd_dkdv_block(
                n0, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr,
                cu_k_ptr, q_runs_ptr, k_runs_ptr, stride_q_tok, stride_q_head, stride_k_tok,
                stride_k_head, stride_v_tok, stride_v_head, stride_do_tok, stride_do_head,
                stride_dk_tok, stride_dk_head, stride_dv_tok, stride_dv_head, stride_lse_head,
                stride_delta_head, qk_scale, sm_scale, causal_offset, window_left, window_right,
                softcap_log2e, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k, GROUP, HEAD_DIM, BLOCK_D,
                BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
            )  # fmt: skip
    else:
        n0 = pid_n * BLOCK_N
        if n0 < seqlen_k:
            _attn_bwd_dkdv_block(
                n0, q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr,
                cu_k_ptr, q_runs_ptr, k_runs_ptr, stride_q_tok, stride_q_head, stride_k_tok,
                stride_k_head, stride_v_tok, stride_v_head, stride_do_tok, stride_do_head,
                stride_dk_tok, stride_dk_head, stride_dv_tok, stride_dv_head, stride_lse_head,
                stride_delta_head, qk_scale, sm_scale, causal_offset, window_left, window_right,
                softcap_log2e, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k, GROUP, HEAD_DIM, BLOCK_D,
                BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
            )  # fmt: skip
