"""A packed varlen attention backend for transformers (``AttentionInterface``): ``"mmbalance_varlen"``.

Balanced batches are best run without padding: each rank's examples packed back to back into
rows, sequence boundaries where ``position_ids`` restart (as transformers' packing collators
produce them, ``DataCollatorWithFlattening``), or given directly as ``cu_seq_lens_q/k``. This
backend runs such batches through mmbalance's varlen attention op
(:func:`mmbalance.pyops.attention_ops.attention_block`): the Triton flash-style kernel on CUDA
(flash-attn when installed and the call allows it), the reference on CPU tensors. So packed
training needs neither flash-attn nor padding.

What a call can express, and how it maps onto the op (one call per layer, every sequence of the
batch packed into it):

* the mask, through our ``AttentionMaskInterface`` function (``attention_mask.py``): causal or
  bidirectional, padding (left, right, or both around generated tokens), a KV cache's offsets
  (queries bottom-right of their keys; a static cache's empty slots masked), sliding windows
  (judged per sequence), Llama4's chunked attention (each chunk its own sequence), packed rows
  with any batch size (every row split where its ``position_ids`` restart), bidirectional
  attention inside image blocks (Gemma3's ``block_sequence_ids``: a second call over each block's
  later keys, merged by log-sum-exp);
* without our mask (a model that builds none, cross-attention): ``is_causal`` (a module without
  it is bidirectional; causal calls with fewer queries than keys are bottom-right, a cache's),
  ``sliding_window`` (flash-attn's semantics), ``cu_seq_lens_q/k`` (causal bottom-right when they
  differ), ``position_ids`` (2-D, or the text row of 3-D M-RoPE ``[4, B, L]`` positions, as
  transformers reads them), 2-D padding masks and 4-D masks of 0/-inf (or bool) whose rows see at
  most two runs of keys (Mllama's ``cross_attention_mask``);
* ``softcap`` (Gemma2) and attention sinks ``s_aux`` (gpt-oss, with their gradient);
* ``torch.autocast``: q, k and v run in the autocast dtype.

Every plan is made once per forward and reused by the layers; under ``torch.compile`` planning
stays outside the graph (``attention_compile.py``).

Everything else a model hands an attention function is refused with an error that names the
backend and the feature, never ignored: attention dropout in training, ``position_bias`` (T5),
``output_attentions``, 4-D masks with an attention bias or one per head, custom masks, other
unions of mask functions (a bidirectional decoder, ``use_bidirectional_attention``), causal calls
with more queries than keys and no ``cu_seq_lens``, paged caches, unknown keywords.

    from mmbalance.integrations.hf import register_attention
    register_attention()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mmbalance_varlen")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmbalance.pyops.attention_ops import attention_block, merge_attention_states
from mmbalance.pyops.varlen import cu_seqlens_from_lengths

from .attention_compile import PlanCache, outside_graph
from .attention_mask import ATTENTION_NAME, VarlenMask, dense_mask_runs, set_planner, varlen_mask
from .cp_attention import CP_KEYWORD, cp_attention

__all__ = [
    "ATTENTION_NAME",
    "plan_mask",
    "register_attention",
    "varlen_attention",
    "varlen_mask",
    "VarlenMask",
]

# keywords that shape the attention and are implemented here
_IMPLEMENTED = {
    "is_causal", "sliding_window", "softcap", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_ids",
}  # fmt: skip
# keywords models pass along that carry nothing about attention itself
_INERT = {
    "cache_position", "use_cache", "past_key_values", "past_key_value", "output_hidden_states",
    "output_router_logits", "return_dict", "num_items_in_batch", "layer_idx", "seq_idx",
    "position_embeddings", "target_dtype", "labels", "shift_labels",
}  # fmt: skip
# keywords refused whenever they ask for something (not None / False)
_REFUSED = {
    "output_attentions": "returning attention weights (output_attentions=True)",
    "position_bias": "an additive attention bias (`position_bias`, e.g. T5's relative bias)",
    "deterministic": "the `deterministic` switch",
    "cache": "paged attention caches (continuous batching)",
    "block_table": "paged attention caches (`block_table`)",
    "k_cache": "paged attention caches (`k_cache`)",
    "v_cache": "paged attention caches (`v_cache`)",
    "cache_seqlens": "paged attention caches (`cache_seqlens`)",
    "head_mask": "head masks (`head_mask`)",
    "layer_head_mask": "head masks (`layer_head_mask`)",
}


def _refuse(what: str, exc=ValueError) -> Exception:
    return exc(f"{ATTENTION_NAME} does not implement {what}")


def _check_keywords(module, dropout: float, kwargs: dict) -> None:
    if dropout and getattr(module, "training", False):
        raise _refuse(f"attention dropout in training (got dropout={dropout})")
    for name, val in kwargs.items():
        if name in _IMPLEMENTED or name in _INERT:
            continue
        if val is None or val is False:
            continue
        if name in _REFUSED:
            raise _refuse(_REFUSED[name])
        raise _refuse(f"the attention keyword `{name}` (got {type(val).__name__})", NotImplementedError)


# ------------------------------------------------------------------------------------ the plan
@dataclass
class _Seq:
    """One sequence of the op call: a run of queries and up to two runs of keys (flat rows)."""

    row: int
    q0: int
    nq: int
    qpos: int
    kruns: list[tuple[int, int, int]]  # (first flat key row, length, position of that row)


@dataclass
class _Plan:
    k_index: Tensor | None
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal_offset: int
    q_runs: Tensor | None
    k_runs: Tensor | None
    window: tuple[int, int]
    blocks: _BlockPlan | None = None


@dataclass
class _BlockPlan:
    """The later keys of each query's own block, run as a second op call in reversed token order
    (so "later" becomes causal) and merged into the first by their log-sum-exps."""

    q_index: Tensor
    k_index: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    q_runs: Tensor
    k_runs: Tensor


def _true_runs(valid: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.concatenate([[0], valid.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def _row_seqs(spec: VarlenMask, b: int, lq: int, lk: int) -> list[_Seq]:
    """One sequence per batch row: all its queries, its valid keys (<= 2 runs)."""
    valid = np.ones((b, lk), dtype=bool)
    if spec.padding is not None:
        pad = spec.padding.detach().to("cpu", torch.bool).numpy()
        lo, hi = spec.kv_offset, spec.kv_offset + lk
        window = np.zeros((b, lk), dtype=bool)
        avail = max(0, min(hi, pad.shape[1]) - lo)
        window[:, :avail] = pad[:, lo : lo + avail]
        valid &= window
    if spec.causal:  # keys past the last query are masked anyway (a static cache's empty slots)
        last = spec.q_offset + lq - 1 - spec.kv_offset
        valid[:, max(last + 1, 0) :] = False
    seqs = []
    for r in range(b):
        runs = _true_runs(valid[r])
        if len(runs) > 2:
            raise _refuse(
                f"a padding mask whose valid keys form {len(runs)} separate runs in one row (at most 2: "
                "padding around generated tokens)"
            )
        kruns = [(r * lk + s, e - s, spec.kv_offset + s) for s, e in runs]
        seqs.append(_Seq(r, r * lq, lq, spec.q_offset, kruns))
    return seqs


def _segments_from_positions(pos: np.ndarray) -> np.ndarray:
    """transformers' ``find_packed_sequence_indices``: a new sequence wherever the position does not
    grow by exactly one."""
    diff = np.diff(pos, prepend=pos[:, :1] - 1, axis=-1)
    return np.cumsum(diff != 1, axis=-1)


def _packed_seqs(segments: np.ndarray, positions: np.ndarray, lq: int) -> list[_Seq]:
    seqs = []
    for r in range(segments.shape[0]):
        seg = segments[r]
        starts = np.flatnonzero(np.concatenate([[True], seg[1:] != seg[:-1]]))
        ends = np.concatenate([starts[1:], [seg.size]])
        for s, e in zip(starts.tolist(), ends.tolist()):
            p = int(positions[r, s])
            seqs.append(_Seq(r, r * lq + s, e - s, p, [(r * lq + s, e - s, p)]))
    return seqs


def _cu_seqs(cu_q: Tensor, cu_k: Tensor) -> list[_Seq]:
    """Explicit boundaries over the flattened batch; positions aligned bottom-right (flash-attn)."""
    cq = cu_q.detach().to("cpu", torch.int64).numpy()
    ck = cu_k.detach().to("cpu", torch.int64).numpy()
    if cq.ndim != 1 or ck.shape != cq.shape:
        raise ValueError(
            f"cu_seq_lens_q and cu_seq_lens_k must be 1-D of one length, got {tuple(cq.shape)} and {tuple(ck.shape)}"
        )
    seqs = []
    for i in range(cq.size - 1):
        nq, nk = int(cq[i + 1] - cq[i]), int(ck[i + 1] - ck[i])
        seqs.append(_Seq(0, int(cq[i]), nq, nk - nq, [(int(ck[i]), nk, 0)] if nk else []))
    return seqs


def _split_chunks(seqs: list[_Seq], chunk: int, left_padding: np.ndarray | None) -> list[_Seq]:
    """Chunked attention: positions ``p`` and ``p'`` attend iff ``(p - lp) // chunk`` agree, so each
    chunk of a sequence becomes a sequence of its own."""
    out = []
    for s in seqs:
        lp = int(left_padding[s.row]) if left_padding is not None else 0
        if s.nq == 0:
            continue
        first, last = (s.qpos - lp) // chunk, (s.qpos + s.nq - 1 - lp) // chunk
        for c in range(first, last + 1):
            lo, hi = lp + c * chunk, lp + (c + 1) * chunk  # positions of this chunk
            qa, qb = max(lo, s.qpos), min(hi, s.qpos + s.nq)
            kruns = []
            for k0, kn, kp in s.kruns:
                ka, kb = max(lo, kp), min(hi, kp + kn)
                if kb > ka:
                    kruns.append((k0 + ka - kp, kb - ka, ka))
            out.append(_Seq(s.row, s.q0 + qa - s.qpos, qb - qa, qa, kruns))
    return out


def _window_needed(seqs: list[_Seq], window: tuple[int, int] | None, causal: bool) -> tuple[int, int]:
    """The window to pass to the op: a bound no sequence reaches is dropped (flash-attn judges the
    window on the padded key length; a sequence shorter than the window needs none)."""
    if window is None:
        return -1, -1
    left, right = window
    need_left = need_right = False
    for s in seqs:
        if s.nq == 0 or not s.kruns:
            continue
        k_lo = s.kruns[0][2]
        k_hi = s.kruns[-1][2] + s.kruns[-1][1] - 1
        q_lo, q_hi = s.qpos, s.qpos + s.nq - 1
        need_left |= left >= 0 and q_hi - k_lo > left
        need_right |= right >= 0 and not causal and k_hi - q_lo > right
    return (left if need_left else -1), (right if need_right else -1)


def _build_plan(seqs: list[_Seq], n_q: int, n_k: int, causal: bool, window, device) -> _Plan:
    if sum(s.nq for s in seqs) != n_q or any(a.q0 + a.nq != b.q0 for a, b in zip(seqs, seqs[1:])):
        raise ValueError(f"{ATTENTION_NAME}: the sequences do not cover the {n_q} query tokens in order")
    nq = np.array([s.nq for s in seqs], dtype=np.int64)
    nk = np.array([sum(r[1] for r in s.kruns) for s in seqs], dtype=np.int64)
    pieces = [np.arange(k0, k0 + kn) for s in seqs for k0, kn, _ in s.kruns]
    k_rows = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    identity = k_rows.size == n_k and bool(np.all(k_rows == np.arange(n_k)))
    k_index = None if identity else torch.from_numpy(k_rows.astype(np.int64)).to(device)
    # positions relative to each sequence's first key: one causal offset for all, or run tensors
    offsets = {s.qpos - (s.kruns[0][2] if s.kruns else s.qpos) for s in seqs if s.nq}
    single = all(len(s.kruns) <= 1 for s in seqs)
    q_runs = k_runs = None
    offset = 0
    if single and len(offsets) <= 1:
        offset = offsets.pop() if offsets else 0
    else:
        qr, kr = [], []
        for s in seqs:
            base = min([s.qpos] + [r[2] for r in s.kruns])
            qr.append((s.qpos - base, s.nq, s.qpos - base + s.nq))
            if not s.kruns:
                kr.append((0, 0, 0))
            elif len(s.kruns) == 1:
                p = s.kruns[0][2] - base
                kr.append((p, s.kruns[0][1], p + s.kruns[0][1]))
            else:
                kr.append((s.kruns[0][2] - base, s.kruns[0][1], s.kruns[1][2] - base))
        q_runs = torch.tensor(qr, dtype=torch.int32, device=device)
        k_runs = torch.tensor(kr, dtype=torch.int32, device=device)
    # one tensor for equal boundaries: the op takes that as "same sequences" (flash-attn may run it)
    cu_q = cu_seqlens_from_lengths(nq, device=device)
    return _Plan(
        k_index=k_index,
        cu_q=cu_q,
        cu_k=cu_q if np.array_equal(nq, nk) else cu_seqlens_from_lengths(nk, device=device),
        max_q=int(nq.max(initial=0)),
        max_k=int(nk.max(initial=0)),
        causal_offset=int(offset),
        q_runs=q_runs,
        k_runs=k_runs,
        window=_window_needed(seqs, window, causal),
    )


def _block_plan(spec: VarlenMask, b: int, lq: int, lk: int, device) -> _BlockPlan | None:
    """Queries of a block (``blocks[b, i] = id >= 0``, contiguous) see the block's later keys on
    top of their causal ones. In reversed order, query ``qa`` of block ``[a, e)`` sits at
    ``e - 1 - qa`` and key ``ka`` at ``e - ka``: causal there means ``ka > qa``, exactly the keys
    the causal call left out."""
    assert spec.blocks is not None
    ids = spec.blocks.detach().cpu().numpy()
    valid = None
    if spec.padding is not None:
        valid = spec.padding.detach().to("cpu", torch.bool).numpy()
    q_rows, k_rows, qr, kr, nq, nk = [], [], [], [], [], []
    for r in range(b):
        row = ids[r if ids.shape[0] > 1 else 0]
        for block in np.unique(row[row >= 0]).tolist():
            at = np.flatnonzero(row == block)
            a, e = int(at[0]), int(at[-1]) + 1
            if at.size != e - a:
                raise _refuse(f"bidirectional blocks that are not contiguous (block {block} of row {r})")
            qlo, qhi = max(a, spec.q_offset), min(e, spec.q_offset + lq)
            klo, khi = max(a, spec.kv_offset), min(e, spec.kv_offset + lk)
            if valid is not None:
                ok = np.zeros(khi - klo, dtype=bool) if khi > klo else np.zeros(0, dtype=bool)
                upto = min(khi, valid.shape[1])
                if upto > klo:
                    ok[: upto - klo] = valid[r, klo:upto]
                runs = _true_runs(ok)
                if len(runs) > 1:
                    raise _refuse(f"padding inside a bidirectional block (block {block} of row {r})")
                klo, khi = (klo + runs[0][0], klo + runs[0][1]) if runs else (klo, klo)
            if qhi <= qlo or khi <= klo or khi - 1 <= qlo:
                continue  # no query of the block has a later key
            q_rows.append(r * lq + np.arange(qhi - 1, qlo - 1, -1) - spec.q_offset)
            k_rows.append(r * lk + np.arange(khi - 1, klo - 1, -1) - spec.kv_offset)
            qp, kp = e - qhi, e - khi + 1
            qr.append((qp, qhi - qlo, qp + qhi - qlo))
            kr.append((kp, khi - klo, kp + khi - klo))
            nq.append(qhi - qlo)
            nk.append(khi - klo)
    if not q_rows:
        return None
    return _BlockPlan(
        q_index=torch.from_numpy(np.concatenate(q_rows)).to(device),
        k_index=torch.from_numpy(np.concatenate(k_rows)).to(device),
        cu_q=cu_seqlens_from_lengths(np.array(nq), device=device),
        cu_k=cu_seqlens_from_lengths(np.array(nk), device=device),
        max_q=max(nq),
        max_k=max(nk),
        q_runs=torch.tensor(qr, dtype=torch.int32, device=device),
        k_runs=torch.tensor(kr, dtype=torch.int32, device=device),
    )


def _plan(spec: VarlenMask, b: int, lq: int, lk: int, cu: tuple[Tensor, Tensor] | None, device) -> _Plan:
    if spec.blocks is not None and (cu is not None or spec.chunk is not None):
        raise _refuse("bidirectional blocks together with cu_seq_lens or chunked attention")
    if cu is not None:
        if spec.padding is not None:
            raise ValueError(
                f"{ATTENTION_NAME}: cu_seq_lens_q/k together with a padding attention_mask; give one of them"
            )
        seqs = _cu_seqs(*cu)
    elif spec.segments is not None and spec.positions is not None:
        seqs = _packed_seqs(spec.segments.detach().cpu().numpy(), spec.positions.detach().cpu().numpy(), lq)
    else:
        seqs = _row_seqs(spec, b, lq, lk)
    if spec.chunk is not None:
        lp = None if spec.left_padding is None else spec.left_padding.detach().cpu().numpy().reshape(-1)
        seqs = _split_chunks(seqs, spec.chunk, lp)
    plan = _build_plan(seqs, b * lq, b * lk, spec.causal, spec.window, device)
    if spec.blocks is not None:
        plan.blocks = _block_plan(spec, b, lq, lk, device)
    return plan


def plan_mask(spec: VarlenMask, device: torch.device) -> None:
    """Plan the op calls of ``spec``'s layers ahead of them (their usual shape: the mask's batch,
    query and key lengths), as the mask function does inside ``torch.compile``."""
    key = (spec.q_length, spec.kv_length, spec.batch_size, device)
    if key not in spec.plans:
        spec.plans[key] = _plan(spec, spec.batch_size, spec.q_length, spec.kv_length, None, device)


set_planner(plan_mask)


@outside_graph(ATTENTION_NAME, "its planning of a call")
def _plan_with_mask(spec: VarlenMask, b, lq, lk, cu, device, position_ids) -> _Plan:
    """A call with our mask but no plan for it yet: explicit ``cu_seq_lens``, ``position_ids`` of
    packed rows for a mask built without them, or a shape the mask function did not plan for."""
    if cu is not None:
        # every layer of a forward gets the same cu_seq_lens tensors
        ckey = ("cu", lq, lk, b, device, id(cu[0]), id(cu[1]))
        hit = spec.plans.get(ckey)
        if hit is None or hit[0] is not cu[0] or hit[1] is not cu[1]:
            hit = spec.plans[ckey] = (cu[0], cu[1], _plan(spec, b, lq, lk, cu, device))
        return hit[2]
    if position_ids is not None:
        # some models build their mask without position_ids (gpt-oss): packed rows are then read
        # from the positions the layer gets, as flash-attention does (once per tensor: every layer
        # gets the same one)
        pkey = ("positions", lq, lk, b, device, id(position_ids))
        hit = spec.plans.get(pkey)
        if hit is None or hit[0] is not position_ids:
            packing = _packing_from_position_ids(position_ids, b, lq)
            packed = spec
            if packing is not None:
                packed = dataclasses.replace(spec, segments=packing[0], positions=packing[1], plans={})
            hit = spec.plans[pkey] = (position_ids, _plan(packed, b, lq, lk, None, device))
        return hit[1]
    key = (lq, lk, b, device)
    if key not in spec.plans:
        spec.plans[key] = _plan(spec, b, lq, lk, None, device)
    return spec.plans[key]


def _shape_plan(b: int, lq: int, lk: int, causal: bool, window) -> tuple[int, int] | None:
    """Whether a call without a mask, ``cu_seq_lens`` or packing is planned from its shape alone
    (every row one sequence over all its keys; causal: bottom-right, a cache's): its window, or
    None when it needs the host."""
    if lq <= 0 or lk <= 0 or (causal and lq > lk):
        return None
    if window is None:
        return -1, -1
    left, right = window  # _window_needed for these sequences: queries at lk - lq .. lk - 1
    return (left if left >= 0 and lk - 1 > left else -1), (
        right if right >= 0 and not causal and lq - 1 > right else -1
    )


def _rows_plan(b: int, lq: int, lk: int, window: tuple[int, int], device) -> _Plan:
    """``_plan`` of a shape-only call, in tensor ops Dynamo traces (no host data)."""
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device) * lq
    cu_k = cu_q if lq == lk else torch.arange(b + 1, dtype=torch.int32, device=device) * lk
    return _Plan(k_index=None, cu_q=cu_q, cu_k=cu_k, max_q=lq, max_k=lk, causal_offset=lk - lq,
                 q_runs=None, k_runs=None, window=window)  # fmt: skip


# calls without our mask (cross-attention, vision towers' cu_seq_lens, masks from outside): every
# layer of a forward brings the same tensors, so the first layer plans for all
_KEYWORD_PLANS = PlanCache()


@outside_graph(ATTENTION_NAME, "its planning of a call")
def _plan_without_mask(
    attention_mask, b, lq, lk, causal, window, cu, position_ids, device
) -> tuple[_Plan, bool]:
    """The plan (and the op's causal flag) of a call whose mask is a 2-D or 4-D tensor or None."""

    def make() -> tuple[_Plan, bool]:
        if attention_mask is not None and attention_mask.dim() == 4:
            if cu is not None:
                raise ValueError(
                    f"{ATTENTION_NAME}: cu_seq_lens_q/k together with a 4-D attention mask; give one of them"
                )
            seqs = [
                _Seq(
                    r, r * lq + q0, nq, runs[0][0] if runs else 0, [(r * lk + k0, kn, k0) for k0, kn in runs]
                )
                for r, q0, nq, runs in dense_mask_runs(attention_mask, b, lq, lk)
            ]
            return _build_plan(seqs, b * lq, b * lk, False, None, device), False
        if causal and cu is None and lq > lk:
            # bottom-right alignment would leave the first queries without keys: that is never
            # self-attention over a cache, whose keys include the queries
            raise ValueError(
                f"{ATTENTION_NAME}: causal attention with more queries ({lq}) than keys ({lk}) and no "
                "cu_seq_lens_q/k; cross-attention must say is_causal=False (a module without is_causal is "
                "bidirectional)"
            )
        spec = _mask_from_keywords(
            attention_mask, b, lq, lk, causal, window, None if cu is not None else position_ids
        )
        return _plan(spec, b, lq, lk, cu, device), causal

    tensors = (attention_mask, *(cu if cu is not None else (None, None)), position_ids)
    return _KEYWORD_PLANS.get_or_plan(tensors, (b, lq, lk, causal, window, device), make)


# ------------------------------------------------------------------------- masks from keywords
def _text_positions(position_ids: Tensor, b: int) -> Tensor | None:
    """The positions that mark packing boundaries, as transformers reads them: 2-D ``[B, L]``
    (or ``[1, L]``), or the text row of 3-D M-RoPE positions ``[4, B, L]``; plain 3-D M-RoPE
    ``[3, B, L]`` positions carry no boundaries."""
    if position_ids.dim() == 3:
        if position_ids.shape[0] != 4:
            return None
        position_ids = position_ids[0]
    if position_ids.dim() != 2:
        raise ValueError(
            f"{ATTENTION_NAME}: position_ids must be 2-D or 3-D, got {tuple(position_ids.shape)}"
        )
    return position_ids.expand(b, -1)


def _packing_from_position_ids(position_ids, b: int, length: int) -> tuple[Tensor, Tensor] | None:
    """Sequence ids and positions of packed rows, from ``position_ids`` that restart inside a row
    (None when no row restarts)."""
    if position_ids is None:
        return None
    text = _text_positions(position_ids, b)
    if text is None or text.shape[-1] != length:
        return None
    pos = text.detach().cpu().numpy()
    seg = _segments_from_positions(pos)
    if not (seg[:, -1] > 0).any():
        return None
    return torch.from_numpy(seg), torch.from_numpy(pos)


def _mask_from_keywords(
    attention_mask: Tensor | None, b: int, lq: int, lk: int, causal: bool, window, position_ids
) -> VarlenMask:
    """What flash-attention reads from a call without our mask: a 2-D padding mask (keys
    right-aligned to it, queries bottom-right), else packing from ``position_ids``."""
    spec = VarlenMask(batch_size=b, q_length=lq, kv_length=lk, q_offset=lk - lq, causal=causal, window=window)
    if attention_mask is not None:
        spec.padding = attention_mask[:, -lk:].to(torch.bool)
    elif lq == lk:
        packing = _packing_from_position_ids(position_ids, b, lq)
        if packing is not None:
            spec.segments, spec.positions = packing
    return spec


# ----------------------------------------------------------------------------- the function
def varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, Lq, D]``, ``key``/``value``
    ``[B, Hkv, Lk, D]`` (GQA: ``H % Hkv == 0``); returns ``(out [B, Lq, H, Dv], None)``.

    Under ``torch.autocast`` the attention runs in the autocast dtype (q, k and v cast to it, as
    transformers' flash-attention path does: HF decoders hand over float32 queries and keys, RoPE
    being float32, and half-precision values); the output has that dtype. Without our mask, a
    module that does not say ``is_causal`` (or says False) is bidirectional.

    With a dynamic context-parallel shard in the keywords (``mmbalance_cp``, from
    :meth:`~mmbalance.integrations.hf.dynamic_cp.DynamicCPHandle.shard`) it runs the shard's ring
    or varlen attention instead (``cp_attention.py``)."""
    shard = kwargs.pop(CP_KEYWORD, None)
    _check_keywords(module, dropout, kwargs)
    if shard is not None:
        return cp_attention(module, query, key, value, attention_mask, scaling, shard, kwargs)
    query, key, value = _one_dtype(query, key, value)
    b, h, lq, d = query.shape
    lk, dv = key.shape[2], value.shape[-1]
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if causal is None else causal)
    sliding = kwargs.get("sliding_window")
    kw_window = None
    if sliding is not None and sliding > 0:
        kw_window = (int(sliding) - 1, -1 if causal else int(sliding) - 1)  # flash-attn's (W - 1, W - 1)
    cu_q: Tensor | None = kwargs.get("cu_seq_lens_q")
    cu_k: Tensor | None = kwargs.get("cu_seq_lens_k")
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    cu = (cu_q, cu_k) if cu_q is not None and cu_k is not None else None
    device = query.device

    if isinstance(attention_mask, VarlenMask):
        spec = attention_mask
        if spec.q_length != lq or spec.kv_length < lk or spec.batch_size not in (b, 1):
            raise ValueError(
                f"{ATTENTION_NAME}: the mask was built for {spec.q_length} queries x {spec.kv_length} keys, "
                f"the call has {lq} x {lk}"
            )
        if kw_window is not None and spec.window is None:
            raise ValueError(
                f"{ATTENTION_NAME}: the layer asks for sliding_window={sliding} but its mask has no sliding "
                "window (the model built a full-attention mask for it)"
            )
        causal = spec.causal
        plain = spec.segments is None and spec.padding is None and spec.q_offset == spec.kv_offset == 0
        position_ids = kwargs.get("position_ids")
        by_positions = cu is None and plain and lq == lk and position_ids is not None
        # the plan of this shape is on the mask after its first layer (under torch.compile: made by
        # the mask function), a lookup Dynamo traces without a graph break
        plan = None if cu is not None or by_positions else spec.plans.get((lq, lk, b, device))
        if plan is None:
            plan = _plan_with_mask(spec, b, lq, lk, cu, device, position_ids if by_positions else None)
    elif attention_mask is None or (isinstance(attention_mask, Tensor) and attention_mask.dim() in (2, 4)):
        config = getattr(module, "config", None)
        if getattr(config, "attention_chunk_size", None) and attention_mask is None:
            raise _refuse(
                "chunked attention without its own mask function (register_attention() installs it; "
                "a mask passed in from outside carries no chunks)"
            )
        position_ids = kwargs.get("position_ids")
        shaped = None
        if attention_mask is None and cu is None and (lq != lk or position_ids is None):
            shaped = _shape_plan(b, lq, lk, causal, kw_window)
        if shaped is not None:  # e.g. cross-attention without a mask: nothing to read, no graph break
            plan = _rows_plan(b, lq, lk, shaped, device)
        else:
            plan, causal = _plan_without_mask(
                attention_mask, b, lq, lk, causal, kw_window, cu, position_ids, device
            )
    else:
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise _refuse(
            f"{type(attention_mask).__name__} attention masks of shape {shape} (custom masks); models get its "
            "own mask function from register_attention()"
        )

    extra: dict[str, Any] = {}
    if plan.window != (-1, -1):
        extra.update(window_left=plan.window[0], window_right=plan.window[1])
    softcap = kwargs.get("softcap")
    if softcap is not None and softcap > 0:
        extra["softcap"] = float(softcap)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        if sinks.shape != (h,):
            raise ValueError(
                f"{ATTENTION_NAME}: s_aux must have one logit per query head ({h}), got {tuple(sinks.shape)}"
            )
        extra["sinks"] = sinks

    width = max(d, dv)  # MLA: value head dim != query head dim -> pad to one width, crop after
    q = query.transpose(1, 2).reshape(b * lq, h, d)
    k = key.transpose(1, 2).reshape(b * lk, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * lk, value.shape[1], dv)
    if width != d:
        q, k = (torch.nn.functional.pad(t, (0, width - d)) for t in (q, k))
    if width != dv:
        v = torch.nn.functional.pad(v, (0, width - dv))
    scale = float(scaling) if scaling is not None else d**-0.5
    kq, vq = k, v
    if plan.k_index is not None:
        kq, vq = k.index_select(0, plan.k_index), v.index_select(0, plan.k_index)
    out, lse = attention_block(
        q, kq, vq, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, softmax_scale=scale, causal=causal,
        causal_offset=plan.causal_offset, q_runs=plan.q_runs, k_runs=plan.k_runs, **extra,
    )  # fmt: skip
    if plan.blocks is not None:
        out = _add_block_keys(out, lse, q, k, v, plan.blocks, scale, extra.get("softcap"))
    out = out.view(b, lq, h, width)
    if width != dv:
        out = out[..., :dv]
    return out, None


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


def _one_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v in one dtype: the autocast dtype inside ``torch.autocast`` (float64 stays), else
    they must share one already (a TypeError naming the backend)."""
    device_type = query.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE else t for t in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"{ATTENTION_NAME}: query, key and value must share a dtype outside torch.autocast, got {query.dtype}, "
            f"{key.dtype} and {value.dtype}. Mixed-precision training runs the model under torch.autocast "
            "(TrainingArguments(bf16=True) or fp16=True do), where they are cast to the autocast dtype; else "
            "cast the model to one dtype"
        )
    return query, key, value


