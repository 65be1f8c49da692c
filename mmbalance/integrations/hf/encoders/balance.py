"""Encoder balancing for a Hugging Face model: gather sizes -> plan -> all-to-all -> encode -> back.

``apply_encoder_balance(model)`` replaces ``model.forward`` (on the instance; ``handle.remove()``
puts the class's back). In every training forward, each encoder the model has (see ``models/``)
is balanced over the ranks by :func:`~.move.balance_encoder` (its items read, their sizes
gathered, one plan on every rank, the inputs moved, one encoder call per rank, the outputs moved
back), and the model's own forward runs on the outputs: the language model is untouched.

Backward retraces the two all-to-alls (``rebalance`` is differentiable), so encoder gradients are
produced on the rank that encoded the item and summed by DDP/FSDP as usual: loss and summed
gradients equal the unbalanced step's. So that every rank's backward reaches the all-to-all and
its encoder call even when its own batch has no item, a zero that depends on every rank's returned
outputs and stand-in encoding (:class:`~.link.ZeroLink`) is added to the input embeddings of the
language model: whatever the loss is built from (logits, hidden states of a base ``...Model``)
depends on it, nothing is a view, and in-place ops on the loss work as usual.

Evaluation forwards (``model.eval()``) and ``generate()`` run the stock forward: their call
patterns may differ between ranks, and generation needs no balanced encoder.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.group import world_of
from mmbalance.collectives.pool import own_group
from mmbalance.collectives.teardown import release_at_exit, wait_for_backend_threads

from ..compat import FEEDS_ITSELF, feeding_encoder_outputs
from ..wrappers import inner_model, wrapper_hint
from . import models as _builtin  # noqa: F401 - registers the built-in adapters
from .adapter import EncoderAdapter, adapters_for, supported_classes
from .link import ZeroLink
from .move import balance_encoder
from .plan import item_costs

__all__ = ["EncoderBalanceHandle", "apply_encoder_balance", "encoder_balance_of"]

_HANDLE_ATTR = "_mmbalance_encoder_balance"
_REMOVE_WAIT_S = 5.0  # remove(): how long to wait for gloo's workers before destroying the group


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
        #: called with the handle after every balanced forward's encoders (its stats and timings
        #: are that forward's); e.g. the trainer's log keys
        self.listeners: list = []
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
        model.__dict__[_HANDLE_ATTR] = self
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
        model.__dict__.pop(_HANDLE_ATTR, None)
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
    def _stock(self, *args, **kwargs):
        """The model's own forward, with encoder outputs in the form the installed transformers
        takes them (``compat.feeding_encoder_outputs``)."""
        with feeding_encoder_outputs(self.model, kwargs) as call:
            return self._forward(*args, **call)

    def __call__(self, *args, **kwargs):
        if (
            self._removed
            or (self.training_only and not self.model.training)
            or getattr(self._generating, "depth", 0)
        ):
            return self._stock(*args, **kwargs)
        bound = self.__signature__.bind(*args, **kwargs)
        call = dict(bound.arguments)
        extra = call.pop(
            next((n for n, p in self.__signature__.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {}
        )
        call.update(extra)
        links: list[Tensor] = []
        for adapter in self.adapters.values():
            call = self._balance(adapter, call, links)
        for listener in self.listeners:
            listener(self)
        links = [t for t in links if t.requires_grad]
        if not links:
            return self._stock(**call)
        anchor = ZeroLink.apply(*links)
        embeds = call.get("inputs_embeds")
        if _floating(embeds):
            call["inputs_embeds"] = embeds + anchor.to(embeds.dtype)
        get_emb = getattr(self.model, "get_input_embeddings", None)
        emb = get_emb() if callable(get_emb) else None
        if not isinstance(emb, torch.nn.Module):
            return _attach_to_outputs(self._stock(**call), anchor)
        hook = emb.register_forward_hook(
            lambda mod, inp, out: out + anchor.to(out.dtype) if _floating(out) else out
        )
        try:
            return self._stock(**call)
        finally:
            hook.remove()

    def _balance(self, adapter: EncoderAdapter, kwargs: dict, links: list[Tensor]) -> dict:
        step = balance_encoder(self.model, adapter, kwargs, links, group=self.group, cost=self.cost,
                               ranks_per_node=self.ranks_per_node)  # fmt: skip
        if step.stats is None or step.timings is None:  # no rank had an item
            self.stats.pop(adapter.encoder, None)
            self.timings.pop(adapter.encoder, None)
        else:
            self.stats[adapter.encoder] = step.stats
            self.timings[adapter.encoder] = step.timings
        return step.kwargs

    def item_costs(self, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The cost this handle balances for every item of ``adapter`` (float64 ``[n]``), from the
        gathered item table: what :func:`apply_encoder_balance`'s ``cost`` says."""
        return item_costs(self.cost, self.model, adapter, meta, rows)


# the handle gives the forward its encoder outputs itself: a model hook that would do so leaves them
setattr(EncoderBalanceHandle, FEEDS_ITSELF, True)


def encoder_balance_of(model) -> EncoderBalanceHandle | None:
    """The active :class:`EncoderBalanceHandle` applied to ``model`` (``None`` without one)."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    return handle if handle is not None and handle.active else None


#: vision-language models whose encoders are not balanced yet, and why (named in the refusal)
NOT_BALANCED = {
    "Llama4ForConditionalGeneration": "transformers' own forward of Llama 4 fails (it reads image_outputs "
    "from the language model's output) in the releases tested, so nothing can be checked against it",
}


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
            ``DistributedDataParallel`` or peft ``PeftModel`` (LoRA ...) around it: the model
            inside is balanced, and ``remove()`` restores it. FSDP2 (``fully_shard``) modules work
            as they are.
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
    inner = inner_model(model)
    if not isinstance(inner, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _HANDLE_ATTR in inner.__dict__:
        raise ValueError(
            f"{type(inner).__name__} already has encoder balancing applied; call handle.remove() first"
        )
    if adapters is None and not adapters_for(inner) and type(inner).__name__ in NOT_BALANCED:
        raise ValueError(
            f"{type(inner).__name__}: its encoders are not balanced: {NOT_BALANCED[type(inner).__name__]}"
            f"{wrapper_hint(inner)}"
        )
    for a in (
        adapters_for(inner) if adapters is None else [a for a in adapters if isinstance(a, EncoderAdapter)]
    ):
        reason = a.refusal(inner)  # the installed release runs this encoder wrongly on gathered items
        if reason:
            raise ValueError(f"{type(inner).__name__}: its {a.encoder} encoder is not balanced: {reason}")
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
            f"no encoder adapter for {type(inner).__name__}{wrapper_hint(inner)}; supported: "
            f"{', '.join(supported_classes())}. Write an EncoderAdapter for it "
            "(mmbalance.integrations.hf.EncoderAdapter) and register it."
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
