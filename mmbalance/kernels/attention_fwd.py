"""Attention block forward: softmax(scale * q k^T + mask) v and the log-sum-exp, packed varlen.

Math. For sequence ``b``, query row ``i`` and head ``h`` (kv head ``h // (H / Hkv)``, GQA):

    s_ij   = scale * <q_i, k_j>                        j allowed by the mask
           = softcap * tanh(scale * <q_i, k_j> / softcap)   with logit softcapping (softcap > 0)
    lse_i  = log (exp(sink_h) + sum_j exp(s_ij))        the sink term only with attention sinks
    out_i  = sum_j exp(s_ij - lse_i) v_j

A row with no allowed key has ``out = 0`` and ``lse = -inf``, or ``lse = sink_h`` with sinks.
Logit softcapping is Gemma 2's (the logits stay inside ``(-softcap, softcap)``); the kernel takes
``tanh`` as ``2 / (1 + exp(-2x)) - 1``. An attention sink (gpt-oss's per-head ``s_aux``) is one
extra logit per head with no value vector: it joins the softmax denominator only, so the returned
``lse`` includes it and the backward, which recomputes ``p`` from ``lse``, needs nothing new. Its
own gradient, ``d sink_h = sum_i exp(sink_h - lse_hi) (dlse_hi - rowsum(dout_i * out_i))``, is
left to the caller.

Computed block by block with the online softmax of flash-attention: a running row maximum ``m``
and row sum ``l`` in base 2 (``exp2`` with the scale folded into ``scale * log2(e)``; with a
softcap, ``tanh(scale / softcap * qk) * softcap * log2(e)``), the accumulator rescaled by
``exp2(m_old - m_new)`` when the maximum grows. A row whose keys are all masked so far keeps
``m = -inf``; the update then uses 0 in place of ``m`` so no ``-inf - -inf`` NaN appears. With a
sink the row starts at ``m = sink, l = 1`` instead of ``m = -inf, l = 0``.

Masks, positions and loop bounds are the backward's too and live in ``attention_common.py``: key
``j`` is allowed for query ``i`` by causality and a sliding window on absolute positions (a
sequence's positions are one or two runs of consecutive integers, so a ring step's zigzag shards
are one launch), and every block of rows loads only the keys some row of it may see.

Specialisation. Causality, each window side, the softcap and the sinks are ``tl.constexpr``
switches (``CAUSAL``, ``WIN_LEFT``, ``WIN_RIGHT``, ``SOFTCAP``, ``SINKS``): a variant that does
not use a feature compiles to the same code as before the feature existed (the PTX of the plain
variants is unchanged by the features' code), and each feature adds only its own instructions.

Layout. ``q [Tq, H, D]``, ``k``/``v [Tk, Hkv, D]`` with the last dimension contiguous (other
strides are arguments); ``cu_seqlens_q``/``cu_seqlens_k`` int32 ``[B + 1]``; ``out [Tq, H, D]``;
``lse [H, Tq]`` float32 (natural log), flash-attn's varlen layout. Grid: (query blocks of the
longest sequence, H, B); programs past their sequence's end exit at once. Token offsets are int64.

Accumulation: ``q k^T`` and ``p v`` on tensor cores with float32 accumulators; softmax statistics
in float32; ``p`` is rounded to the value dtype for the second product as in flash-attention.
float32 inputs use IEEE products (no TF32) so they can serve as a reference.

Where the idea comes from: FlashAttention-2 (Dao, 2023) forward with the LSE output, which ring
attention (Liu et al., 2023; Brandon et al., 2023, cited in DHP section 3.2) needs to merge
partial results; DHP (section 4.1) runs ring CP of any degree, hence arbitrary chunk pairs and
uneven lengths. Sliding windows, softcapping and sinks follow flash-attn's and transformers'
definitions (Mistral's sliding window, Gemma 2's logit softcapping, gpt-oss's sinks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launchable
from .attention_common import (
    block_d,
    dot_precision,
    feature_args,
    fwd_config,
    row_bounds,
    run_position,
    tanh,
)

__all__ = ["attn_fwd", "attn_fwd_kernel"]


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
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
    WIN_LEFT: tl.constexpr = False,
    WIN_RIGHT: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """Online-softmax update of ``(acc, l_i, m_i)`` with key blocks ``[lo, hi)``.

    ``qpos`` is each row's highest visible key position (its own position when causal, plus
    ``window_right`` for a right window), ``qlo`` its lowest (``WIN_LEFT``); ``MASKED`` applies
    them element-wise, together with the sequence end.
    """
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kt_ptrs = k_base + cols.to(tl.int64)[None, :] * stride_k_tok + offs_d[:, None]
        v_ptrs = v_base + cols.to(tl.int64)[:, None] * stride_v_tok + offs_d[None, :]
        if MASKED:
            col_ok = cols < seqlen_k
            kt = tl.load(kt_ptrs, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            # qk_scale = scale / softcap here: s = softcap * tanh(scale * qk / softcap), base 2
            qk = tanh(qk) * softcap_log2e
        if MASKED:
            allowed = col_ok[None, :]
            if CAUSAL or WIN_RIGHT or WIN_LEFT:
                kpos = run_position(cols, k_start0, k_len0, k_start1)
                if CAUSAL or WIN_RIGHT:
                    allowed = allowed & (kpos[None, :] <= qpos[:, None])
                if WIN_LEFT:
                    allowed = allowed & (kpos[None, :] >= qlo[:, None])
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            # rows with every key masked so far keep m = -inf; subtract 0 instead (no NaN)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_block(
    m0,
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    q_runs_ptr,
    k_runs_ptr,
    sinks_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    qk_scale,
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
    SINKS: tl.constexpr,
):
    """Queries ``[m0, m0 + BLOCK_M)`` of sequence ``pid_b``, head ``pid_h``: out and lse."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q_ptrs = q_ptr + (q_beg + offs_m).to(tl.int64)[:, None] * stride_q_tok + pid_h * stride_q_head
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + k_beg.to(tl.int64) * stride_k_tok + pid_hk * stride_k_head
    v_base = v_ptr + k_beg.to(tl.int64) * stride_v_tok + pid_hk * stride_v_head

    qpos, qlo, n_full, n_end, lo_first, lo_last, k_start0, k_len0, k_start1 = row_bounds(
        m0, seqlen_q, seqlen_k, q_runs_ptr, k_runs_ptr, pid_b, causal_offset, window_left,
        window_right, offs_m, BLOCK_M, CAUSAL, HAS_RUNS, WIN_LEFT, WIN_RIGHT,
    )  # fmt: skip
    n_split = (n_full // BLOCK_N) * BLOCK_N

    if SINKS:
        # the sink joins the denominator only: start from m = sink, l = exp(sink - m) = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + pid_h) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full_lo = 0
    if WIN_LEFT:
        # keys left of the window are never loaded; the band where some rows' windows start
        # [lo_first, lo_last) is masked element-wise
        n_full_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
            k_start0, k_len0, k_start1, (lo_first // BLOCK_N) * BLOCK_N, n_full_lo, qk_scale,
            softcap_log2e, offs_n, offs_d, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION,
            WIN_LEFT, WIN_RIGHT, SOFTCAP,
        )  # fmt: skip
        n_split = tl.maximum(n_split, n_full_lo)
    # keys every row of the block may see: no mask arithmetic
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_full_lo, n_split, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip
    # the diagonal band and the ragged tail of the sequence
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, qpos, qlo, k_base, v_base, stride_k_tok, stride_v_tok, seqlen_k,
        k_start0, k_len0, k_start1, n_split, n_end, qk_scale, softcap_log2e, offs_n, offs_d,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION, WIN_LEFT, WIN_RIGHT, SOFTCAP,
    )  # fmt: skip

    if SINKS:
        # l_i >= exp(sink - m_i) > 0 unless the sink is -inf; then an empty row has l = 1, m = -inf
        out = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    else:
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(
            empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
        )
    o_ptrs = out_ptr + (q_beg + offs_m).to(tl.int64)[:, None] * stride_o_tok + pid_h * stride_o_head
    tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + pid_h.to(tl.int64) * stride_lse_head + q_beg + offs_m, lse, mask=row_ok)


