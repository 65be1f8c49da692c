"""Model-side hooks of dynamic context parallelism on multimodal models: the media a shard
leaves to the model's forward, and the streams placed into the input embeddings.

* :func:`install_media_hook`: a forward pre-hook that runs a shard's
  :class:`~.vlm_plan.PendingMedia` (:func:`resolve_media`): encode this rank's share, one
  all-to-all of feature rows within the CP group (or along the media's mover), the features to the
  model. :func:`~mmbalance.integrations.hf.balance_trainer`'s collator cuts shards without
  communication and leaves their media to it; a plain loop's ``shard`` does so under FSDP2, which
  gathers the towers' weights only once the model's forward has begun.
* :func:`~.media.embed_streams`: for the Qwen2.5-Omni thinker, which reads audio only from
  ``input_features``, a forward pre-hook that places the shard's audio rows into the input
  embeddings at their placeholders (:func:`place_embedded`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from mmbalance.collectives import rebalance
from mmbalance.collectives.group import comm_device
from mmbalance.pyops import cu_seqlens_from_lengths

from ..attention import CP_KEYWORD
from ..compat import install_encoder_outputs_hook, remove_encoder_outputs_hook
from ..encoders import ZeroLink, core, embed_rows, pooled
from .families import vlm_family
from .family import VLMFamily, check_feature_rows, entry_rows
from .inputs import model_device
from .shard import MEDIA_KEYWORD
from .vlm_plan import PendingMedia

__all__ = ["embed_streams", "install_media_hook", "place_embedded", "remove_media_hook", "resolve_media"]


def place_embedded(family: VLMFamily, model, args: tuple, kwargs: dict) -> dict:
    """The forward keywords with the rows of the family's :attr:`~VLMFamily.embedded` streams (the
    Qwen2.5-Omni thinker's audio) moved from ``mm_encoder_outputs`` (in the order of the call's
    placeholders) into the input embeddings at their placeholder tokens. The embeddings are the
    model's own (``get_input_embeddings()(input_ids)``, or the call's ``inputs_embeds``), so the
    gradient reaches the embedding table and the rows alike; ``input_ids`` stays, for the
    placeholders of the streams the model reads itself. Raises ValueError when a stream's rows do
    not match its placeholders."""
    mm = kwargs.get("mm_encoder_outputs")
    if not isinstance(mm, Mapping) or not any(name in mm for name in family.embedded):
        return kwargs
    tokens = dict(family.streams(model))
    mm, call = dict(mm), dict(kwargs)
    ids = call.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError("mm_encoder_outputs with audio rows needs input_ids (its placeholders place them)")
    for name in sorted(family.embedded):
        entry = mm.pop(name, None)
        if entry is not None:
            call["inputs_embeds"] = embed_rows(model, ids, call.get("inputs_embeds"), entry_rows(entry),
                                               tokens[name], f"mm_encoder_outputs[{name!r}]", name)  # fmt: skip
    call["mm_encoder_outputs"] = mm or None
    return call


def embed_streams(family: VLMFamily, model, module=None):
    """For a family with :attr:`~VLMFamily.embedded` streams, a forward pre-hook on ``module`` (the
    module the loop calls, default ``model``: a peft wrapper calls the model's forward past its
    hooks) that runs :func:`place_embedded` for ``model`` on every call; returns the hook's handle,
    or ``None`` for a family without such streams."""
    if not family.embedded:
        return None

    def hook(_, args, kwargs):
        call = place_embedded(family, model, args, kwargs)
        return None if call is kwargs else (args, call)

    return (model if module is None else module).register_forward_pre_hook(hook, with_kwargs=True)


def resolve_media(model, kwargs: dict) -> dict:
    """The forward's part of a :class:`PendingMedia` in ``kwargs``: encode, exchange within the CP
    group (or along ``mover``), and give the features to the model (``mm_encoder_outputs``), with the anchor that keeps
    every member's backward in the exchange. Returns the new keywords."""
    pending = kwargs.pop(MEDIA_KEYWORD, None)
    if pending is None:
        return kwargs
    if not isinstance(pending, PendingMedia):
        raise TypeError(f"{MEDIA_KEYWORD} must be a PendingMedia (from balance_trainer's collator)")
    shard = kwargs.get(CP_KEYWORD)
    group = shard.process_group() if shard is not None else None
    device = model_device(model)
    tower = model_device(core(model))
    mm: dict[str, object] = dict(kwargs.get("mm_encoder_outputs") or {})
    family = vlm_family(model)
    links: list[Tensor] = []
    for e in pending.entries:
        if e.meta.shape[0]:
            outputs = e.adapter.encode(model, [t.to(tower) for t in e.payload], e.meta, **e.options)
        else:  # a stand-in item: every rank runs the encoder once, whatever its share
            d_payload, d_meta = e.adapter.dummy(model)
            dummy = e.adapter.encode(model, d_payload, d_meta, **e.options)
            links.extend(dummy)
            outputs = [t[:0] for t in dummy]
        if e.plan is None:
            continue
        if int(e.segments.sum()) != int(outputs[0].shape[0]):
            raise AssertionError("the encoder outputs do not match the feature move")  # a planner bug
        if pending.mover is not None:
            received = pending.mover.move(outputs, e.segments, e.plan)
        elif pending.degree > 1:
            comm = comm_device(group)
            cu = cu_seqlens_from_lengths(e.segments.astype(np.int64), device=comm)
            received, _ = rebalance([t.to(comm) for t in outputs], cu, e.plan, group)
        else:
            received = outputs
        links.extend(received)
        for name, index in e.index.items():
            idx = index.to(received[0].device)
            feats = [t.index_select(0, idx).to(device) for t in received]
            deep = [(f,) for f in feats[1:]] if len(feats) > 1 else None
            mm[name] = family.entry(feats[0], deep, name) if family is not None else pooled((feats[0],), deep)
    ids = kwargs.get("input_ids")
    if ids is not None:
        check_feature_rows(ids, pending.streams, mm)
    if mm:
        kwargs["mm_encoder_outputs"] = mm
        if family is not None:  # streams the model reads from its input embeddings (Omni's audio)
            kwargs = place_embedded(family, model, (), kwargs)
    links = [t for t in links if t.requires_grad]
    if links and shard is not None:
        shard.anchor = ZeroLink.apply(*links)
    return kwargs


def install_media_hook(model, module=None) -> bool:
    """Make ``model``'s forward resolve :class:`PendingMedia`: a forward pre-hook on ``module`` (the
    module the loop calls, default ``model``; DDP and FSDP call it, a peft wrapper is it), so the
    forward's signature stays the model's; kept out of compiled graphs (it runs collectives and
    numpy). Idempotent: returns whether this call installed it."""
    module = model if module is None else module
    if module.__dict__.get("_mmbalance_media_hook") is not None:
        return False

    @torch.compiler.disable
    def hook(_, args, kwargs):
        if MEDIA_KEYWORD not in kwargs:
            return None
        return args, resolve_media(model, dict(kwargs))

    module.__dict__["_mmbalance_media_hook"] = module.register_forward_pre_hook(hook, with_kwargs=True)
    install_encoder_outputs_hook(
        module, model
    )  # after this hook: it feeds what this one resolves (compat.py)
    return True


def remove_media_hook(module) -> None:
    """Undo :func:`install_media_hook` on ``module``, the hook that feeds its features included
    (idempotent)."""
    handle = module.__dict__.pop("_mmbalance_media_hook", None)
    if handle is not None:
        handle.remove()
        remove_encoder_outputs_hook(module)
