"""Dynamic context parallelism of any degree for a Hugging Face model (DHP; OrchMLLM's LLM phase).

After every rank has drawn its own batch, :meth:`DynamicCPHandle.shard` gathers the sequence
lengths (a few bytes per sequence), computes on every rank the same plan
(:func:`~mmbalance.balancing.cp_schedule`: CP groups of any integer degree under
``max_tokens_per_rank``, each sequence in one group, degree 1 a plain data-parallel rank), moves
every sequence's tokens to its group in one all-to-all (:func:`~mmbalance.collectives.rebalance`,
each zigzag chunk straight to the rank that holds it, so no rank sends a token twice) and returns
this rank's model keywords. Inside the model, ``mmbalance_varlen`` reads the shard from those
keywords and runs ring attention over the rank's group, or plain varlen attention at degree 1
(``attention.py``)::

    handle = apply_dynamic_cp(model, max_tokens_per_rank=8192)   # after init_process_group
    for batch in loader:                                          # each rank its own batch
        inputs = handle.shard(batch)
        loss = model(**inputs).loss       # this rank's token-loss sum over the global count
        loss.backward()                   # DDP averages: scale by world size, or use no_sync + all_reduce(SUM)
        ...
    handle.stats   # {"degrees": [3, 1], "largest_shard": 8190, "before": 2.7, "after": 1.1, ...}

The loss: ``labels`` are shifted on the whole sequence before it is split (``shift_labels``), so
the last token of a shard is scored against the first token of the next one, and
``num_items_in_batch`` is the global count of labelled tokens. Every rank's loss is the sum of its
tokens' losses over that count, so the gradients *summed* over ranks are exactly those of the
unsharded global mean (DDP averages over ranks: multiply the loss by the world size, as
transformers' Trainer does with ``average_tokens_across_devices``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from mmbalance.balancing import CostModel
from mmbalance.balancing.validate import as_count
from mmbalance.collectives import GroupPool
from mmbalance.collectives.agreement import Entry
from mmbalance.collectives.group import world_of
from mmbalance.collectives.inflight import mark_distributed_run
from mmbalance.collectives.pool import own_group
from mmbalance.collectives.teardown import release_at_exit

from ..attention import ATTENTION_NAME
from ..compat import install_encoder_outputs_hook, install_loss_keywords
from ..encoders import adapters_for
from ..wrappers import inner_model, wrapper_hint
from .attention import install_attention_check, model_refusal, remove_attention_check
from .families import vlm_family
from .media import embed_streams, install_media_hook, remove_media_hook
from .plan import cost_key, cost_model_of
from .shard import MEDIA_KEYWORD
from .step import RingGroups, shard_text
from .stream_step import stream_steps
from .vlm_step import shard_vlm

__all__ = ["DynamicCPHandle", "apply_dynamic_cp", "make_handle"]


# ---------------------------------------------------------------------------------- the handle
class DynamicCPHandle:
    """What :func:`apply_dynamic_cp` returns: :meth:`shard` per step, :attr:`stats`, :meth:`remove`."""

    def __init__(self, model, budget: int | None, cost, group, own, pool: GroupPool | None,
                 context_parallel: bool = True, vlm=None, encoder_cost="auto", module=None):  # fmt: skip
        self.model = model
        #: the module the training loop calls (``model``, or a peft wrapper around it): the hooks
        #: go there, as a wrapper may call the model's forward past the model's own hooks
        self.module = model if module is None else module
        self.context_parallel = bool(context_parallel)
        self.max_tokens_per_rank = budget
        self.cost = cost
        self.encoder_cost = encoder_cost
        self.group = group
        self.own = own
        #: the process groups of the CP groups (``None`` in one process)
        self.groups = RingGroups(own, pool) if own is not None and pool is not None else None
        self.vlm = vlm  # a VLMFamily for the vision-language models (families.py)
        self.adapters = []
        self._embed_hook = None
        self._feed_hook = None
        self.media_hook = False  # whether a shard installed the media pre-hook (FSDP2)
        if vlm is not None:
            self.adapters = adapters_for(model)
            self._embed_hook = embed_streams(vlm, model, self.module)
            # after the hooks that put features into the keywords (transformers < 5.18; compat.py)
            self._feed_hook = install_encoder_outputs_hook(self.module, model)
        install_attention_check(model, self.module)
        # the shard's global token count and shifted labels reach the loss on every release (compat.py)
        self._loss_hook = install_loss_keywords(model, self.module)
        self.removed = False
        #: statistics of the last :meth:`shard`: ``degrees`` (every group's degree), ``largest_shard``
        #: (tokens of the busiest rank), ``before``/``after`` (max/mean over ranks of the modelled
        #: time as sampled and as planned), ``max_before``, ``mean_before``, ``max_after``,
        #: ``mean_after``, ``moved_tokens``, ``plan_ms``, ``sequences``, ``num_items_in_batch``;
        #: for a vision-language model (the modelled times then include every rank's encoding)
        #: also ``encoders`` (per encoder: ``items``, ``rows``, and ``before``/``after``, max/mean
        #: of the encoding over the ranks), ``split_items`` (per stream, the images or frames whose
        #: feature rows reach more than one rank) and ``encoded_rows`` (input rows this rank encoded)
        self.stats: dict = {}

    # ----------------------------------------------------------------------------- the step
    def shard(self, batch: Mapping) -> dict:
        """Post-balance this rank's batch over the group and return this rank's model kwargs.

        Every rank of the group calls it with its own batch, in either form:

        * packed (``DataCollatorWithFlattening``): ``input_ids [1, T]``, ``position_ids [1, T]``
          restarting at 0 at every sequence, ``labels [1, T]``;
        * padded (a tokenizer or processor): ``input_ids [B, L]``, ``attention_mask [B, L]``
          (left or right padding), ``labels [B, L]``.

        ``labels`` may be left out (no loss). A rank may pass no sequence at all (``[1, 0]``).

        For a vision-language model the batch is what its processor gives: the padded form plus
        ``pixel_values`` with ``image_grid_thw``, ``pixel_values_videos`` with ``video_grid_thw``
        (media in order of appearance), ``mm_token_type_ids`` and ``second_per_grid_ts`` where
        the model takes them (LLaVA: ``pixel_values``; the Omni thinker: also ``input_features``
        with ``feature_attention_mask`` and ``video_second_per_grid``). The keywords then also hold
        ``mm_encoder_outputs`` (the shard's feature rows) and ``position_ids`` ``[4, 1, T]`` for
        the M-RoPE models (the token's position in its sequence, then the three M-RoPE rows the
        model's ``get_rope_index`` gives the whole sequence); see :mod:`.families`. Under
        FSDP2 they hold ``mmbalance_media`` instead of ``mm_encoder_outputs``: the encoding and the
        feature all-to-all run in the model's forward (its pre-hook), so call the model itself
        (``model(**kwargs)``), once, on every rank.

        Returns the model keywords: ``input_ids``, ``position_ids`` (each token's position in its
        own sequence), ``labels``, ``shift_labels`` (the next token's label, shifted on the whole
        sequence), ``num_items_in_batch`` (global labelled tokens), ``use_cache=False`` and the
        shard itself under ``mmbalance_cp`` (what the attention layers read); all ``[1, T_r]`` on
        the model's device. A rank the plan leaves idle gets one stand-in token with label
        ``-100``, so its forward and backward still run.

        Raises on every rank, before any data moves, naming the argument: a rank's bad batch
        (:class:`~mmbalance.collectives.RankMismatchError` elsewhere), ranks that disagree on
        ``max_tokens_per_rank`` or the cost, a sequence longer than
        ``world * max_tokens_per_rank``.
        """
        if self.removed:
            raise RuntimeError("this dynamic-CP handle was removed (handle.remove()); apply_dynamic_cp again")
        if self.vlm is None:
            return shard_text(self, batch)
        kw = shard_vlm(self, batch)
        if MEDIA_KEYWORD in kw and install_media_hook(self.model, self.module):
            self.media_hook = True  # the handle's to remove
        return kw

    def batches(self, loader, *, grad_accum: int = 1, collate=None) -> Iterator[dict]:
        """:meth:`shard` of every batch of this rank's ``loader`` (any iterable of batches), until
        every rank's loader has ended: a rank whose loader ends first takes part with empty
        batches, so no draw is lost and no rank waits for one that has stopped. One small
        all-reduce per batch agrees on the end. :attr:`stats` ``"drawn"`` counts the sequences
        this rank has drawn so far.

        ``grad_accum``: micro-batches per optimizer step. Every pass yields a multiple of it: a
        last, partial step is completed with micro-batches in which every rank is idle (no
        labelled token, so its gradient is that of a shorter final step). ``collate``: ``loader``
        yields lists of raw examples; each step's ``grad_accum`` micro-batch slots are then
        formed under ``max_tokens_per_rank`` from the gathered example lengths (the same on every
        rank; :func:`~.slots.plan_slots`) and every rank collates its examples of each slot
        with ``collate``, so a step is refused only when no split of its examples fits.
        """
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
            raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
        if collate is not None and not callable(collate):
            raise TypeError(f"collate must be callable or None, got {type(collate).__name__}")
        return stream_steps(self, loader, grad_accum, collate)

    def remove(self) -> None:
        """Detach from the model: later :meth:`shard` calls raise; the model's attention runs as
        without the handle (a shard's kwargs no longer reach it). Idempotent."""
        if self.removed:
            return
        self.removed = True
        if self._embed_hook is not None:
            self._embed_hook.remove()
        if self.media_hook:  # installed by a shard under FSDP2
            remove_media_hook(self.module)
        if self._feed_hook is not None:
            self._feed_hook.remove()
        if self._loss_hook is not None:
            self._loss_hook.remove()
        remove_attention_check(self.module)
        if getattr(self.model, "_mmbalance_dynamic_cp", None) is self:
            del self.model._mmbalance_dynamic_cp

    def __repr__(self) -> str:
        return f"DynamicCPHandle(max_tokens_per_rank={self.max_tokens_per_rank}, removed={self.removed})"


def apply_dynamic_cp(model, *, max_tokens_per_rank: int, cost="quadratic", group=None,
                     encoder_cost="auto") -> DynamicCPHandle:  # fmt: skip
    """Dynamic context parallelism of any degree for ``model``'s language model; returns the handle.

    Args:
        model: a transformers model (or a peft ``PeftModel`` around one: the model inside is
            sharded, and ``handle.remove()`` restores it) that uses
            ``attn_implementation="mmbalance_varlen"``
            (``register_attention()``, then ``from_config(..., attn_implementation=...)`` or
            ``model.set_attn_implementation("mmbalance_varlen")``). The plain text decoders
            (Llama, Qwen2, Qwen3, Mistral, ...) are supported, and the multimodal models
            Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA and the Qwen2.5-Omni thinker
            (images and audio clips; ``...ForConditionalGeneration``; :mod:`.families`:
            M-RoPE positions from the whole sequence, every image, frame and clip encoded once,
            feature rows sent straight to the shards of their placeholders).
            Any other multimodal model is refused by name. Under FSDP2 a multimodal model's
            shard leaves its encoders to the model's forward (where ``fully_shard`` gathers their
            weights), with or without
            :func:`~mmbalance.integrations.hf.encoders.apply_encoder_balance` on it. Sliding
            windows (per layer, as Gemma 2/3, Mistral, Qwen2 and gpt-oss set them), logit
            softcapping and attention sinks run in the ring exactly as on whole sequences.
            Chunked and bidirectional attention (the model's config) are refused here, by name;
            what only a call can show (block masks, padding masks) raises
            ``NotImplementedError`` at the first forward.
        max_tokens_per_rank: tokens one rank may hold in a forward (its LLM-phase activations;
            for a vision-language model the vision tokens count).
        cost: the planner's cost of a group of sequences on ``d`` ranks: ``"quadratic"`` (a dense
            transformer of the model's shape: linear layers, causal attention, ring exchange),
            ``"linear"``, a :class:`~mmbalance.balancing.CostModel`, or a callable as
            :func:`~mmbalance.balancing.cp_schedule` takes it.
        group: the data-parallel group the ranks balance over (default: the world). Every rank
            of the world calls :meth:`~DynamicCPHandle.shard` at each step (the CP groups are
            ``new_group``s, collective over the world). Without ``torch.distributed`` the handle
            runs one process (every sequence whole).
        encoder_cost: vision-language models only: the encoder phase in the plan's cost.
            ``"auto"``: the encoder's FLOPs (the adapters' model: linear layers plus attention
            within every image or frame, forward + backward) at the LLM cost's rate per FLOP
            (``cost.linear / (6 * LLM parameters)``); a callable ``encoder_cost(encoder, meta,
            rows) -> seconds`` per item (as ``apply_encoder_balance``'s ``cost`` takes it); or
            ``None``: the language model alone. Without encoder balancing, where each CP group
            encodes its own media, the planner prices a group of ``d`` ranks holding sequences
            of ``S1`` tokens in all and ``S2`` the sum of their squared lengths at
            ``fixed + linear*S1/d + max(attention*(1+eta)*S2/d, ring*S1*(d-1)/d +
            ring_latency*(d-1)) + E/d`` (``cost``'s time of the group, without ``overlap``
            the sum in place of the max; ``E``: the encoder seconds of the group's media, spread
            over its members; :func:`~mmbalance.balancing.cp_schedule`'s ``encoder_seconds``),
            and takes, of that plan and the one on ``cost`` alone, the faster by
            :meth:`~mmbalance.balancing.CostModel.step_with_encoders` (``exchange="group"``). With :func:`~mmbalance.integrations.hf.encoders.apply_encoder_balance` on
            the same model the encoders are balanced over the whole world, the same for every
            schedule, so the groups are priced by ``cost`` alone.

    The handle creates process groups of its own (one over ``group``'s ranks, plus one per CP
    rank set that the schedules use, created once and reused: :class:`GroupPool`), so its
    all-to-alls and rings never interleave with DDP's or FSDP's collectives. ``group`` and the
    world are kept until the process exits, so that freeing a DDP model cannot destroy a group
    while a gloo worker still needs the GIL (see :func:`mmbalance.collectives.shutdown`).

    A forward that carries a shard while some layer of the language model runs another
    attention (``model.set_attn_implementation("sdpa")`` after this call) raises ValueError on
    every rank, in ``shard`` (before any token moves) and in the model's forward, naming the
    attention found and the fix: another attention would ignore the shard.

    Raises:
        ValueError: a model not using ``mmbalance_varlen``, a multimodal model the sharding does
            not support (the message lists those it does), a bad ``max_tokens_per_rank``,
            ``cost`` or ``encoder_cost`` (a callable ``cost`` for a vision-language model needs
            ``encoder_cost=None``), the handle applied twice.
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    max_tokens_per_rank = as_count(max_tokens_per_rank, "max_tokens_per_rank")
    module, model = model, inner_model(model)
    vlm_family(model)  # an unsupported multimodal model is refused by name before anything else
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise ValueError(
            f"model: apply_dynamic_cp needs attn_implementation={ATTENTION_NAME!r} (the attention that runs the "
            f"ring), the model uses {impl!r}: call register_attention() and "
            f"model.set_attn_implementation({ATTENTION_NAME!r}){wrapper_hint(model)}"
        )
    if getattr(model, "_mmbalance_dynamic_cp", None) is not None:
        raise ValueError("model: apply_dynamic_cp was already applied to this model (handle.remove() first)")
    if not (encoder_cost is None or encoder_cost == "auto" or callable(encoder_cost)):
        raise ValueError(f"encoder_cost must be 'auto', None or a callable, got {encoder_cost!r}")
    return make_handle(module, int(max_tokens_per_rank), cost, group, True, encoder_cost)


def make_handle(model, budget: int | None, cost, group, context_parallel: bool,
                encoder_cost="auto") -> DynamicCPHandle:  # fmt: skip
    """The handle behind :func:`apply_dynamic_cp` (``context_parallel=False``: degree 1
    everywhere, the streamed post-balancing of ``balance_trainer``; ``budget`` may be ``None``).
    ``model`` is the module the loop calls (a peft wrapper included): its hooks go there."""
    module, model = model, inner_model(model)
    family = vlm_family(model)
    why = model_refusal(model)
    if why is not None:
        raise ValueError(f"model: dynamic context parallelism does not run {why}")
    costm = cost_model_of(model, cost)
    if family is not None and encoder_cost is not None and not isinstance(costm, CostModel):
        raise ValueError(
            "cost: a callable cost cannot take the encoder phase of a vision-language model into account; "
            "pass a CostModel (or 'quadratic'), or encoder_cost=None to plan the language model alone"
        )
    own = pool = None
    if dist.is_available() and dist.is_initialized():
        world_of(group)
        base = dist.group.WORLD if group is None else group
        own = own_group(base)
        pool = GroupPool()
        mark_distributed_run()
        # the data-parallel group and the world are kept until the process exits: freeing a model
        # (DDP's reducer is often a group's last owner) then never destroys one while a gloo worker
        # still needs the GIL, which hangs (collectives/teardown.py)
        release_at_exit(base)
        release_at_exit(dist.group.WORLD)
        with Entry("apply_dynamic_cp", own) as e:
            e.fields = {
                "max_tokens_per_rank": budget,
                "cost": cost_key(costm),
                "model": type(model).__name__,
                "context_parallel": context_parallel,
                "encoder_cost": encoder_cost if not callable(encoder_cost) else "callable",
            }
        e.agree()
    handle = DynamicCPHandle(
        model, budget, costm, group, own, pool, context_parallel, family, encoder_cost, module
    )
    model._mmbalance_dynamic_cp = handle
    return handle
