"""Ring attention: context parallelism of any degree over packed varlen sequences.

Each of the ``d`` ranks of a CP group holds a shard of every sequence (``cp_shard``; layouts in
``collectives/ring/plan.py``) for q, k and v. In ``d`` steps the key/value shards travel around the
ring (rank ``r`` sends to ``r + 1``, receives from ``r - 1``); at step ``i`` rank ``r`` attends its
queries to the keys of rank ``r - i`` with one block op (``torch.ops.mmbalance.attention_block_fwd``,
causal masks from absolute positions, so any shard pair is one launch) and merges the partial
``(out, lse)`` into a running float32 result (``merge_attention_states``). The exchange for step
``i + 1`` is posted (``batch_isend_irecv``) before step ``i``'s block runs and waited after it, so
communication overlaps computation. Steps whose keys no query can see (later shards under a causal
mask, contiguous layout; shards a sliding window cannot reach) are skipped; steps whose keys every
query sees run without a mask.

The block ops' features run in the ring as on whole sequences: a sliding window (in positions, so
a shard's two zigzag runs are windowed by where they sit in their sequence), logit softcapping, and
attention sinks, which join the softmax denominator once per query (in the first block a rank
computes, which covers all its queries; every later block merges into that state) and get their
gradient from the merged output (``sinks_backward``).

Backward recomputes each block from the merged ``lse`` (``attention_block_bwd``) and circulates
float32 ``dk``/``dv`` accumulators with the key/value shards: at step ``i`` rank ``r`` adds its
share of the gradient of rank ``r - i``'s keys to the accumulator that arrived during the step's
computation and passes it on; after ``d`` steps every accumulator is home. ``dq`` stays local.
Gradients equal those of attention over the unsharded batch (up to rounding).

Works on gloo (CPU tensors; blocks run the torch reference or, under ``TRITON_INTERPRET=1``, the
Triton kernels) and NCCL (CUDA; Triton or flash-attn blocks). Every rank of the group must call with
the same ``cu_seqlens``, layout, causal flag and dtypes, as for any collective.

Where the idea comes from: ring attention (Liu et al., 2023; Brandon et al., 2023) as used by DHP
(DHP sections 3.2 and 4.1) for CP groups of any integer size; the zigzag layout balances causal
work (as in Megatron-LM's context parallelism and ring-flash-attn); merging in float32 avoids the
repeated bf16 rounding of the running output of existing ring implementations.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from mmbalance.pyops.attention_checks import check_features, check_host_features
from mmbalance.pyops.attention_ops import (
    attention_block,
    attention_block_backward,
    merge_attention_states,
    sinks_backward,
)

from ..agreement import Entry
from ..group import world_of
from ..inflight import Inflight, run
from .plan import LAYOUTS, RingPlan, ring_plan

__all__ = ["cp_shard", "cp_unshard", "make_ring", "ring_attention", "ring_backward", "ring_forward"]

_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 11, 12, 13, 14


def _group_rank_size(group, rank: int | None = None, degree: int | None = None) -> tuple[int, int]:
    if rank is not None or degree is not None:
        if rank is None or degree is None:
            raise ValueError("rank and degree must be given together")
        if not 0 <= rank < degree:
            raise ValueError(f"rank must be in [0, degree={degree}), got {rank}")
        return rank, degree
    return world_of(group)


# ---------------------------------------------------------------------------------- shard, unshard
def cp_shard(x: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag", *, rank=None, degree=None):
    """This CP rank's tokens of the packed tensor ``x`` ``[T, *]`` (all ranks hold the same ``x``).

    ``cu_seqlens``: global boundaries (int tensor on any device, numpy or list; ``cu[-1] = T``).
    ``layout``: ``"zigzag"`` or ``"contiguous"`` (``collectives/ring/plan.py``). ``rank``/``degree``
    replace ``group`` when given (no process group needed). Returns ``[T_r, *]`` in the rank's
    sequence-major order; differentiable (an index_select). Needs no communication.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    r, d = _group_rank_size(group, rank, degree)
    plan = ring_plan(cu_seqlens, d, layout)
    if x.dim() < 1 or x.shape[0] != int(plan.lengths.sum()):
        raise ValueError(
            f"x has {x.shape[0] if x.dim() else 0} tokens but cu_seqlens describes {int(plan.lengths.sum())}"
        )
    return x.index_select(0, torch.from_numpy(plan.global_index(r)).to(x.device))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, plan: RingPlan, rank: int, group):
        ctx.plan, ctx.rank = plan, rank
        max_tokens = max(plan.tokens)
        buf = x_local.new_zeros((max_tokens, *x_local.shape[1:]))
        buf[: x_local.shape[0]] = x_local
        gathered = [torch.empty_like(buf) for _ in range(plan.degree)]
        run(dist.all_gather, gathered, buf, group=group)
        cat = torch.cat([g[:n] for g, n in zip(gathered, plan.tokens)])
        return cat.index_select(0, torch.from_numpy(plan.unshard_index).to(x_local.device))

    @staticmethod
    def backward(ctx, grad):
        index = torch.from_numpy(ctx.plan.global_index(ctx.rank)).to(grad.device)
        return grad.index_select(0, index), None, None, None


