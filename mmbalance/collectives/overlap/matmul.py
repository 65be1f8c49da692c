"""All-gather + GEMM and GEMM + reduce-scatter, sliced so communication hides behind the GEMMs.

Tensor-parallel linears with sequence parallelism (Megatron-style) wait for an all-gather of the
sequence-sharded activations before the column-parallel GEMM, and for a reduce-scatter after the
row-parallel one. Following StepCCL (DistTrain section 7, MMScale section 6) both are
decomposed into ``chunks`` smaller communication/GEMM pairs: each slice's transfer runs while the
previous slice's GEMM computes, so only one slice of communication stays on the critical path.
Unlike StepCCL, slices are contiguous row ranges of the gathered tensor, so every GEMM writes its
result straight into its final place in the output and no layout remap follows.

Math (``W`` ranks, rank ``r`` holds ``m_r`` rows, ``M = sum_r m_r``)::

    all_gather_matmul:      y = cat_r(x_r) @ weight.T + bias        x_r [m_r, K] -> y [M, N]
    matmul_reduce_scatter:  z_r = (sum_s x_s @ weight_s.T)[rows of r] + bias      -> z_r [m_r, N]

The two are adjoint: the input gradient of one is the other applied to the output gradient, and
their backward passes are built from the same sliced loops (``comm.py``). Shards may be
uneven (balanced varlen batches) and empty. Accumulation happens in the GEMM's own dtype (torch's
``mm``), as in ``nn.Linear``.

Agreement across ranks: every call starts with one small all-gather (64 bytes per rank) of the
row counts, the local widths, which gradients each rank needs, and a hash of everything that must
be equal (``K``/``M``/``N``, dtype, ``chunks``, backend, bias, ``shard_sizes``). A mismatch or a
bad input on any rank raises :class:`~mmbalance.collectives.RankMismatchError` on every rank
before any data moves. The chunk count is chosen from global facts only (the gathered rows and
the widest local shard), so uneven feature splits cannot make ranks slice differently, and the
backward collectives run on every rank whenever any rank needs a gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..agreement import Agreement, Entry
from ..group import world_of
from ..inflight import Inflight
from .comm import BACKENDS, Transport, gather_matmul, make_transport, matmul_reduce, resolve_backend
from .plan import ShardLayout, choose_chunks, chunk_plan

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Setup:
    group: dist.ProcessGroup | None
    layout: ShardLayout
    transport: Transport
    save_gathered: bool = True
    # (x, weight, bias): whether *any* rank needs that gradient. The backward collectives run on
    # every rank whenever any rank needs them, so they always match.
    need: tuple[bool, bool, bool] = (True, True, True)


def _check_tensor(t: object, name: str, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32, fp64), got {t.dtype}")
    if ndim == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def _check_operands(
    x: object, weight: object, bias: object, x_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = _check_tensor(x, x_name, 2)
    weight = _check_tensor(weight, "weight", 2)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must be [N, K] with K = {x_name}.shape[1] = {x.shape[1]}, got shape {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} does not match {x_name} dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but {x_name} is on {x.device}")
    if bias is not None:
        bias = _check_tensor(bias, "bias", 1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must be [N] with N = {weight.shape[0]}, got shape {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype {bias.dtype} does not match {x_name} dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but {x_name} is on {x.device}")
    return x, weight, bias


def _check_chunks(chunks: object) -> int | None:
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be None or a positive int, got {chunks!r}")
    if chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks}")
    return chunks


def _check_call(
    e: Entry,
    x: object,
    weight: object,
    bias: object,
    x_name: str,
    chunks: object,
    backend: object,
    problems: Sequence[str],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None]:
    """The local checks both entry points run inside their agreement (so a failure raises on every
    rank): a caller's own problems (the TP modules' validation), the operands, ``chunks`` and
    ``backend``. Returns the checked operands and chunk count."""
    e.like = x if isinstance(x, torch.Tensor) else None
    if problems:
        raise ValueError("; ".join(problems))
    x, weight, bias = _check_operands(x, weight, bias, x_name)
    checked_chunks = _check_chunks(chunks)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    return x, weight, bias, checked_chunks


def _call_fields(x: torch.Tensor, chunks: int | None, bias: torch.Tensor | None, backend: object) -> dict:
    """The facts both entry points agree on besides their shapes: dtype, device, chunks, bias, backend."""
    return {
        "dtype": x.dtype,
        "device": x.device.type,
        "chunks": chunks if chunks is not None else "auto",
        "bias": bias is not None,
        "backend": backend if backend is not None else "auto",
    }


def _grad_bits(*tensors: torch.Tensor | None) -> int:
    return sum(1 << j for j, t in enumerate(tensors) if t is not None and t.requires_grad)


def _agree(e: Entry) -> tuple[Agreement, tuple[bool, bool, bool]]:
    """The agreement step of both entry points; returns it and the global gradient needs.

    ``e.values`` ends with (grad bits, grad mode): when any rank needs a gradient, every rank must
    be able to run the backward collective, so a rank under ``torch.no_grad`` is refused.
    """
    n = len(e.values)
    agreed = e.agree()
    bits = e.grad_bits(agreed, n - 2)
    return agreed, (bool(bits & 1), bool(bits & 2), bool(bits & 4))


def _anchor(need: tuple[bool, bool, bool], like: torch.Tensor) -> torch.Tensor:
    """An empty leaf that requires grad when any rank needs a gradient: this rank's output then
    takes part in autograd too, so its backward collective runs."""
    return torch.empty(0, device=like.device, requires_grad=any(need))


def _setup(
    group: dist.ProcessGroup | None,
    layout: ShardLayout,
    chunks: int | None,
    backend: str | None,
    like: torch.Tensor,
    k: int,
    n: int,
    need: tuple[bool, bool, bool],
    save_gathered: bool = True,
) -> _Setup:
    """``k`` and ``n`` are global (the same on every rank), so is the chunk count chosen from them."""
    world = layout.world_size
    if chunks is None:
        chunks = choose_chunks(layout.total, k, n, world, like.dtype, like.device.type)
    plan = chunk_plan(layout, chunks)
    name = resolve_backend(backend, like, group)
    return _Setup(group, layout, make_transport(name, group, layout, plan), save_gathered, need)


def _accumulates_per_chunk(dtype: torch.dtype) -> bool:
    # Summing the weight gradient slice by slice lets it overlap the transfers, but in fp16/bf16
    # every partial sum would be rounded to 8-11 mantissa bits: there, one GEMM at the end.
    return dtype in (torch.float32, torch.float64)


# (grad_x, grad_w, grad_b) of either function
_Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _save(
    ctx, setup: _Setup, bias: torch.Tensor | None, grads: Callable[..., _Grads], *tensors: torch.Tensor
) -> None:
    """What both forwards keep for :class:`_Overlapped`'s backward: the setup, whether there is a
    bias, the gradient function ``grads`` and the ``tensors`` it takes after the output gradient."""
    ctx.setup = setup
    ctx.has_bias = bias is not None
    ctx.grads = grads
    ctx.save_for_backward(*tensors)


def _output_grad(grad: torch.Tensor | None, rows: int, weight: torch.Tensor) -> torch.Tensor:
    """The output's gradient, or zeros ``[rows, N]`` where autograd passes none: the backward
    collectives still run on this rank, since the other ranks' gradients need them."""
    if grad is None:
        return torch.zeros(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
    return grad


def _all_gather_matmul_grads(
    setup: _Setup, has_bias: bool, grad_y: torch.Tensor | None, weight: torch.Tensor, saved: torch.Tensor
) -> _Grads:
    """``all_gather_matmul``'s gradients (x_shard, weight, bias) that any rank needs; ``saved`` is
    the gathered input, or ``x_shard`` when the forward did not keep it."""
    tr = setup.transport
    need_x, need_w, need_b = setup.need
    grad_x = grad_w = grad_b = None
    grad_y = _output_grad(grad_y, tr.layout.total, weight)
    if grad_y.stride(-1) != 1:
        grad_y = grad_y.contiguous()
    regather = None
    if need_w and not setup.save_gathered:
        # Re-gather the input (memory saved in the forward, transfers paid again here); the
        # transfers overlap the input-gradient GEMMs below.
        gathered = torch.empty(tr.layout.total, saved.shape[1], dtype=saved.dtype, device=saved.device)
        regather = tr.start_gather(saved, gathered) if tr.layout.total else None
    else:
        gathered = saved

    def weight_grad() -> None:
        nonlocal grad_w
        if not need_w:
            return
        if regather is None:
            grad_w = grad_y.t().mm(gathered)
            return
        per_chunk = _accumulates_per_chunk(grad_y.dtype)
        grad_w = torch.zeros_like(weight)
        for i, c in enumerate(tr.plan):
            regather.wait(i)
            if per_chunk:
                grad_w.addmm_(grad_y[c.start : c.stop].t(), gathered[c.start : c.stop])
        regather.wait_all()
        if not per_chunk:
            grad_w = grad_y.t().mm(gathered)

    if need_x:
        # grad_x = reduce_scatter(grad_y @ weight), sliced; grad_w hides the last reductions.
        grad_x = matmul_reduce(tr, grad_y, weight, before_finish=weight_grad)
    else:
        weight_grad()
    if need_b and has_bias:
        grad_b = grad_y.sum(0)
    return grad_x, grad_w, grad_b


def _matmul_reduce_scatter_grads(
    setup: _Setup, has_bias: bool, grad_z: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor
) -> _Grads:
    """``matmul_reduce_scatter``'s gradients (x, weight, bias) that any rank needs."""
    tr = setup.transport
    need_x, need_w, need_b = setup.need
    grad_x = grad_w = grad_b = None
    grad_z = _output_grad(grad_z, tr.layout.sizes[dist.get_rank(setup.group)], weight)
    bias_work = None
    if need_b and has_bias:
        # The bias is replicated: its gradient is the sum over every rank's rows.
        grad_b = grad_z.sum(0, dtype=grad_z.dtype)
        bias_work = Inflight()
        bias_work.add(dist.all_reduce(bias_work.alias(grad_b), group=setup.group, async_op=True))
    if need_x or need_w:
        per_chunk = need_w and _accumulates_per_chunk(grad_z.dtype)
        acc = torch.zeros_like(weight) if per_chunk else None

        def accumulate(start: int, stop: int, rows: torch.Tensor) -> None:
            if acc is not None:
                acc.addmm_(rows.t(), x[start:stop])

        # grad_x = all_gather(grad_z) @ weight, sliced; grad_w slices ride along.
        gathered, gx = gather_matmul(tr, grad_z, weight, on_chunk=accumulate if per_chunk else None)
        grad_x = gx if need_x else None
        if need_w:
            grad_w = acc if acc is not None else gathered.t().mm(x)
    if bias_work is not None:
        bias_work.wait()
    return grad_x, grad_w, grad_b


class _Overlapped(torch.autograd.Function):
    """The backward both functions share: the gradients every rank's needs call for, from the
    gradient function the forward saved, returned where this rank's inputs asked for them (none for
    the anchor and the setup)."""

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_x, grad_w, grad_b = ctx.grads(ctx.setup, ctx.has_bias, grad_out, *ctx.saved_tensors)
        local = ctx.needs_input_grad
        return (grad_x if local[0] else None, grad_w if local[1] else None, grad_b if local[2] else None,
                None, None)  # fmt: skip


class _AllGatherMatmul(_Overlapped):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, anchor, setup: _Setup):  # type: ignore[override]
        gathered, y = gather_matmul(setup.transport, x_shard, weight.t(), bias=bias)
        saved = gathered if setup.save_gathered else x_shard
        _save(ctx, setup, bias, _all_gather_matmul_grads, weight, saved)
        return y


