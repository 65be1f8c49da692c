"""All-to-all batch communicator (OrchMLLM section 5.2.1): move examples between ranks by a plan.

Only lengths are all-gathered (:func:`gather_lengths`); every rank computes the same
:class:`~mmbalance.balancing.Plan`; :func:`rebalance` then moves the varlen payloads with one
``all_to_all_single``: every payload, whatever its dtype, travels as raw bytes in the columns of
one buffer. The send buffer is one ``segment_gather`` of the local examples in destination order,
all split sizes come from the plan on the host (no device sync), and the receive buffer is already
in destination-slot order for plans made by ``post_balance`` (otherwise one more
``segment_gather`` puts it there). ``rebalance`` is differentiable: backward moves the gradients
back along the inverse plan.

Safety: every call starts with the agreement step (``collectives/agreement.py``): one 64-byte
all-gather of every rank's plan hash, payload dtypes and trailing shapes, flags, and whether its
inputs fit the plan (example and token counts, and per-example lengths where that needs no device
sync). Any disagreement raises the same error on every rank before data moves, instead of
corrupting data or deadlocking in the all-to-all. The process group's timeout bounds every wait.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import Plan
from mmbalance.balancing.plan import Route
from mmbalance.balancing.validate import as_lengths
from mmbalance.pyops import cu_seqlens_from_lengths, segment_gather
from mmbalance.pyops.checks import value_checks_enabled

from ..agreement import Entry
from ..group import comm_device, world_of
from ..inflight import run

__all__ = ["gather_lengths", "gather_table", "rebalance", "verify_plan"]


def _as_table(local_lengths, name: str) -> tuple[np.ndarray, bool]:
    """``local_lengths`` as an int64 ``[n, k]`` matrix, and whether it came in as 2-D."""
    if isinstance(local_lengths, Tensor):
        local_lengths = local_lengths.detach().cpu().numpy()
    try:
        arr = np.asarray(local_lengths)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a sequence of non-negative integers") from exc
    if arr.ndim == 2:
        cols = [as_lengths(arr[:, j], f"{name}[:, {j}]") for j in range(arr.shape[1])]
        mat = np.stack(cols, axis=1) if cols else np.zeros((arr.shape[0], 0), dtype=np.int64)
        return mat, True
    if arr.ndim == 1 or arr.size == 0:
        return as_lengths(arr.reshape(-1), name)[:, None], False
    raise ValueError(f"{name} must be 1-D or 2-D, got shape {arr.shape}")


def gather_table(
    mat: np.ndarray | None,
    group=None,
    *,
    entry: str | Entry = "gather_lengths",
    problems: list[str] | None = None,
    local_error: BaseException | None = None,
    fields: dict[str, object] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All-gather an int64 ``[n_r, k]`` table per rank: ``(table [n, k], src_ranks [n])``,
    rank-major, identical on every rank (what :func:`gather_lengths` and the orchestrator build on).

    ``entry`` names the calling entry point, or is its :class:`~.agreement.Entry` with the
    fields and problems of its own validation; ``mat=None`` when this rank's input failed it.
    One agreement (row counts, the column count, which must match, and every rank's problems)
    comes first, so a bad table on any rank raises on every rank before anything is gathered.
    """
    e = entry if isinstance(entry, Entry) else Entry(entry, group)
    if not isinstance(entry, Entry):
        e.problems += list(problems or [])
        e.error = local_error
        e.fields.update(fields or {})
    rank, world = world_of(group)
    dev = comm_device(group)
    k = mat.shape[1] if mat is not None else -1
    count = mat.shape[0] if mat is not None else 0
    e.fields = {"columns": k, **e.fields}
    e.values = [count]
    agreed = e.agree()
    counts = np.asarray(agreed.column(0), dtype=np.int64)
    width = int(counts.max()) if world else 0
    buf = torch.zeros((max(width, 1), max(k, 1)), dtype=torch.int64, device=dev)
    if count and k:
        buf[:count, :k] = torch.from_numpy(mat).to(dev)
    bufs = torch.empty(world * buf.numel(), dtype=torch.int64, device=dev)
    run(dist.all_gather_single, bufs, buf.reshape(-1), group=group)
    gathered = bufs.cpu().numpy().reshape(world, *buf.shape)
    parts = [gathered[r, : int(c), :k] for r, c in enumerate(counts)]
    table = np.concatenate(parts, axis=0) if parts else np.zeros((0, k), dtype=np.int64)
    src = np.repeat(np.arange(world, dtype=np.int64), counts)
    return np.ascontiguousarray(table), src