def cp_unshard(x_local: torch.Tensor, cu_seqlens, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Gather every rank's shard back into the full packed tensor ``[T, *]`` on every rank.

    The inverse of ``cp_shard`` (one all-gather of the largest shard size; uneven shards are
    padded for the transfer only). Backward treats the result as replicated: the gradient of
    ``x_local`` is this rank's rows of the incoming gradient, so every rank must use the gathered
    tensor identically (e.g. the same loss). Raises ValueError when ``x_local`` does not hold this
    rank's shard size.
    """
    if not isinstance(x_local, torch.Tensor):
        raise TypeError(f"x_local must be a torch.Tensor, got {type(x_local).__name__}")
    r, d = _group_rank_size(group)
    with Entry("cp_unshard", group) as e:
        e.like = x_local
        plan = ring_plan(cu_seqlens, d, layout)
        if x_local.dim() < 1 or x_local.shape[0] != plan.tokens[r]:
            raise ValueError(
                f"x_local has {x_local.shape[0] if x_local.dim() else 0} tokens; rank {r}'s shard has "
                f"{plan.tokens[r]}"
            )
        e.fields = {
            "cu_seqlens": _lengths_key(plan.lengths),
            "layout": layout,
            "x_local": (x_local.dtype, tuple(x_local.shape[1:])),
        }
    e.agree()
    return _Unshard.apply(x_local, plan, r, group)


# -------------------------------------------------------------------------------------- the ring
@dataclasses.dataclass(eq=False)
class _Ring:
    """Everything a ring pass needs besides the tensors: plan, ranks, device-side boundaries."""

    plan: RingPlan
    rank: int
    group: dist.ProcessGroup | None
    causal: bool
    softmax_scale: float
    backend: str
    cu: torch.Tensor  # [d, B + 1] int32: local cu_seqlens of every rank
    runs: torch.Tensor  # [d, B, 3] int32: position runs of every rank
    next_peer: int = 0
    prev_peer: int = 0
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0

    @property
    def degree(self) -> int:
        return self.plan.degree

    def source(self, step: int) -> int:
        """The rank whose keys/values this rank holds at ``step``."""
        return (self.rank - step) % self.degree

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def mask(self, src: int) -> str:
        if not (self.causal or self.windowed):
            return "full"
        return self.plan.visibility(
            self.rank, src, causal=self.causal, window_left=self.window_left, window_right=self.window_right
        )

    def block_args(self, src: int, mask: str) -> dict:
        masked = mask == "partial"
        window = dict(window_left=self.window_left, window_right=self.window_right) if masked else {}
        return dict(
            cu_seqlens_q=self.cu[self.rank], cu_seqlens_k=self.cu[src],
            max_seqlen_q=self.plan.max_seqlen[self.rank], max_seqlen_k=self.plan.max_seqlen[src],
            softmax_scale=self.softmax_scale, causal=self.causal and masked,
            q_runs=self.runs[self.rank] if masked else None, k_runs=self.runs[src] if masked else None,
            backend=self.backend, softcap=self.softcap, **window,
        )  # fmt: skip

    def exchange(
        self, send: list[torch.Tensor], recv: list[torch.Tensor], tags: tuple[int, ...], size_send, size_recv
    ):
        """Post sends to the next rank and receives from the previous one; returns the requests
        (an :class:`~mmbalance.collectives.inflight.Inflight`, or ``[]`` when nothing moves).

        Empty shards are neither sent nor received (both sides know the sizes from the plan).
        """
        if not (size_send or size_recv):
            return []
        flight = Inflight()
        ops = []
        if size_send:
            ops += [
                dist.P2POp(dist.isend, flight.alias(t), self.next_peer, self.group, tag)
                for t, tag in zip(send, tags)
            ]
        if size_recv:
            ops += [
                dist.P2POp(dist.irecv, flight.alias(t), self.prev_peer, self.group, tag)
                for t, tag in zip(recv, tags)
            ]
        flight.add(dist.batch_isend_irecv(ops))
        del ops  # the P2POps hold the aliases too
        return flight


def _wait(reqs) -> None:
    if reqs:
        reqs.wait()


def ring_forward(ring: _Ring, q, k, v, *, compute: bool = True, communicate: bool = True, kv_blocks=None,
                 stats: dict | None = None, sinks=None):  # fmt: skip
    """The forward ring loop; returns the merged float32 ``(out, lse)`` (``sinks`` included).

    ``compute=False`` only circulates k/v and ``communicate=False`` only computes, on the shards
    given in ``kv_blocks[src] = (k, v)``: the benchmark times the two parts apart to report how
    much communication the full loop hides. ``stats["wait_s"]`` accumulates the time spent
    waiting for transfers (exposed communication; on GPUs it includes the device sync).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc, device=q.device)
    tokens = ring.plan.tokens
    k_cur, v_cur = k.contiguous(), v.contiguous()
    first = True
    for step in range(ring.degree):
        src = ring.source(step)
        reqs = []
        if communicate and step + 1 < ring.degree:
            nxt = ring.source(step + 1)
            k_next = k.new_empty((tokens[nxt], *k.shape[1:]))
            v_next = v.new_empty((tokens[nxt], *v.shape[1:]))
            reqs = ring.exchange([k_cur, v_cur], [k_next, v_next], (_TAG_K, _TAG_V), tokens[src], tokens[nxt])
        mask = ring.mask(src)
        if compute and mask != "none" and tokens[ring.rank] and tokens[src]:
            kb, vb = (k_cur, v_cur) if communicate else kv_blocks[src]
            # the first block covers every query of this rank: the sinks join each row once there
            extra = {"sinks": sinks} if first and sinks is not None else {}
            block_out, block_lse = attention_block(
                q, kb, vb, **ring.block_args(src, mask), out_dtype=acc, **extra
            )
            if first:
                out, lse, first = block_out, block_lse, False
            else:
                out, lse = merge_attention_states(out, lse, block_out, block_lse)
        if stats is None:
            _wait(reqs)
        else:
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
            t0 = time.perf_counter()
            _wait(reqs)
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
            stats["wait_s"] = stats.get("wait_s", 0.0) + time.perf_counter() - t0
        if communicate and step + 1 < ring.degree:
            k_cur, v_cur = k_next, v_next
    if first and compute and sinks is not None:  # no block ran: no key reached any query here
        out, lse = _sinks_only(q, lse, sinks)
    return out, lse