class _MatmulReduceScatter(_Overlapped):
    @staticmethod
    def forward(ctx, x, weight, bias, anchor, setup: _Setup):  # type: ignore[override]
        z = matmul_reduce(setup.transport, x, weight.t())
        if bias is not None:
            z.add_(bias)
        _save(ctx, setup, bias, _matmul_reduce_scatter_grads, x, weight)
        return z


def all_gather_matmul(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    chunks: int | None = None,
    bias: torch.Tensor | None = None,
    shard_sizes: Sequence[int] | ShardLayout | None = None,
    backend: str | None = None,
    save_gathered: bool = True,
    _problems: Sequence[str] = (),
) -> torch.Tensor:
    """``torch.cat(all_gather(x_shard)) @ weight.T (+ bias)``, with the gather hidden behind sliced GEMMs.

    Args:
        x_shard: ``[m_r, K]`` rows held by this rank (any ``m_r >= 0``, may differ per rank), fp16,
            bf16, fp32 or fp64, last dimension contiguous.
        weight: ``[N, K]`` (this rank's column shard in tensor parallelism), same dtype and device.
        group: the process group (``None``: the default group).
        chunks: number of communication/GEMM slices of the gathered rows; ``None`` picks it from
            a cost model (``plan.choose_chunks``), ``1`` is the plain path (one
            all-gather, then one GEMM). Values above ``M`` act as ``M``. Must agree on all ranks.
        bias: optional ``[N]``.
        shard_sizes: every rank's ``m_r`` (a sequence, a CPU tensor or a ``ShardLayout``). Pass it
            when known (from the balancing plan, or ``exchange_shard_sizes`` once per batch) to
            avoid the small all-gather this call does otherwise (which on NCCL also costs a host
            sync).
        backend: ``"torch"`` (torch.distributed async collectives), ``"copy_engine"`` (CuPy
            peer copies, GPU only) or ``None`` (automatic; ``$MMBALANCE_OVERLAP_BACKEND``).
        save_gathered: keep the gathered ``[M, K]`` input for the weight gradient (default). With
            ``False`` only ``x_shard`` is kept and the backward gathers it again, overlapped
            with the input-gradient GEMMs: ``(M - m_r) * K`` elements less activation memory
            per layer for one more all-gather's worth of traffic.

    Returns:
        ``[M, N]`` in ``x_shard``'s dtype, rows in rank order. Differentiable with respect to
        ``x_shard``, ``weight`` and ``bias``: ``grad_x`` is a sliced GEMM + reduce-scatter,
        ``grad_weight = grad_y.T @ gathered`` runs while the last reductions are in flight.
    """
    with Entry("all_gather_matmul", group) as e:
        e.values = [0, 0, 0, 0]
        x_shard, weight, bias, chunks = _check_call(
            e, x_shard, weight, bias, "x_shard", chunks, backend, _problems
        )
        rank, world = world_of(group)
        m_r, k, n = x_shard.shape[0], x_shard.shape[1], weight.shape[0]
        given = None
        if shard_sizes is not None:
            given = ShardLayout.from_sizes(shard_sizes, world)
            if given.sizes[rank] != m_r:
                raise ValueError(
                    f"shard_sizes[{rank}] = {given.sizes[rank]} but x_shard has {m_r} rows on rank {rank}"
                )
        e.fields = {
            "x_shard.shape[1] (K)": k,
            **_call_fields(x_shard, chunks, bias, backend),
            "save_gathered": bool(save_gathered),
            "shard_sizes": given.sizes if given is not None else "exchanged",
        }
        e.values = [m_r, n, _grad_bits(x_shard, weight, bias), int(torch.is_grad_enabled())]
    agreed, need = _agree(e)
    layout = ShardLayout(tuple(agreed.column(0)))
    # the chunk count from global facts only: the gathered rows, K, the widest local N
    setup = _setup(group, layout, chunks, backend, x_shard, k, max(agreed.column(1)), need, save_gathered)
    return _AllGatherMatmul.apply(x_shard, weight, bias, _anchor(need, x_shard), setup)


def matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    chunks: int | None = None,
    bias: torch.Tensor | None = None,
    shard_sizes: Sequence[int] | ShardLayout | None = None,
    backend: str | None = None,
    _problems: Sequence[str] = (),
) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T)`` along rows (``+ bias``), with the reductions hidden behind sliced GEMMs.

    Args:
        x: ``[M, K_r]``, this rank's share of the contraction dimension (the same ``M`` on every
            rank), fp16, bf16, fp32 or fp64, last dimension contiguous.
        weight: ``[N, K_r]`` (this rank's row shard in tensor parallelism), same dtype and device.
        group: the process group (``None``: the default group).
        chunks: number of GEMM/reduction slices; ``None`` from the cost model, ``1`` the plain
            path (one GEMM, then one reduce-scatter). Must agree on all ranks.
        bias: optional ``[N]``, replicated on every rank and added to every output row after the
            reduction; its gradient is summed over the group (an all-reduce in the backward).
        shard_sizes: how many output rows each rank keeps (``sum == M``); default: the
            ``torch.tensor_split`` convention (the first ``M % W`` ranks get one more row).

    Returns:
        ``[m_r, N]``: rows ``[offset_r, offset_r + m_r)`` of the sum over ranks. Differentiable:
        the backward gathers ``grad_z`` in slices and overlaps each slice's transfer with the
        ``grad_x`` and ``grad_weight`` GEMMs of the previous one.
    """
    with Entry("matmul_reduce_scatter", group) as e:
        e.values = [0, 0, 0]
        x, weight, bias, chunks = _check_call(e, x, weight, bias, "x", chunks, backend, _problems)
        rank, world = world_of(group)
        m = x.shape[0]
        if shard_sizes is None:
            layout = ShardLayout.even(m, world)
        else:
            layout = ShardLayout.from_sizes(shard_sizes, world)
            if layout.total != m:
                raise ValueError(f"shard_sizes sums to {layout.total} but x has {m} rows")
        e.fields = {
            "x.shape[0] (M)": m,
            "weight.shape[0] (N)": weight.shape[0],
            **_call_fields(x, chunks, bias, backend),
            "shard_sizes": layout.sizes,
        }
        e.values = [x.shape[1], _grad_bits(x, weight, bias), int(torch.is_grad_enabled())]
    agreed, need = _agree(e)
    # the chunk count from global facts only: M, N and the widest local K
    setup = _setup(group, layout, chunks, backend, x, max(agreed.column(0)), weight.shape[0], need)
    return _MatmulReduceScatter.apply(x, weight, bias, _anchor(need, x), setup)