def gather_lengths(local_lengths, group=None) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every rank's per-example lengths (a few KB; no payload moves).

    Args:
        local_lengths: ``[n_r]`` or ``[n_r, k]`` non-negative integers (a sequence, numpy array or
            tensor): this rank's examples in sampling order; ``k`` columns for several modalities.
        group: process group (default: the world).

    Returns:
        ``(lengths, src_ranks)``: int64 numpy arrays ``[n]`` (or ``[n, k]``) and ``[n]``, rank-major
        (rank 0's examples first, each rank's in its own order): exactly what ``post_balance``
        takes, identical on every rank.

    Raises:
        RankMismatchError on every rank (``ValueError``/``TypeError`` on the rank at fault) when
        some rank's lengths are invalid or ranks pass different column counts; the lengths are
        checked inside the exchange, so no rank is left waiting.
    """
    world_of(group)
    mat, two_d = None, False
    with Entry("gather_lengths", group) as e:
        mat, two_d = _as_table(local_lengths, "local_lengths")
    lengths, src = gather_table(mat, group, entry=e)
    if not two_d:
        lengths = np.ascontiguousarray(lengths[:, 0]) if lengths.shape[1] else lengths.reshape(-1)
    return lengths, src


def _local_problems(tensors: list[Tensor], cu_seqlens: Tensor, route: Route, check: bool) -> list[str]:
    """What is wrong with this rank's inputs for this route (host-side checks, plus the per-example
    lengths when ``check`` and they need no device sync)."""
    problems = []
    n = route.in_lengths.size
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != n + 1:
        count = cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else f"shape {tuple(cu_seqlens.shape)}"
        problems.append(f"cu_seqlens describes {count} examples here, the plan {n}")
    for k, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] != route.in_tokens:
            problems.append(
                f"packed[{k}] has {t.shape[0] if t.dim() else 'no'} rows, the plan {route.in_tokens} tokens here"
            )
    if not problems and check and value_checks_enabled(cu_seqlens):
        got = (cu_seqlens[1:] - cu_seqlens[:-1]).cpu().numpy()
        if int(cu_seqlens[0]) != 0:
            problems.append(f"cu_seqlens[0] = {int(cu_seqlens[0])}, must be 0")
        elif not np.array_equal(got, route.in_lengths):
            bad = int(np.flatnonzero(got != route.in_lengths)[0])
            problems.append(
                f"cu_seqlens: example {bad} has length {got[bad]}, the plan {route.in_lengths[bad]}"
            )
    return problems


def verify_plan(plan: Plan, problems: list[str] | None = None, group=None) -> None:
    """Collective check that every rank holds the same plan and inputs that fit it.

    Raises the same :class:`~mmbalance.collectives.RankMismatchError` on every rank when plans
    differ (by hash) or some rank reported ``problems``; returns on every rank otherwise.
    """
    with Entry("verify_plan", group) as e:
        e.fields["plan"] = plan.key
        e.problems += list(problems or [])
    e.agree()


def _as_bytes(t: Tensor) -> Tensor:
    """``t`` ``[T, *]`` as its raw bytes ``[T, row_bytes]`` (a view when ``t`` is contiguous)."""
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) != flat.shape[1]):
        flat = flat.clone(memory_format=torch.contiguous_format)  # also size-0/1 dims with odd strides
    return flat.view(torch.uint8)


def _from_bytes(raw: Tensor, like: Tensor, rows: int) -> Tensor:
    """Rows of bytes back into ``like``'s dtype and trailing shape (a column slice of the receive
    buffer is copied first: its rows are strided and its offset need not be aligned)."""
    size = like.element_size()
    if raw.stride(-1) != 1 or raw.stride(0) != raw.shape[1] or raw.storage_offset() % size:
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(like.dtype).reshape(rows, *like.shape[1:])


def _exchange(tensors: list[Tensor | None], cu_seqlens: Tensor, route: Route, group) -> list[Tensor | None]:
    """Move every tensor by ``route`` with one all-to-all.

    Payloads travel as raw bytes: all of them side by side as the columns of one ``[T, row
    bytes]`` uint8 buffer, so labels, position ids and other small per-token tensors cost no
    extra collective, every dtype moves bit-exactly, and dtypes a backend cannot reduce (gloo
    and NCCL have no int16, for example) move like any other.
    """
    present = [(k, t) for k, t in enumerate(tensors) if t is not None]
    outs: list[Tensor | None] = [None] * len(tensors)
    if not present:
        return outs
    device = cu_seqlens.device
    raw = [_as_bytes(t) for _, t in present]
    widths = [r.shape[1] for r in raw]
    buf = raw[0] if len(raw) == 1 else torch.cat(raw, dim=1)
    order = torch.from_numpy(route.send_order).to(device)
    send = segment_gather(buf, cu_seqlens, order, route.in_tokens).contiguous()
    recv = torch.empty((route.out_tokens, send.shape[1]), dtype=torch.uint8, device=device)
    run(
        dist.all_to_all_single,
        recv,
        send,
        output_split_sizes=route.recv_tokens,
        input_split_sizes=route.send_tokens,
        group=group,
    )
    if route.recv_perm is not None:
        seq_lengths = np.empty_like(route.out_lengths)
        seq_lengths[route.recv_perm] = route.out_lengths
        perm = torch.from_numpy(route.recv_perm).to(device)
        recv = segment_gather(
            recv, cu_seqlens_from_lengths(seq_lengths, device=device), perm, route.out_tokens
        )
    parts = [recv] if len(raw) == 1 else torch.split(recv, widths, dim=1)
    for (k, t), part in zip(present, parts):
        outs[k] = _from_bytes(part, t, route.out_tokens)
    return outs


class _Rebalance(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, group, rank, grad_bits, cu_seqlens, anchor, *tensors):
        route = plan.route(rank)
        ctx.plan, ctx.group, ctx.rank, ctx.grad_bits = plan, group, rank, grad_bits
        ctx.cu_device = cu_seqlens.device
        outs = _exchange(list(tensors), cu_seqlens, route, group)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
        for o in outs:
            if not (o.is_floating_point() or o.is_complex()):
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # The backward all-to-all runs on every rank whenever any rank needs a gradient (the bits
        # are global), with a zero gradient for an output this rank's loss did not use: every rank
        # sends the same set of payloads, so the collective always matches.
        inverse = _inverse_of(ctx.plan)
        route = inverse.route(ctx.rank)
        fwd = ctx.plan.route(ctx.rank)
        cu_out = cu_seqlens_from_lengths(fwd.out_lengths, device=ctx.cu_device)
        send: list[Tensor | None] = []
        for k, (g, (shape, dtype, device)) in enumerate(zip(grads, ctx.out_meta)):
            if not (ctx.grad_bits >> k) & 1:
                send.append(None)
            elif g is None:
                send.append(torch.zeros(shape, dtype=dtype, device=device))
            else:
                send.append(g.contiguous())
        back = _exchange(send, cu_out, route, ctx.group)
        needs = ctx.needs_input_grad[6:]
        return (None,) * 6 + tuple(b if need else None for b, need in zip(back, needs))


_INVERSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _inverse_of(plan: Plan) -> Plan:
    if plan not in _INVERSES:
        _INVERSES[plan] = plan.inverse()
    return _INVERSES[plan]


def _payload_fields(tensors: list[Tensor]) -> dict[str, object]:
    return {f"packed[{k}]": (t.dtype, tuple(t.shape[1:])) for k, t in enumerate(tensors)}


def rebalance(
    packed: Tensor | list[Tensor] | tuple[Tensor, ...],
    cu_seqlens: Tensor,
    plan: Plan,
    group=None,
    *,
    check: bool = True,
):
    """Move this rank's examples to where ``plan`` sends them; receive the ones it sends here.

    Args:
        packed: ``[T, *]`` this rank's examples back to back in sampling order, or a list/tuple of
            such tensors sharing ``cu_seqlens`` (tokens, labels, position ids ...: one plan moves
            them all; any dtypes and trailing shapes). A rank with no examples passes empty
            tensors of the same dtypes and trailing shapes as the other ranks.
        cu_seqlens: ``[n_r + 1]`` int32/int64 boundaries of the local examples (on the payload's
            device); example lengths must equal ``plan.lengths`` (use ``plan.with_lengths`` for a
            payload of other lengths, e.g. encoder outputs).
        plan: a plan with a source layout, identical on every rank (``post_balance(...,
            src_ranks=...)`` on the all-gathered lengths).
        group: process group of ``plan.num_ranks`` ranks (default: the world).
        check: also compare every example's length in ``cu_seqlens`` with the plan (always on CPU
            tensors; on CUDA it needs a device sync, so only with ``MMBALANCE_DEBUG=1``).

    Every call first runs one small agreement collective (64 bytes per rank): every rank's plan
    hash, payload dtypes and trailing shapes, ``check`` flag, example and token counts, and which
    payloads need gradients. Any disagreement, or a bad input on any rank, raises
    :class:`~mmbalance.collectives.RankMismatchError` on every rank, naming the rank and the
    argument, before any data moves.

    Returns:
        ``(out, out_cu_seqlens)``: the examples the plan sends to this rank in ``dst_slot`` order
        (a list if ``packed`` was a list/tuple), and their int32 ``cu_seqlens``. Differentiable in
        every floating-point input: backward sends gradients back along the inverse plan.

    Backward is a collective too. When any rank's payload requires grad, every rank's outputs do
    (also on a rank whose own inputs do not), so the backward all-to-all runs on every rank that
    calls ``backward``; keep each rank's ``out`` in its loss even when the plan gave it nothing
    (an empty tensor is fine). A rank under ``torch.no_grad`` while others need gradients is
    refused on every rank.
    """
    rank, world = world_of(group)
    grad_bits = 0
    many = isinstance(packed, (list, tuple))
    tensors: list[Tensor] = list(packed) if isinstance(packed, (list, tuple)) else [packed]
    with Entry("rebalance", group) as e:
        if not tensors or not all(isinstance(t, Tensor) for t in tensors):
            raise TypeError("packed must be a tensor or a non-empty list of tensors")
        e.like = tensors[0]
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32 or int64 tensor")
        for k, t in enumerate(tensors):
            if t.device != cu_seqlens.device:
                raise ValueError(f"packed[{k}] is on {t.device} but cu_seqlens on {cu_seqlens.device}")
            if t.dim() < 1:
                raise ValueError(f"packed[{k}] must be at least 1-D ([tokens, ...]), got a 0-d tensor")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
        if plan.num_ranks != world:
            raise ValueError(f"plan is for {plan.num_ranks} ranks but the group has {world}")
        if plan.src_rank is None:
            raise ValueError("plan has no source layout: make it with post_balance(..., src_ranks=...)")
        route = plan.route(rank)
        e.fields = {"plan": plan.key, "check": bool(check), "payloads": len(tensors)}
        e.fields.update(_payload_fields(tensors))
        e.problems += _local_problems(tensors, cu_seqlens, route, check)
        for k, t in enumerate(tensors):
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                grad_bits |= 1 << k
    e.values = [grad_bits, torch.is_grad_enabled()]
    grad_bits = e.grad_bits(e.agree(), 0)
    # When some rank needs gradients, every rank's outputs take part in autograd (the anchor), so
    # every rank reaches the backward all-to-all.
    anchor = torch.empty(0, device=cu_seqlens.device, requires_grad=bool(grad_bits))
    outs = _Rebalance.apply(plan, group, rank, grad_bits, cu_seqlens, anchor, *tensors)
    out_cu = cu_seqlens_from_lengths(plan.route(rank).out_lengths, device=cu_seqlens.device)
    return (list(outs) if many else outs[0]), out_cu
