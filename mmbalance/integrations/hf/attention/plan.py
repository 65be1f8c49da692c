"""How ``mmbalance_varlen`` turns one attention call into op calls (``backend.py`` runs them).

A call's sequences (:class:`VarlenMask` from our mask function, or what flash-attention reads from
a call without it: a 2-D padding mask, ``position_ids`` that restart, ``cu_seq_lens_q/k``) become a
:class:`CallPlan`: the key rows to gather, the boundaries, one causal offset or per-sequence
position runs, the window the op needs, and for bidirectional image blocks a second call
(:class:`BlockPlan`). Plans are made on the host, once per forward (the mask function plans every
layer's usual call ahead, :func:`plan_mask`; calls without our mask are cached by their tensors),
and outside ``torch.compile``'s graph (``compile.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mmbalance.pyops.varlen import cu_seqlens_from_lengths

from .compile import PlanCache, outside_graph
from .mask import ATTENTION_NAME, VarlenMask, dense_mask_runs, mask_allowed, set_planner

__all__ = [
    "BlockPlan", "CallPlan", "host_plan", "mask_from_keywords", "plan_mask", "plan_with_mask", "plan_without_mask",
    "refuse", "rows_plan", "shape_plan",
]  # fmt: skip


def refuse(what: str, exc=ValueError) -> Exception:
    return exc(f"{ATTENTION_NAME} does not implement {what}")


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
class CallPlan:
    k_index: Tensor | None
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    causal_offset: int
    q_runs: Tensor | None
    k_runs: Tensor | None
    window: tuple[int, int]
    blocks: BlockPlan | None = None


@dataclass
class BlockPlan:
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

    @classmethod
    def from_runs(cls, q_rows: list, k_rows: list, q_first: list, k_first: list, device) -> BlockPlan | None:
        """The plan of query runs ``q_rows[i]`` (row indices, in reversed order) against key runs
        ``k_rows[i]``, whose reversed positions start at ``q_first[i]`` and ``k_first[i]``; ``None``
        when there is no run."""
        if not q_rows:
            return None
        nq, nk = [len(r) for r in q_rows], [len(r) for r in k_rows]
        return cls(
            q_index=torch.from_numpy(np.concatenate(q_rows).astype(np.int64)).to(device),
            k_index=torch.from_numpy(np.concatenate(k_rows).astype(np.int64)).to(device),
            cu_q=cu_seqlens_from_lengths(np.array(nq), device=device),
            cu_k=cu_seqlens_from_lengths(np.array(nk), device=device),
            max_q=max(nq),
            max_k=max(nk),
            q_runs=torch.tensor(
                [(a, n, a + n) for a, n in zip(q_first, nq)], dtype=torch.int32, device=device
            ),
            k_runs=torch.tensor(
                [(a, n, a + n) for a, n in zip(k_first, nk)], dtype=torch.int32, device=device
            ),
        )


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
            raise refuse(
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


def _build_plan(seqs: list[_Seq], n_q: int, n_k: int, causal: bool, window, device) -> CallPlan:
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
    return CallPlan(
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


def _block_plan(spec: VarlenMask, b: int, lq: int, lk: int, device) -> BlockPlan | None:
    """Queries of a block (``blocks[b, i] = id >= 0``, contiguous) see the block's later keys on
    top of their causal ones. In reversed order, query ``qa`` of block ``[a, e)`` sits at
    ``e - 1 - qa`` and key ``ka`` at ``e - ka``: causal there means ``ka > qa``, exactly the keys
    the causal call left out."""
    assert spec.blocks is not None
    ids = spec.blocks.detach().cpu().numpy()
    valid = None
    if spec.padding is not None:
        valid = spec.padding.detach().to("cpu", torch.bool).numpy()
    q_rows: list = []
    k_rows: list = []
    qr: list = []
    kr: list = []
    for r in range(b):
        row = ids[r if ids.shape[0] > 1 else 0]
        for block in np.unique(row[row >= 0]).tolist():
            at = np.flatnonzero(row == block)
            if valid is not None:  # padding is no key of a block (PaliGemma marks it 0, as its prefix)
                keep = np.zeros(at.size, dtype=bool)
                inside = at < valid.shape[1]
                keep[inside] = valid[r, at[inside]]
                at = at[keep]
                if not at.size:
                    continue
            a, e = int(at[0]), int(at[-1]) + 1
            if at.size != e - a:
                raise refuse(f"bidirectional blocks that are not contiguous (block {block} of row {r})")
            qlo, qhi = max(a, spec.q_offset), min(e, spec.q_offset + lq)
            klo, khi = max(a, spec.kv_offset), min(e, spec.kv_offset + lk)
            if valid is not None:
                ok = np.zeros(khi - klo, dtype=bool) if khi > klo else np.zeros(0, dtype=bool)
                upto = min(khi, valid.shape[1])
                if upto > klo:
                    ok[: upto - klo] = valid[r, klo:upto]
                runs = _true_runs(ok)
                if len(runs) > 1:
                    raise refuse(f"padding inside a bidirectional block (block {block} of row {r})")
                klo, khi = (klo + runs[0][0], klo + runs[0][1]) if runs else (klo, klo)
            if qhi <= qlo or khi <= klo or khi - 1 <= qlo:
                continue  # no query of the block has a later key
            q_rows.append(r * lq + np.arange(qhi - 1, qlo - 1, -1) - spec.q_offset)
            k_rows.append(r * lk + np.arange(khi - 1, klo - 1, -1) - spec.kv_offset)
            qr.append(e - qhi)
            kr.append(e - khi + 1)
    return BlockPlan.from_runs(q_rows, k_rows, qr, kr, device)


def host_plan(
    spec: VarlenMask, b: int, lq: int, lk: int, cu: tuple[Tensor, Tensor] | None, device
) -> CallPlan:
    if spec.blocks is not None and (cu is not None or spec.chunk is not None):
        raise refuse("bidirectional blocks together with cu_seq_lens or chunked attention")
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
    query and key lengths), as the mask function does inside ``torch.compile``. A mask this
    backend cannot run is left unplanned: the layer's call plans it and raises there, and a call
    that does not use the plan (a context-parallel shard's: its own layout, ``cp/``) is not
    refused for it."""
    key = (spec.q_length, spec.kv_length, spec.batch_size, device)
    if key not in spec.plans:
        try:
            spec.plans[key] = host_plan(spec, spec.batch_size, spec.q_length, spec.kv_length, None, device)
        except ValueError:
            return