@triton.jit
def attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
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
    stride_o_tok,
    stride_o_head,
    stride_lse_head,
    qk_scale,
    causal_offset,
    main_blocks,
    sinks_ptr,
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
    SINKS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # int64 head index: pid_h * stride_*_head can pass 2**31 elements on large batches
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2)
    q_beg = tl.load(cu_q_ptr + pid_b)
    seqlen_q = tl.load(cu_q_ptr + pid_b + 1) - q_beg
    k_beg = tl.load(cu_k_ptr + pid_b)
    seqlen_k = tl.load(cu_k_ptr + pid_b + 1) - k_beg
    pid_hk = pid_h // GROUP
    if OVERFLOW:
        # The blocks past the main grid (``main_blocks`` per sequence, from the host's
        # max_seqlen_q): none when max_seqlen_q is right; a sequence longer than it (possible
        # unchecked on CUDA) is still computed in full instead of leaving rows unwritten. A
        # separate specialization, so the loop costs the main kernel no registers.
        for m0 in range((main_blocks + pid_m) * BLOCK_M, seqlen_q, tl.num_programs(0) * BLOCK_M):
            _attn_fwd_block(
                m0, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_runs_ptr, k_runs_ptr, sinks_ptr,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_o_tok, stride_o_head, stride_lse_head, qk_scale, causal_offset, window_left,
                window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT,
                WIN_RIGHT, SOFTCAP, SINKS,
            )  # fmt: skip
    else:
        m0 = pid_m * BLOCK_M
        if m0 < seqlen_q:
            _attn_fwd_block(
                m0, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, q_runs_ptr, k_runs_ptr, sinks_ptr,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                stride_o_tok, stride_o_head, stride_lse_head, qk_scale, causal_offset, window_left,
                window_right, softcap_log2e, pid_h, pid_hk, pid_b, q_beg, seqlen_q, k_beg, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, CAUSAL, HAS_RUNS, DOT_PRECISION, WIN_LEFT,
                WIN_RIGHT, SOFTCAP, SINKS,
            )  # fmt: skip


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    causal_offset: int = 0,
    q_runs: torch.Tensor | None = None,
    k_runs: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``out [Tq, H, D]`` (``out_dtype``, default q's) and ``lse [H, Tq]``.

    Inputs are assumed validated (``pyops/attention_ops.py`` does it). ``out``/``lse`` may be passed
    preallocated (last dim contiguous; ``lse`` float32). Rows of sequences with no allowed key get
    ``out = 0`` and ``lse = -inf`` (``lse = sink`` with ``sinks``); an empty batch launches nothing.
    ``window_left``/``window_right`` (negative: unbounded), ``softcap`` (``> 0``: on) and ``sinks``
    (``[H]``, cast to float32) are described in the module docstring.
    """
    tq, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    if out is None:
        out = torch.empty((tq, n_heads, head_dim), dtype=out_dtype or q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((n_heads, tq), dtype=torch.float32, device=q.device)
    if tq == 0 or batch == 0:
        return out, lse
    feats = feature_args(causal, window_left, window_right, softcap, softmax_scale)
    window = feats["WIN_LEFT"] or feats["WIN_RIGHT"]
    cfg = dict(
        config
        or fwd_config(
            head_dim, q.device, q.dtype, window=window, softcap=feats["SOFTCAP"], causal=bool(causal)
        )
    )
    has_runs = q_runs is not None
    if sinks is not None:
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    main_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"])
    # The main grid covers max_seqlen_q; one program per (head, sequence) then covers whatever a
    # wrong max_seqlen_q left out (it exits at once when nothing was), so no row stays unwritten.
    for overflow, m_grid in ((False, main_blocks), (True, 1)):
        if m_grid == 0:
            continue
        launch = dict(cfg, **cfg.get("overflow", {})) if overflow else cfg
        launchable(attn_fwd_kernel)[(m_grid, n_heads, batch)](
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            q_runs if has_runs else cu_seqlens_q, k_runs if has_runs else cu_seqlens_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            feats["qk_scale"], causal_offset, main_blocks, lse if sinks is None else sinks,
            feats["window_left"], feats["window_right"], feats["softcap_log2e"],
            GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=launch["BLOCK_N"], CAUSAL=causal, HAS_RUNS=has_runs,
            DOT_PRECISION=dot_precision(q.dtype), OVERFLOW=overflow, WIN_LEFT=feats["WIN_LEFT"],
            WIN_RIGHT=feats["WIN_RIGHT"], SOFTCAP=feats["SOFTCAP"], SINKS=sinks is not None,
            num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        )  # fmt: skip
    return out, lse