def ring_backward(ring: _Ring, dout, q, k, v, out, lse, dlse=None):
    """The backward ring loop; returns float32 ``(dq, dk, dv)`` for this rank's shards."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tokens, d, r = ring.plan.tokens, ring.degree, ring.rank
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_acc = dv_acc = None
    dkdv_reqs: list = []
    dk_in = dv_in = None
    for step in range(d):
        src = ring.source(step)
        kv_reqs = []
        if step + 1 < d:
            nxt = ring.source(step + 1)
            k_next = k.new_empty((tokens[nxt], *k.shape[1:]))
            v_next = v.new_empty((tokens[nxt], *v.shape[1:]))
            kv_reqs = ring.exchange(
                [k_cur, v_cur], [k_next, v_next], (_TAG_K, _TAG_V), tokens[src], tokens[nxt]
            )
        mask = ring.mask(src)
        dk_s = dv_s = None
        if mask != "none" and tokens[r] and tokens[src]:
            dq_s, dk_s, dv_s = attention_block_backward(
                dout, q, k_cur, v_cur, out, lse, **ring.block_args(src, mask), dlse=dlse
            )
            dq += dq_s
        # the accumulator for src's keys arrived from the previous rank during this step's compute
        _wait(dkdv_reqs)
        if step == 0 or dk_in is None or dv_in is None:
            dk_acc = torch.zeros((tokens[src], *k.shape[1:]), dtype=acc, device=k.device)
            dv_acc = torch.zeros_like(dk_acc)
        else:
            dk_acc, dv_acc = dk_in, dv_in
        if dk_s is not None and dv_s is not None:
            dk_acc += dk_s
            dv_acc += dv_s
        if d > 1:
            # after the last step the accumulator travels once more: to the rank that owns the keys
            home = ring.source(step + 1)
            dk_in = dk_acc.new_empty((tokens[home], *k.shape[1:]))
            dv_in = torch.empty_like(dk_in)
            dkdv_reqs = ring.exchange(
                [dk_acc, dv_acc], [dk_in, dv_in], (_TAG_DK, _TAG_DV), tokens[src], tokens[home]
            )
        _wait(kv_reqs)
        if step + 1 < d:
            k_cur, v_cur = k_next, v_next
    _wait(dkdv_reqs)
    if d > 1:
        dk_acc, dv_acc = dk_in, dv_in
    return dq, dk_acc, dv_acc


def _sinks_only(q, lse, sinks):
    """``(out, lse)`` of queries that saw no key: ``out = 0``, ``lse = sinks[h]``."""
    acc = lse.dtype
    return torch.zeros(q.shape, dtype=acc, device=q.device), sinks.to(acc)[:, None].expand_as(
        lse
    ).contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, anchor, ring: _Ring):
        sinks = sinks if sinks.numel() else None
        out32, lse = ring_forward(ring, q, k, v, sinks=sinks)
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # Runs on every rank whenever any rank needs a gradient (the anchor makes every rank's
        # output require grad then), so the ring's backward exchanges always pair up.
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        dout = dout.to(q.dtype).contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        dq, dk, dv = ring_backward(ctx.ring, dout, q, k, v, out, lse, dlse)
        need = ctx.needs_input_grad
        d_sinks = None
        if sinks is not None and need[3]:
            d_sinks = sinks_backward(sinks, out, lse, dout, dlse)
        return (dq.to(q.dtype) if need[0] else None, dk.to(k.dtype) if need[1] else None,
                dv.to(v.dtype) if need[2] else None, d_sinks, None, None)  # fmt: skip


def make_ring(
    q,
    k,
    v,
    cu_seqlens,
    *,
    causal,
    softmax_scale,
    group,
    layout,
    backend,
    rank=None,
    degree=None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> _Ring:
    """Validate the ring inputs and build the per-call state (shared with the benchmark).

    ``rank``/``degree`` replace ``group`` for a ring emulated in one process (``ring_forward``
    with ``communicate=False``).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if q.shape[2] == 0:
        raise ValueError(f"q, k and v must have a head dim >= 1, got q {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must be [T_local, Hkv, D] matching q's tokens and head dim; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    softcap = check_host_features(window_left, window_right, softcap)
    emulated = rank is not None
    rank, degree = _group_rank_size(group, rank, degree)
    plan = ring_plan(cu_seqlens, degree, layout)
    if q.shape[0] != plan.tokens[rank]:
        raise ValueError(
            f"q has {q.shape[0]} tokens but rank {rank}'s {layout} shard of cu_seqlens has {plan.tokens[rank]} "
            "(shard q/k/v with cp_shard using the same cu_seqlens, group and layout)"
        )
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    cu = torch.from_numpy(np.stack([plan.local_cu_seqlens(s) for s in range(degree)])).to(q.device)
    runs = torch.from_numpy(np.ascontiguousarray(plan.runs)).to(q.device)
    ring = _Ring(plan, rank, group, bool(causal), float(softmax_scale), backend, cu, runs,
                 window_left=int(window_left), window_right=int(window_right), softcap=softcap)  # fmt: skip
    if degree > 1 and not emulated:
        ring.next_peer = (
            dist.get_global_rank(group, (rank + 1) % degree) if group is not None else (rank + 1) % degree
        )
        ring.prev_peer = (
            dist.get_global_rank(group, (rank - 1) % degree) if group is not None else (rank - 1) % degree
        )
    return ring


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group=None,
    layout: str = "zigzag",
    backend: str = "auto",
    return_lse: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Attention over sequences sharded across the CP group ``group`` (ring attention).

    Args:
        q: ``[T_r, H, D]``, this rank's shard (``cp_shard``) of the packed queries.
        k, v: ``[T_r, Hkv, D]`` shards of keys/values (``H % Hkv == 0``, GQA).
        cu_seqlens: boundaries of the *global* batch (int tensor on any device, numpy or list; a
            CUDA tensor is copied to the host once per call).
        causal: causal mask in global positions (query ``i`` of a sequence sees keys ``j <= i``).
        softmax_scale: default ``D ** -0.5``.
        group: the CP process group (default: the world); any size, uneven shards allowed.
        layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"``; as used by ``cp_shard``.
        backend: block-op backend (``pyops/attention_ops.py``): ``"auto"``, ``"flash_attn"``,
            ``"torch_flash"``, ``"triton"`` or ``"reference"``.
        return_lse: also return the LSE ``[H, T_r]`` float32 (differentiable).
        window_left, window_right: a sliding window in global positions (the block ops' semantics:
            key ``j`` allowed for query ``i`` only if ``pos_i - window_left <= pos_j <= pos_i +
            window_right``, on top of ``causal``; ``-1``: unbounded). Key shards no window
            reaches are skipped (no block call; on the kernels, no key tile outside it either).
        softcap: logit softcapping (``softcap * tanh(scale * <q, k> / softcap)``; ``0``: off).
        sinks: per-head sink logits ``[H]`` (float, on q's device): each query's softmax
            denominator includes ``exp(sinks[h])`` once (gpt-oss); rows without keys then get
            ``lse = sinks[h]``. Differentiable.

    Returns:
        ``out [T_r, H, D]`` in q's dtype, the rank's shard of attention over the full sequences
        (merged in float32, rounded once); rows that see no key are 0. With ``return_lse``,
        ``(out, lse)``. Differentiable in ``q``, ``k``, ``v`` (and ``sinks``).

    Raises ValueError/TypeError naming the argument for bad shapes, layout or a shard size that
    does not match ``cu_seqlens``. Every rank of the group must make the same call.
    """
    ring = None
    with Entry("ring_attention", group) as e:
        e.values = [0, 0]
        e.like = q if isinstance(q, torch.Tensor) else None
        ring = make_ring(q, k, v, cu_seqlens, causal=causal, softmax_scale=softmax_scale, group=group,
                         layout=layout, backend=backend, window_left=window_left, window_right=window_right,
                         softcap=softcap)  # fmt: skip
        check_features(q, window_left, window_right, softcap, sinks)
        e.fields = {
            "cu_seqlens": _lengths_key(ring.plan.lengths),
            "causal": ring.causal,
            "layout": layout,
            "softmax_scale": ring.softmax_scale,
            "q": (q.dtype, tuple(q.shape[1:])),
            "k": (k.dtype, tuple(k.shape[1:])),
            "v": (v.dtype, tuple(v.shape[1:])),
            "backend": backend,
            "device": q.device.type,
            "window": (ring.window_left, ring.window_right),
            "softcap": ring.softcap,
            "sinks": None if sinks is None else sinks.dtype,
        }
        e.values = [
            sum(1 << j for j, t in enumerate((q, k, v, sinks)) if t is not None and t.requires_grad),
            int(torch.is_grad_enabled()),
        ]
    needed = e.grad_bits(e.agree(), 0)
    anchor = torch.empty(0, device=q.device, requires_grad=bool(needed))
    sinks_in = sinks if sinks is not None else torch.empty(0, device=q.device)
    out, lse = _RingAttention.apply(q, k, v, sinks_in, anchor, ring)
    return (out, lse) if return_lse else out


def _lengths_key(lengths) -> str:
    import hashlib

    return hashlib.blake2b(np.ascontiguousarray(lengths, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
