"""Encoder balancing for a Hugging Face model: gather sizes -> plan -> all-to-all -> encode -> back.

``apply_encoder_balance(model)`` replaces ``model.forward`` (on the instance; ``handle.remove()``
puts the class's back). In every training forward, for each encoder the model has (see
``models/``):

1. the encoder's items are taken out of the forward's arguments (``Items``);
2. every rank's item sizes are all-gathered (one small collective, with the agreement step, so a
   bad input on one rank, or ranks that disagree on the forward's encoder options or grad mode,
   raise on every rank);
3. every rank computes the same locality-aware post-balancing plan on the items' encoder costs
   (``post_balance(costs, ranks, "sum", src_ranks=...)``: items stay home unless balance needs
   the move, moved items prefer node-mates);
4. the inputs move with one all-to-all (``rebalance``), each rank encodes its share with one
   encoder call (a tiny stand-in item when its share is empty, so FSDP/DDP see the same calls on
   every rank), and the outputs return with one all-to-all along the inverse plan;
5. the outputs, back in their rank and order, go where the model expects its encoder's results
   (``mm_encoder_outputs``, or the input embeddings for audio towers), and the model's own forward
   runs on them: the language model is untouched.

Backward retraces the two all-to-alls (``rebalance`` is differentiable), so encoder gradients are
produced on the rank that encoded the item and summed by DDP/FSDP as usual: loss and summed
gradients equal the unbalanced step's. So that every rank's backward reaches the all-to-all and
its encoder call even when its own batch has no item, a zero that depends on every rank's returned
outputs and stand-in encoding is added to the input embeddings of the language model: whatever the
loss is built from (logits, hidden states of a base ``...Model``) depends on it, nothing is a view,
and in-place ops on the loss work as usual.

Evaluation forwards (``model.eval()``) and ``generate()`` run the stock forward: their call
patterns may differ between ranks, and generation needs no balanced encoder.
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

from mmbalance.balancing import imbalance, post_balance
from mmbalance.collectives import rebalance
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.alltoall import gather_table
from mmbalance.collectives.group import group_timeout, world_of
from mmbalance.collectives.inflight import gather_objects
from mmbalance.collectives.teardown import release_at_exit, wait_for_backend_threads
from mmbalance.pyops import cu_seqlens_from_lengths

from . import models as _builtin  # noqa: F401 - registers the built-in adapters
from .encoder_adapter import EncoderAdapter, Items, adapters_for, supported_classes

__all__ = ["HANDLE_ATTR", "EncoderBalanceHandle", "ZeroLink", "apply_encoder_balance", "own_group"]

HANDLE_ATTR = "_mmbalance_encoder_balance"
_COST_UNITS = 1e9  # the largest item cost, in the integer units the planner balances
_REMOVE_WAIT_S = 5.0  # remove(): how long to wait for gloo's workers before destroying the group


def _unwrap(model):
    """The Hugging Face model inside a DistributedDataParallel wrapper (FSDP2 keeps the class)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class ZeroLink(torch.autograd.Function):
    """A zero scalar whose backward sends zero gradients to ``tensors``: adding it to something
    the loss depends on makes every rank's backward run through ``tensors`` (the returned outputs
    and the stand-in encoding, hence the backward all-to-all and the encoder), without reading
    their values (an inf in them cannot turn the zero into a NaN)."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device)

    @staticmethod
    def backward(ctx, grad):
        # zeros that take no memory (one element, expanded): the point is the path, not the value
        return tuple(
            torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.meta
        )


def _floating(t) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def _attach_to_outputs(output, anchor: Tensor):
    """For models without input embeddings (not a transformers model): add ``anchor`` to the
    floating-point outputs a loss is built from (new tensors, never views)."""
    if isinstance(output, tuple):
        return type(output)(t + anchor.to(t.dtype) if _floating(t) else t for t in output)
    for name in ("loss", "logits", "last_hidden_state"):
        t = getattr(output, name, None)
        if isinstance(t, Tensor) and t.is_floating_point():
            setattr(output, name, t + anchor.to(t.dtype))
    return output


class EncoderBalanceHandle:
    """What :func:`apply_encoder_balance` returns; it is also the model's ``forward`` while active.

    Attributes:
        stats: ``{encoder: {"before", "after", "moved"}}`` of the last balanced forward: max/mean
            of the per-rank encoder cost before and after the plan, and the fraction of items
            that left their rank (encoders without items anywhere in that forward are absent).
        timings: ``{encoder: {"plan_ms", "move_in_ms", "encode_ms", "move_back_ms"}}`` of the
            last balanced forward on this rank: the size exchange and planning, the all-to-all of
            the inputs, the encoder itself, and the all-to-all of the outputs.
        adapters: the adapters in use, by encoder name.
        group: the process group the encoders are balanced over (a dedicated copy of the one
            given, with its timeout, so the balancing all-to-alls never interleave with DDP/FSDP
            collectives); destroyed by :meth:`remove`.
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
        self._had_generate = "generate" in model.__dict__
        self._old_generate = model.__dict__.get("generate")
        self._generating = threading.local()
        self._removed = False
        # the stock forward's identity for the tools that inspect it (Trainer's column removal,
        # generate's argument check): the same signature, name and documentation
        self.__wrapped__ = self._forward
        self.__signature__ = inspect.signature(self._forward)
        self.__name__ = getattr(self._forward, "__name__", "forward")
        self.__qualname__ = getattr(self._forward, "__qualname__", "forward")
        self.__doc__ = getattr(self._forward, "__doc__", None)

    # ------------------------------------------------------------------ lifecycle
    def _install(self) -> None:
        model = self.model
        model.forward = self
        model.__dict__[HANDLE_ATTR] = self
        stock_generate = getattr(model, "generate", None)
        if callable(stock_generate):

            def generate(*args, **kwargs):
                depth = getattr(self._generating, "depth", 0)
                self._generating.depth = depth + 1
                try:
                    return stock_generate(*args, **kwargs)
                finally:
                    self._generating.depth = depth

            generate.__wrapped__ = stock_generate  # type: ignore[attr-defined]
            generate.__doc__ = stock_generate.__doc__
            model.generate = generate

    def remove(self) -> None:
        """Restore the model exactly as it was and release the balancing's process group
        (idempotent). Not collective; every rank that applied it should remove it."""
        if self._removed:
            return
        model = self.model
        for name, had, old in (
            ("forward", self._had_forward, self._old_forward),
            ("generate", self._had_generate, self._old_generate),
        ):
            if had:
                setattr(model, name, old)
            else:
                model.__dict__.pop(name, None)
        model.__dict__.pop(HANDLE_ATTR, None)
        self._removed = True
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            # the group may be its own last owner: its workers must be done with every tensor first
            wait_for_backend_threads(_REMOVE_WAIT_S)
            dist.destroy_process_group(group)

    def __enter__(self) -> EncoderBalanceHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        return not self._removed

    def __repr__(self) -> str:
        ranks = dist.get_world_size(self.group) if self.group is not None else "-"
        return (
            f"EncoderBalanceHandle({type(self.model).__name__}, encoders={list(self.adapters)}, "
            f"ranks={ranks}, active={self.active})"
        )

    # ------------------------------------------------------------------ the forward
    def __call__(self, *args, **kwargs):
        if (
            self._removed
            or (self.training_only and not self.model.training)
            or getattr(self._generating, "depth", 0)
        ):
            return self._forward(*args, **kwargs)
        bound = self.__signature__.bind(*args, **kwargs)
        call = dict(bound.arguments)
        extra = call.pop(
            next((n for n, p in self.__signature__.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {}
        )
        call.update(extra)
        links: list[Tensor] = []
        for adapter in self.adapters.values():
            call = self._balance(adapter, call, links)
        links = [t for t in links if t.requires_grad]
        if not links:
            return self._forward(**call)
        anchor = ZeroLink.apply(*links)
        embeds = call.get("inputs_embeds")
        if _floating(embeds):
            call["inputs_embeds"] = embeds + anchor.to(embeds.dtype)
        get_emb = getattr(self.model, "get_input_embeddings", None)
        emb = get_emb() if callable(get_emb) else None
        if not isinstance(emb, torch.nn.Module):
            return _attach_to_outputs(self._forward(**call), anchor)
        hook = emb.register_forward_hook(
            lambda mod, inp, out: out + anchor.to(out.dtype) if _floating(out) else out
        )
        try:
            return self._forward(**call)
        finally:
            hook.remove()

    def _balance(self, adapter: EncoderAdapter, kwargs: dict, links: list[Tensor]) -> dict:
        model, group = self.model, self.group
        rank, world = world_of(group)
        t0 = time.perf_counter()
        items, options, mat = None, {}, None
        n_meta = len(adapter.meta_columns)
        with Entry(f"apply_encoder_balance[{adapter.encoder}]", group) as e:
            e.fields = {
                "adapter": type(adapter).__name__,
                "training": bool(model.training),
                "grad enabled": torch.is_grad_enabled(),
                "cost": self.cost
                if isinstance(self.cost, str)
                else f"callable {getattr(self.cost, '__qualname__', '?')}",
                "ranks_per_node": self.ranks_per_node,
                "split_frames": bool(adapter.splits_frames),
            }
            options = adapter.call_options(model, kwargs)
            e.fields["encoder options"] = repr(sorted(options.items()))
            try:
                items = adapter.extract(model, kwargs)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{adapter.encoder} inputs: {exc}") from exc
            if items is not None:
                self._check_items(adapter, items)
            mat = np.zeros((0, 1 + n_meta), dtype=np.int64)
            if items is not None and len(items):
                mat = np.concatenate([items.rows[:, None], items.meta], axis=1)
        table, src = gather_table(mat, group, entry=e)
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
        self.stats[adapter.encoder] = {
            "before": imbalance(np.bincount(src, weights=costs, minlength=world)),
            "after": imbalance(np.bincount(plan.dst_rank, weights=costs, minlength=world)),
            "moved": float(np.mean(src != plan.dst_rank)),
        }

        # inputs to the encoder layout
        t1 = time.perf_counter()
        mine = items if items is not None and len(items) else None
        payload = mine.payload if mine is not None else adapter.empty_payload(model)
        in_rows = mine.rows if mine is not None else np.zeros(0, dtype=np.int64)
        device = payload[0].device
        moved, _ = rebalance(
            list(payload), cu_seqlens_from_lengths(in_rows, device=device), plan.with_lengths(rows_all), group
        )
        recv = plan.recv_order(rank)
        t2 = time.perf_counter()
        if recv.size:
            outputs = adapter.encode(model, moved, meta_all[recv], **options)
        else:  # nothing to encode here: a tiny item keeps the encoder calls equal on every rank
            d_payload, d_meta = adapter.dummy(model)
            dummy_out = adapter.encode(model, d_payload, d_meta, **options)
            links.extend(dummy_out)
            outputs = [t[:0] for t in dummy_out]
        # outputs back to their items' ranks and order
        t3 = time.perf_counter()
        out_rows_all = np.asarray(adapter.out_rows(model, meta_all, **options), dtype=np.int64)
        back_plan = plan.with_lengths(out_rows_all).inverse()
        back, _ = rebalance(
            outputs, cu_seqlens_from_lengths(out_rows_all[recv], device=outputs[0].device), back_plan, group
        )
        links.extend(back)
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

    def item_costs(self, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The cost this handle balances for every item of ``adapter`` (float64 ``[n]``), from the
        gathered item table: what :func:`apply_encoder_balance`'s ``cost`` says."""
        return self._costs(adapter, meta, rows)

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


def own_group(base):
    """A process group with ``base``'s ranks used by the balancing alone: its all-to-alls (also
    those of the backward, which autograd schedules) then never interleave with DDP's or FSDP's
    collectives on a shared communicator. It takes ``base``'s timeout. ``new_group`` is collective
    over the world and needs the same calls in the same order on every rank, so every rank learns
    every rank's group first and all create all of them."""
    every = gather_objects(tuple(dist.get_process_group_ranks(base)))
    timeout = group_timeout(base)
    me, own = dist.get_rank(), None
    for ranks in sorted(set(every)):
        g = (
            dist.new_group(list(ranks), timeout=timeout)
            if timeout is not None
            else dist.new_group(list(ranks))
        )
        if me in ranks:
            own = g
    return own


def apply_encoder_balance(
    model,
    group=None,
    *,
    cost="auto",
    ranks_per_node: int | None = None,
    adapters: Sequence[EncoderAdapter] | None = None,
    training_only: bool = True,
    split_frames: bool = True,
) -> EncoderBalanceHandle:
    """Balance the encoders of ``model`` over the ranks of ``group``, in every training forward.

    Args:
        model: the Hugging Face model a training loop calls (``Qwen2VLForConditionalGeneration``,
            ``LlavaForConditionalGeneration``, a base ``Qwen2VLModel`` ...), or a
            ``DistributedDataParallel`` around it. FSDP2 (``fully_shard``) modules work as they are.
        group: the data-parallel process group (default: the world). The balancing uses its own
            copy of it, with the same timeout (created here, collectively: every rank of the world
            must call this).
        cost: how an item's encoding cost is estimated: ``"auto"`` (the adapter's FLOP model:
            quadratic in the patches of an image or frame plus linear for Qwen-style ViTs, one unit
            per tile or fixed-length clip), ``"rows"`` (input rows), ``"items"`` (one per item),
            or a callable ``cost(encoder, meta, rows) -> costs`` on the gathered item table.
        ranks_per_node: moved items prefer a destination on their own node (must divide the
            group size).
        adapters: adapters to use instead of the registered ones for ``type(model)``.
        training_only: balance only while ``model.training`` (the default: evaluation forwards
            run the stock forward, whose call pattern may differ between ranks). ``generate()``
            always runs the stock forward.
        split_frames: for encoders that attend within a frame (the Qwen ViTs), every frame of a
            video is an item of its own (exact; one long video then no longer bounds the step).
            ``False``: whole videos.

    Returns:
        An :class:`EncoderBalanceHandle`: ``handle.stats``, ``handle.remove()``; a context manager.

    ``group`` and the world are kept until the process exits, so that freeing a DDP model (its
    reducer is often a group's last owner) cannot destroy a group while one of gloo's worker threads
    still needs the GIL, which hangs (see :func:`mmbalance.collectives.shutdown`, which a program
    calls where it would call ``dist.destroy_process_group()``).

    Raises:
        ValueError: ``model``'s class has no adapter (the message lists the supported ones), the
            model is already balanced, or an argument is invalid.
        RuntimeError: ``torch.distributed`` is not initialized.
        ImportError: transformers is not installed (``pip install "mmbalance[hf]"``).
    """
    inner = _unwrap(model)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if HANDLE_ATTR in inner.__dict__:
        raise ValueError(
            f"{type(inner).__name__} already has encoder balancing applied; call handle.remove() first"
        )
    base = group if group is not None else dist.group.WORLD
    _, world = world_of(group)
    if not (cost in ("auto", "rows", "items") or callable(cost)):
        raise ValueError(f"cost must be 'auto', 'rows', 'items' or a callable, got {cost!r}")
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be None or an int >= 1, got {ranks_per_node!r}")
        if world % ranks_per_node:
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the group size ({world})")
    if adapters is None:
        chosen = adapters_for(inner)
    else:
        chosen = list(adapters)
        for a in chosen:
            if not isinstance(a, EncoderAdapter):
                raise TypeError(f"adapters must be EncoderAdapter instances, got {type(a).__name__}")
    if not chosen:
        raise ValueError(
            f"no encoder adapter for {type(inner).__name__}; supported: {', '.join(supported_classes())}. "
            "Write an EncoderAdapter for it (mmbalance.integrations.hf.EncoderAdapter) and register it."
        )
    names = [a.encoder for a in chosen]
    if len(set(names)) != len(names):
        raise ValueError(f"two adapters for the same encoder: {names}")
    for a in chosen:
        if not split_frames and a.splits_frames:
            a.splits_frames = False  # on this instance only
    own = own_group(base)
    # One agreement on the new group before anything uses it: every rank has connected to it
    # (so no rank can tear it down while a peer still connects), and every rank balances alike.
    with Entry("apply_encoder_balance", own) as e:
        e.fields = {
            "model": type(inner).__name__,
            "adapters": [type(a).__name__ for a in chosen],
            "cost": cost if isinstance(cost, str) else "callable",
            "ranks_per_node": ranks_per_node,
            "training_only": bool(training_only),
            "split_frames": bool(split_frames),
        }
    try:
        e.agree()
    except Exception:
        dist.destroy_process_group(own)
        raise
    handle = EncoderBalanceHandle(inner, chosen, own, cost, ranks_per_node, training_only)
    handle._install()
    # The data-parallel group (and the world) is kept until the process exits: DDP's reducer, often
    # its last owner, then never destroys it while a gloo worker still needs the GIL (that can hang;
    # collectives/teardown.py). The balancing's own group is released by remove().
    release_at_exit(base)
    release_at_exit(dist.group.WORLD)
    return handle
