"""Encoder balancing for a Hugging Face model: gather sizes -> plan -> all-to-all -> encode -> back.

``apply_encoder_balance(model)`` replaces ``model.forward`` (on the instance; ``handle.remove()``
puts the class's back). In every training forward, for each encoder the model has (see
``adapters.py``):

1. the encoder's items are taken out of the forward's arguments (``Items``);
2. every rank's item sizes are all-gathered (one small collective, with the agreement step, so a
   bad input on one rank raises on every rank);
3. every rank computes the same locality-aware post-balancing plan on the items' encoder costs
   (``post_balance(costs, ranks, "sum", src_ranks=...)``: items stay home unless balance needs
   the move, moved items prefer node-mates);
4. the inputs move with one all-to-all (``rebalance``), each rank encodes its share with one
   encoder call (a tiny dummy item when its share is empty, so FSDP/DDP see the same calls on
   every rank), and the outputs return with one all-to-all along the inverse plan;
5. the outputs, back in their rank and order, go where the model expects its encoder's results
   (``mm_encoder_outputs``, or the input embeddings for audio towers), and the model's own forward
   runs on them: the language model is untouched.

Backward retraces the two all-to-alls (``rebalance`` is differentiable), so encoder gradients are
produced on the rank that encoded the item and summed by DDP/FSDP as usual: loss and summed
gradients equal the unbalanced step's. A zero-valued term that depends on every rank's returned
outputs and dummy encoding is attached to ``loss`` and ``logits``, so every rank's backward
reaches the all-to-all and the encoder even when its own batch has no item for that encoder.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.balancing import post_balance
from mmbalance.collectives import rebalance
from mmbalance.collectives.alltoall import gather_table

from .adapter import EncoderAdapter, Items

__all__ = ["EncoderBalanceHandle", "apply_encoder_balance", "register_adapter", "registered_adapters"]

_REGISTRY: list[type[EncoderAdapter]] = []
_LOCK = threading.Lock()
_ATTR = "_mmbalance_encoder_balance"
_COST_UNITS = 1e9  # the largest item cost, in the integer units the planner balances


def register_adapter(adapter: type[EncoderAdapter]) -> type[EncoderAdapter]:
    """Register an :class:`EncoderAdapter` subclass (usable as a class decorator). Later
    registrations win over earlier ones for the same model class."""
    if not (isinstance(adapter, type) and issubclass(adapter, EncoderAdapter)):
        raise TypeError(f"adapter must be an EncoderAdapter subclass, got {adapter!r}")
    with _LOCK:
        _REGISTRY.insert(0, adapter)
    return adapter


def registered_adapters() -> list[type[EncoderAdapter]]:
    return list(_REGISTRY)


def _supported() -> list[str]:
    return sorted({c for a in _REGISTRY for c in a.model_classes})


def _unwrap(model):
    """The Hugging Face model inside a DistributedDataParallel wrapper (FSDP2 keeps the class)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class _Attach(torch.autograd.Function):
    """``x`` unchanged, with ``anchor`` (a zero-valued scalar) joined to its graph: backward of
    anything built on ``x`` also runs backward through ``anchor``, without touching ``x``'s data."""

    @staticmethod
    def forward(ctx, x, anchor):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros((), dtype=grad.dtype, device=grad.device)


def _attach(output, anchor: Tensor):
    """Join ``anchor`` to the loss and logits of ``output`` (a ModelOutput or a tuple)."""
    if not anchor.requires_grad:
        return output
    if isinstance(output, tuple):
        out, done = list(output), 0
        for k, t in enumerate(out):
            if done < 2 and isinstance(t, Tensor) and t.is_floating_point():
                out[k], done = _Attach.apply(t, anchor.to(t.dtype)), done + 1
        return type(output)(out) if type(output) is tuple else output
    for name in ("loss", "logits"):
        t = getattr(output, name, None)
        if isinstance(t, Tensor) and t.is_floating_point():
            setattr(output, name, _Attach.apply(t, anchor.to(t.dtype)))
    return output