@outside_graph(ATTENTION_NAME, "its planning of a call")
def plan_with_mask(spec: VarlenMask, b, lq, lk, cu, device, position_ids) -> CallPlan:
    """A call with our mask but no plan for it yet: explicit ``cu_seq_lens``, ``position_ids`` of
    packed rows for a mask built without them, or a shape the mask function did not plan for."""
    if cu is not None:
        # every layer of a forward gets the same cu_seq_lens tensors
        ckey = ("cu", lq, lk, b, device, id(cu[0]), id(cu[1]))
        hit = spec.plans.get(ckey)
        if hit is None or hit[0] is not cu[0] or hit[1] is not cu[1]:
            hit = spec.plans[ckey] = (cu[0], cu[1], host_plan(spec, b, lq, lk, cu, device))
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
            hit = spec.plans[pkey] = (position_ids, host_plan(packed, b, lq, lk, None, device))
        return hit[1]
    key = (lq, lk, b, device)
    if key not in spec.plans:
        spec.plans[key] = host_plan(spec, b, lq, lk, None, device)
    return spec.plans[key]


def shape_plan(b: int, lq: int, lk: int, causal: bool, window) -> tuple[int, int] | None:
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


def rows_plan(b: int, lq: int, lk: int, window: tuple[int, int], device) -> CallPlan:
    """``host_plan`` of a shape-only call, in tensor ops Dynamo traces (no host data)."""
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device) * lq
    cu_k = cu_q if lq == lk else torch.arange(b + 1, dtype=torch.int32, device=device) * lk
    return CallPlan(k_index=None, cu_q=cu_q, cu_k=cu_k, max_q=lq, max_k=lk, causal_offset=lk - lq,
                 q_runs=None, k_runs=None, window=window)  # fmt: skip


# calls without our mask (cross-attention, vision towers' cu_seq_lens, masks from outside): every
# layer of a forward brings the same tensors, so the first layer plans for all
_KEYWORD_PLANS = PlanCache()


@outside_graph(ATTENTION_NAME, "its planning of a call")
def plan_without_mask(
    attention_mask, b, lq, lk, causal, window, cu, position_ids, device
) -> tuple[CallPlan, bool]:
    """The plan (and the op's causal flag) of a call whose mask is a 2-D or 4-D tensor or None."""

    def make() -> tuple[CallPlan, bool]:
        if attention_mask is not None and attention_mask.dim() == 4 and cu is not None:
            if not _repeats_sequences(attention_mask, cu, b, lq, lk, causal):
                raise ValueError(
                    f"{ATTENTION_NAME}: cu_seq_lens_q/k together with a 4-D attention mask that says something "
                    "else than those sequences; give one of them"
                )
            return host_plan(
                mask_from_keywords(None, b, lq, lk, causal, window, None), b, lq, lk, cu, device
            ), causal
        if attention_mask is not None and attention_mask.dim() == 4:
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
        spec = mask_from_keywords(
            attention_mask, b, lq, lk, causal, window, None if cu is not None else position_ids
        )
        return host_plan(spec, b, lq, lk, cu, device), causal

    tensors = (attention_mask, *(cu if cu is not None else (None, None)), position_ids)
    return _KEYWORD_PLANS.get_or_plan(tensors, (b, lq, lk, causal, window, device), make)


def _repeats_sequences(
    mask: Tensor, cu: tuple[Tensor, Tensor], b: int, lq: int, lk: int, causal: bool
) -> bool:
    """Whether a 4-D mask given beside ``cu_seq_lens_q/k`` allows exactly what those sequences do
    (transformers' Qwen2.5-Omni audio tower before 5.9 gives both: a block-diagonal mask, and the
    boundaries for flash-attention)."""
    cu_q, cu_k = (t.detach().cpu().numpy().astype(np.int64) for t in cu)
    if b != 1 or lq != lk or not np.array_equal(cu_q, cu_k) or cu_q[0] != 0 or cu_q[-1] != lq:
        return False
    seg = np.repeat(np.arange(cu_q.size - 1), np.diff(cu_q))
    want = seg[:, None] == seg[None, :]
    if causal:
        want &= np.tri(lq, dtype=bool)
    return bool(np.array_equal(np.broadcast_to(mask_allowed(mask, b, lq, lk)[0], want.shape), want))


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


def mask_from_keywords(
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


# the mask function plans with this module's planner (mask.py imports nothing from here)
set_planner(plan_mask)