def _add_block_keys(out, lse, q, k, v, bp: _BlockPlan, scale: float, softcap) -> Tensor:
    """Merge each block query's attention over its block's later keys into ``out``."""
    extra: dict[str, Any] = {} if softcap is None else {"softcap": softcap}
    out2, lse2 = attention_block(
        q.index_select(0, bp.q_index), k.index_select(0, bp.k_index), v.index_select(0, bp.k_index),
        bp.cu_q, bp.cu_k, bp.max_q, bp.max_k, softmax_scale=scale, causal=True, q_runs=bp.q_runs,
        k_runs=bp.k_runs, out_dtype=torch.float32, **extra,
    )  # fmt: skip
    merged, _ = merge_attention_states(out.index_select(0, bp.q_index), lse[:, bp.q_index], out2, lse2)
    return out.index_copy(0, bp.q_index, merged.to(out.dtype))


def register_attention() -> str:
    """Register ``"mmbalance_varlen"`` with transformers' ``AttentionInterface`` and its mask
    function (:func:`varlen_mask`) with ``AttentionMaskInterface``; returns the name. Idempotent.

    Select it with ``attn_implementation="mmbalance_varlen"`` (``from_pretrained``,
    ``from_config``) or ``model.set_attn_implementation("mmbalance_varlen")``. For packed batches
    pass ``position_ids`` that restart at every sequence (any batch size) or ``cu_seq_lens_q/k``,
    and ``use_cache=False`` when training.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, varlen_mask)
    return ATTENTION_NAME