class EncoderBalanceHandle:
    """What :func:`apply_encoder_balance` returns.

    Attributes:
        stats: ``{encoder: {"before", "after", "moved"}}`` of the last balanced forward: max/mean
            of the per-rank encoder cost before and after the plan, and the fraction of items
            that left their rank (encoders without items anywhere in that forward are absent).
        timings: ``{encoder: {"plan_ms", "move_in_ms", "encode_ms", "move_back_ms"}}`` of the
            last balanced forward on this rank: the size exchange and planning, the all-to-all of
            the inputs, the encoder itself, and the all-to-all of the outputs.
        adapters: the adapters in use, by encoder name.
        group: the process group the encoders are balanced over (a dedicated copy of the one
            given, so the balancing all-to-alls never interleave with DDP/FSDP collectives).
    """

    def __init__(
        self, model, adapters: list[EncoderAdapter], group, cost, ranks_per_node, training_only: bool
    ):
        self.model = model
        self.adapters = {a.encoder: a for a in adapters}
        self.group = group
        self.cost = cost
        self.ranks_per_node = ranks_per_node
        self.training_only = training_only
        self.stats: dict[str, dict[str, float]] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self._had_forward = "forward" in model.__dict__
        self._old_forward = model.__dict__.get("forward")
        self._forward = model.forward  # the bound forward that runs after the encoders
        self._signature = inspect.signature(self._forward)
        self._removed = False

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        """Restore the model exactly as it was (idempotent)."""
        if self._removed:
            return
        if self._had_forward:
            self.model.forward = self._old_forward
        else:
            self.model.__dict__.pop("forward", None)
        self.model.__dict__.pop(_ATTR, None)
        self._removed = True

    def __enter__(self) -> EncoderBalanceHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        return not self._removed

    def __repr__(self) -> str:
        return (
            f"EncoderBalanceHandle({type(self.model).__name__}, encoders={list(self.adapters)}, "
            f"ranks={dist.get_world_size(self.group)}, active={self.active})"
        )

    # ------------------------------------------------------------------ the forward
    def __call__(self, *args, **kwargs):
        if self.training_only and not self.model.training:
            return self._forward(*args, **kwargs)
        bound = self._signature.bind(*args, **kwargs)
        call = dict(bound.arguments)
        extra = call.pop(
            next((n for n, p in self._signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {}
        )
        call.update(extra)
        anchors: list[Tensor] = []
        for adapter in self.adapters.values():
            call = self._balance(adapter, call, anchors)
        output = self._forward(**call)
        if anchors:
            anchor = sum(a.sum() * 0.0 for a in anchors)
            output = _attach(output, anchor)
        return output

    def _balance(self, adapter: EncoderAdapter, kwargs: dict, anchors: list[Tensor]) -> dict:
        model, group = self.model, self.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        t0 = time.perf_counter()
        problems, err, items = [], None, None
        try:
            items = adapter.extract(model, kwargs)
            if items is not None:
                self._check_items(adapter, items)
        except (TypeError, ValueError) as exc:
            problems, err = [f"{adapter.encoder} inputs: {exc}"], exc
        n_meta = len(adapter.meta_columns)
        mat = None
        if not problems:
            mat = np.zeros((0, 1 + n_meta), dtype=np.int64)
            if items is not None and len(items):
                mat = np.concatenate([items.rows[:, None], items.meta], axis=1)
        table, src = gather_table(
            mat,
            group,
            entry=f"apply_encoder_balance[{adapter.encoder}]",
            problems=problems,
            local_error=err,
            fields={
                "adapter": type(adapter).__name__,
                "training": bool(model.training),
                "cost": self.cost
                if isinstance(self.cost, str)
                else f"callable {getattr(self.cost, '__qualname__', '?')}",
                "ranks_per_node": self.ranks_per_node,
            },
        )
        if table.shape[0] == 0:  # no rank has an item: the stock path, on every rank alike
            self.stats.pop(adapter.encoder, None)
            self.timings.pop(adapter.encoder, None)
            return kwargs
        rows_all, meta_all = table[:, 0], table[:, 1:]
        costs = self._costs(adapter, meta_all, rows_all)
        units = np.maximum(1, np.rint(costs * (_COST_UNITS / max(float(costs.max()), 1e-300)))).astype(
            np.int64
        )
        plan = post_balance(units, world, "sum", src_ranks=src, ranks_per_node=self.ranks_per_node)
        self.stats[adapter.encoder] = _stats(costs, src, plan.dst_rank, world)

        # inputs to the encoder layout
        t1 = time.perf_counter()
        mine = items if items is not None and len(items) else None
        payload = mine.payload if mine is not None else adapter.empty_payload(model)
        in_rows = mine.rows if mine is not None else np.zeros(0, dtype=np.int64)
        moved, _ = rebalance(
            list(payload), _cu(in_rows, payload[0].device), plan.with_lengths(rows_all), group
        )
        recv = plan.recv_order(rank)
        t2 = time.perf_counter()
        if recv.size:
            outputs = adapter.encode(model, moved, meta_all[recv])
        else:  # nothing to encode here: a tiny item keeps the encoder calls equal on every rank
            d_payload, d_meta = adapter.dummy(model)
            dummy_out = adapter.encode(model, d_payload, d_meta)
            anchors.extend(dummy_out)
            outputs = [t[:0] for t in dummy_out]
        # outputs back to their items' ranks and order
        t3 = time.perf_counter()
        out_rows_all = adapter.out_rows(model, meta_all)
        back_plan = plan.with_lengths(out_rows_all).inverse()
        back, _ = rebalance(outputs, _cu(out_rows_all[recv], outputs[0].device), back_plan, group)
        anchors.extend(back)
        t4 = time.perf_counter()
        self.timings[adapter.encoder] = {
            "plan_ms": 1e3 * (t1 - t0),
            "move_in_ms": 1e3 * (t2 - t1),
            "encode_ms": 1e3 * (t3 - t2),
            "move_back_ms": 1e3 * (t4 - t3),
        }
        if mine is None:
            return kwargs
        return adapter.restore(model, kwargs, mine, back)

    def _costs(self, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if callable(self.cost):
            costs = np.asarray(self.cost(adapter.encoder, meta, rows), dtype=np.float64).reshape(-1)
        elif self.cost == "rows":
            costs = rows.astype(np.float64)
        elif self.cost == "items":
            costs = np.ones(rows.size)
        else:
            costs = np.asarray(adapter.cost(self.model, meta, rows), dtype=np.float64).reshape(-1)
        if costs.shape != rows.shape or not np.all(np.isfinite(costs)) or np.any(costs < 0):
            raise ValueError(
                f"cost for {adapter.encoder} must give one finite cost >= 0 per item, got {costs!r}"
            )
        return costs

    @staticmethod
    def _check_items(adapter: EncoderAdapter, items: Items) -> None:
        if items.meta.shape[1] != len(adapter.meta_columns):
            raise ValueError(
                f"{type(adapter).__name__}.extract gave {items.meta.shape[1]} metadata columns, "
                f"meta_columns names {len(adapter.meta_columns)}"
            )
        total = int(items.rows.sum())
        for k, t in enumerate(items.payload):
            if t.shape[0] != total:
                raise ValueError(f"payload[{k}] has {t.shape[0]} rows, the items {total}")


def _own_group(base):
    """A process group with ``base``'s ranks used by the balancing alone: its all-to-alls (also
    those of the backward, which autograd schedules) then never interleave with DDP's or FSDP's
    collectives on a shared communicator. ``new_group`` is collective over the world and needs the
    same calls in the same order on every rank, so every rank learns every rank's group first and
    all create all of them."""
    mine = tuple(dist.get_process_group_ranks(base))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    me, own = dist.get_rank(), None
    for ranks in sorted(set(every)):
        g = dist.new_group(list(ranks))
        if me in ranks:
            own = g
    return own


def _cu(rows: np.ndarray, device) -> Tensor:
    cu = np.zeros(rows.size + 1, dtype=np.int32)
    np.cumsum(rows, out=cu[1:])
    return torch.from_numpy(cu).to(device)


def _stats(costs: np.ndarray, src: np.ndarray, dst: np.ndarray, world: int) -> dict[str, float]:
    before = np.bincount(src, weights=costs, minlength=world)
    after = np.bincount(dst, weights=costs, minlength=world)
    ratio = lambda load: float(load.max() / load.mean()) if load.mean() > 0 else 1.0  # noqa: E731
    return {"before": ratio(before), "after": ratio(after), "moved": float(np.mean(src != dst))}


def apply_encoder_balance(
    model,
    group=None,
    *,
    cost="auto",
    ranks_per_node: int | None = None,
    adapters: Sequence[EncoderAdapter] | None = None,
    training_only: bool = True,
) -> EncoderBalanceHandle:
    """Balance the encoders of ``model`` over the ranks of ``group``, in every forward.

    Args:
        model: the top-level Hugging Face model a training loop calls
            (``Qwen2VLForConditionalGeneration``, ``LlavaForConditionalGeneration``, ...), or a
            ``DistributedDataParallel`` around it. FSDP2 (``fully_shard``) modules work as they are.
        group: the data-parallel process group (default: the world). The balancing uses its own
            copy of it (created here, collectively: every rank of ``group`` must call this).
        cost: how an item's encoding cost is estimated: ``"auto"`` (the adapter's FLOP model:
            quadratic in the patches of an image or frame plus linear for Qwen-style ViTs, one unit
            per tile or fixed-length clip), ``"rows"`` (input rows), ``"items"`` (one per item),
            or a callable ``cost(encoder, meta, rows) -> costs`` on the gathered item table.
        ranks_per_node: moved items prefer a destination on their own node (must divide the
            group size).
        adapters: adapters to use instead of the registered ones for ``type(model)``.
        training_only: balance only while ``model.training`` (the default: evaluation and
            ``generate`` then run the stock forward, whose call pattern may differ between ranks).

    Returns:
        An :class:`EncoderBalanceHandle`: ``handle.stats``, ``handle.remove()``; a context manager.

    Raises:
        ValueError: ``model``'s class has no adapter (the message lists the supported ones), the
            model is already balanced, or an argument is invalid.
        ImportError: transformers is not installed (``pip install "mmbalance[hf]"``).
    """
    from . import adapters as _builtin  # noqa: F401 - registers the built-in adapters

    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _ATTR in inner.__dict__:
        raise ValueError(
            f"{type(inner).__name__} already has encoder balancing applied; call handle.remove() first"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    if not (cost in ("auto", "rows", "items") or callable(cost)):
        raise ValueError(f"cost must be 'auto', 'rows', 'items' or a callable, got {cost!r}")
    base = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(base)
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be None or an int >= 1, got {ranks_per_node!r}")
        if world % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the group size ({world})")
    if adapters is None:
        chosen = [cls() for cls in _REGISTRY if cls().matches(inner)]
        seen, unique = set(), []
        for a in chosen:  # the most recently registered adapter per encoder wins
            if a.encoder not in seen:
                seen.add(a.encoder)
                unique.append(a)
        chosen = unique
    else:
        chosen = list(adapters)
        for a in chosen:
            if not isinstance(a, EncoderAdapter):
                raise TypeError(f"adapters must be EncoderAdapter instances, got {type(a).__name__}")
    if not chosen:
        raise ValueError(
            f"no encoder adapter for {type(inner).__name__}; supported: {', '.join(_supported())}. "
            "Write an EncoderAdapter for it (mmbalance.integrations.hf.EncoderAdapter) and register it."
        )
    names = [a.encoder for a in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"two adapters for the same encoder: {names}")
    own = _own_group(base)
    handle = EncoderBalanceHandle(inner, chosen, own, cost, ranks_per_node, training_only)
    inner.forward = handle
    inner.__dict__[_ATTR] = handle
    return handle
