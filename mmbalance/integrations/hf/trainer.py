"""Balanced batches in transformers' ``Trainer`` with one call: :func:`balance_trainer`.

The trainer's training data loader is replaced by one whose batch sampler is a
:class:`~mmbalance.integrations.data.BalancedBatchSampler` (per-rank micro-batches, every
micro-batch slot balanced across ranks). Everything else about the loader is the trainer's own:
its collator with unused columns removed, workers and their seeding, pinned memory, persistent
workers, prefetching. The loader is prepared by accelerate as a one-process loader, so accelerate
puts batches on the device but does not shard again what is already a per-rank batch (it would
split every step's batches over the ranks a second time and keep only batches of exactly
``batch_size`` examples). ``Trainer`` hands the epoch to the sampler (``set_epoch``), also when it
resumes mid-epoch from a checkpoint and skips the batches already trained.
"""

from __future__ import annotations

import types
import warnings
from functools import partial
from typing import Any

from mmbalance.balancing.plan import DEFAULT_BETA
from mmbalance.collectives.teardown import release_at_exit, wait_for_backend_threads
from mmbalance.integrations.data import BalancedBatchSampler

from .attention import ATTENTION_NAME
from .cp import CPBatchSampler, cost_model_of, layer_mix, model_refusal, text_config, vlm_family
from .lengths import collator_packs, dataset_lengths, pair_lengths
from .loaders import TrainerDraw, balanced_train_dataloader, stream_train_dataloader
from .logs import balance_log
from .loss import loss_unit, normalize_over_step, regrouping_changes_loss
from .mixers import keep_sequences_apart
from .wrappers import inner_model

__all__ = ["balance_trainer", "check_cp_budget", "shared_batch_parallelism"]


def shared_batch_parallelism(trainer) -> str | None:
    """The parallelism in ``trainer`` whose ranks share one batch (tensor, context or sequence
    parallelism of accelerate's ``parallelism_config``, DeepSpeed's AutoTP, ms-swift's
    ``sequence_parallel_size``), as ``"name=size, ..."``; ``None`` when every rank is a data-parallel
    rank of its own."""
    found = []
    config = getattr(trainer.accelerator, "parallelism_config", None) or getattr(
        trainer.args, "parallelism_config", None
    )
    for key in ("tp_size", "cp_size", "sp_size"):
        size = getattr(config, key, None) if config is not None else None
        if size is not None and int(size) > 1:
            found.append(f"{key}={int(size)}")
    tp = getattr(trainer, "get_tp_size", None)
    if callable(tp) and not any(f.startswith("tp_size") for f in found):
        try:
            size = int(tp())
        except (AttributeError, TypeError):  # a release whose helper needs what this trainer lacks
            size = 1
        if size > 1:
            found.append(f"tensor parallelism of {size}")
    sp = getattr(trainer.args, "sequence_parallel_size", None)
    if sp is not None and int(sp) > 1:
        found.append(f"sequence_parallel_size={int(sp)}")
    return ", ".join(found) or None


def check_cp_budget(context_parallel: bool, max_tokens_per_rank) -> None:
    """Refuse ``context_parallel`` without ``max_tokens_per_rank``, and a ``max_tokens_per_rank``
    that is not an int >= 1 (``balance_trainer`` and ``balance_every_trainer`` take both)."""
    if context_parallel and max_tokens_per_rank is None:
        raise ValueError(
            "context_parallel=True needs max_tokens_per_rank (tokens a rank may hold in a forward)"
        )
    if max_tokens_per_rank is not None and (
        isinstance(max_tokens_per_rank, bool)
        or not isinstance(max_tokens_per_rank, int)
        or max_tokens_per_rank < 1
    ):
        raise ValueError(f"max_tokens_per_rank must be an int >= 1, got {max_tokens_per_rank!r}")


def balance_trainer(
    trainer, lengths=None, *, cost="quadratic", padding=None, context_parallel=False, max_tokens_per_rank=None,
    order="sampler",
):  # fmt: skip
    """Make ``trainer.train()`` train on balanced batches; returns ``trainer``.

    Args:
        trainer: a ``transformers.Trainer`` instance (Trainer itself, a subclass such as TRL's
            ``SFTTrainer``, or a user's own), with a sized ``train_dataset``.
        lengths: tokens per example of ``trainer.train_dataset`` (``[n]``, or ``[n, phases]`` with
            the LLM tokens last, as for :class:`~mmbalance.integrations.data.BalancedBatchSampler`).
            Default: the dataset's ``args.length_column_name`` column, else ``len(input_ids)`` of
            every item (the processing class's first model input name, if it has one).
        cost: ``"sum"``, ``"quadratic"`` or a :class:`~mmbalance.balancing.CostModel`, as for the
            sampler.
        padding: whether the collator pads every micro-batch to its longest example (so a
            micro-batch costs ``examples * h(longest)``). Default (``None``): packed when the
            collator is transformers' ``DataCollatorWithFlattening`` or the arguments say
            ``padding_free`` / ``packing`` (TRL), padded otherwise.
        context_parallel: dynamic context parallelism of any degree
            (:func:`~mmbalance.integrations.hf.apply_dynamic_cp`'s scheme; the model must use
            ``attn_implementation="mmbalance_varlen"``). Each optimizer step takes the same
            examples as without it; its ``gradient_accumulation_steps`` micro-batch slots are
            formed with ``max_tokens_per_rank`` as a hard limit first and balance second (the
            balanced slots where they fit, else re-formed: a step is refused only when no split
            of its examples fits, and the whole epoch is checked when it starts, the first one
            here), and each slot is scheduled into CP groups under ``max_tokens_per_rank``;
            every rank loads only its group's examples and its collator cuts this rank's zigzag
            shard (no data exchange). Gradients are averaged over the whole world (DDP or FSDP2)
            and the loss normalized by Trainer (``average_tokens_across_devices``), so training
            equals the run without it. ``cost`` is then ``"quadratic"`` (the model's shape),
            ``"linear"``, a :class:`~mmbalance.balancing.CostModel` or a callable. For the
            multimodal models of ``apply_dynamic_cp`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA,
            the Qwen2.5-Omni thinker) the collator also computes every sequence's M-RoPE
            positions whole (``get_rope_index``) and leaves the media to the forward: each member
            of a group encodes its share of the group's images, frames and clips (a stand-in
            where it has none) and one all-to-all over the group sends the feature rows to the
            members holding their placeholders. The slots are scheduled on the LLM tokens
            (``lengths``, vision tokens included) under ``cost``; the encoder phase is not in this schedule's cost, and
            ``apply_encoder_balance`` on the model finds nothing left to balance.
        max_tokens_per_rank: tokens a rank may hold in a forward (required with
            ``context_parallel``).
        order: which examples each optimizer step takes: ``"sampler"`` (the balanced sampler's own
            seeded shuffle, below) or ``"trainer"`` (the draw of the trainer's own training loader,
            its ``get_train_dataloader``, a framework's own sampler included: every rank's share of
            an epoch gathered when the epoch starts, one small gather; every step holds the
            examples it holds without balancing, and only their split over ranks and micro-batches
            changes, so with the loss normalized by the step's token count training is the same).

    Preference pairs: a DPO trainer (``loss.PAIR_MEAN_LOSSES``: TRL's ``DPOTrainer``, LLaMA-Factory's
    and ms-swift's DPO) averages its loss over each micro-batch's pairs, so its micro-batches keep the
    trainer's own number of pairs (``per_device_train_batch_size``) and only which pairs go together
    changes (``BalancedBatchSampler(equal_counts=True)``); the loss stays the trainer's own. A pair is
    priced by its longer row where the collator pads, both rows where it packs, read from the pair
    columns or measured by the trainer's collator (vision DPO); ``lengths`` may give them instead.
    ``context_parallel`` and streamed data are refused for pairs.

    Streaming: with an ``IterableDataset``, every rank reads its slice of the stream (examples
    ``rank, rank + world, ...``), batches ``per_device_train_batch_size`` of them with the
    trainer's collator, and each micro-batch is post-balanced over the ranks by one all-to-all
    (:meth:`~mmbalance.integrations.hf.cp.DynamicCPHandle.batches`): degree 1 everywhere
    (OrchMLLM's LLM-phase post-balancing) unless ``context_parallel``. With
    ``context_parallel`` on more than one rank the loader yields the raw examples instead: each
    optimizer step's micro-batch slots are formed under ``max_tokens_per_rank`` from the gathered
    example lengths, then the collator runs once per slot. Either way a last, partial step is
    filled with idle micro-batches, so every pass ends in an optimizer step. Every drawn example
    is trained once; the loader has no length, so set ``max_steps``.

    The sampler takes ``per_device_train_batch_size * world_size * gradient_accumulation_steps``
    examples per optimizer step (seeded by ``args.data_seed`` or ``args.seed``, a new order each
    epoch) and gives every rank ``gradient_accumulation_steps`` micro-batches of about equal cost
    slot by slot; ``args.dataloader_drop_last`` drops the tail, otherwise it is padded with
    repeats of the first examples. Per-rank batch sizes differ, so the loss must be normalized by
    the global token count of the step: it is switched on here (``model_accepts_loss_kwargs``, and
    the count handed to the model's loss on every release) for the trainers whose loss is such a
    token mean (``loss.TOKEN_MEAN_LOSSES``: transformers', TRL's SFT, LLaMA-Factory's and ms-swift's
    SFT), also for a model that opts out of it (Qwen3.5, Gemma 4) where its loss takes the count;
    keep ``average_tokens_across_devices=True`` (the default; a warning says when it is off on
    several ranks).

    On several ranks it also arranges the end of the run so that it cannot hang at teardown (see
    :func:`mmbalance.collectives.shutdown`): the process groups are kept until the process exits, and
    at train end a callback waits until gloo's worker threads have released the last collectives'
    tensors. Nothing collective happens then, so ``evaluate()``, saving and the program's own
    collectives after ``train()`` work as before; call ``shutdown()`` where the program ends its
    distributed work.

    Raises:
        ValueError: a trainer whose loss regrouping would change (a reward or RL loss, KTO, ORPO, a
            ``compute_loss`` of its own, a model whose loss is a mean over each micro-batch, a DPO
            option that couples a micro-batch's pairs), named with the reason; ``lengths`` of a different size than the dataset; a dataset smaller than one
            step with ``dataloader_drop_last``; an unsized or missing ``train_dataset``; accelerate
            set to split or dispatch batches (both assume one global batch per step).
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"trainer must be a transformers.Trainer (or a subclass), got {type(trainer).__name__}"
        )
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("trainer.train_dataset is None: balance_trainer needs the training data")
    if padding is not None and not isinstance(padding, bool):
        raise TypeError(f"padding must be a bool or None, got {type(padding).__name__}")
    if not isinstance(context_parallel, bool):
        raise TypeError(f"context_parallel must be a bool, got {type(context_parallel).__name__}")
    if order not in ("sampler", "trainer"):
        raise ValueError(f"order must be 'sampler' or 'trainer', got {order!r}")
    check_cp_budget(context_parallel, max_tokens_per_rank)
    acc = trainer.accelerator
    for name in ("split_batches", "dispatch_batches"):
        if getattr(acc, name, False):
            raise ValueError(
                f"accelerate is set to {name}=True, which splits one global batch per step over the ranks; "
                "balanced batches are already per rank: set it to False in args.accelerator_config"
            )
    shared = shared_batch_parallelism(trainer)
    if shared is not None:
        raise ValueError(
            f"balance_trainer: the trainer runs {shared}: the ranks of one such group take the same batch, and it "
            "gives every rank a batch of its own (balancing is over data-parallel ranks only); train without it, "
            "or use context_parallel=True, mmbalance's own context parallelism"
        )
    # regrouping is exact only for a loss that is the step's token sum over its global token count
    # (loss.py): that normalization is switched on here, and any other loss is refused by name
    model = inner_model(trainer.model)
    changes = regrouping_changes_loss(trainer, model)
    if changes is not None:
        raise ValueError(f"balance_trainer: {changes}")
    # a pair loss (DPO) keeps its own normalization: its micro-batches keep their number of pairs
    pairs = loss_unit(trainer) == "pairs"
    undo_loss = (lambda: None) if pairs else normalize_over_step(trainer, model)
    # a collator that packs rows (DataCollatorWithFlattening) packs them for every layer: the Gated
    # DeltaNet layers of a hybrid keep the sequences apart as the attention does (mixers.py)
    apart = keep_sequences_apart(model)
    try:
        return _balance(trainer, lengths, cost, padding, context_parallel, max_tokens_per_rank, order)
    except BaseException:  # a refusal leaves the trainer as it was
        undo_loss()
        if apart is not None:
            apart.remove()
        for name in (
            "balanced_sampler",
            "_mmbalance_options",
            "_mmbalance_cp",
            "cp_sampler",
            "_mmbalance_stream",
        ):
            trainer.__dict__.pop(name, None)
        raise


def _balance(trainer, lengths, cost, padding, context_parallel, max_tokens_per_rank, order):
    """:func:`balance_trainer` after its argument checks."""
    import torch

    dataset, args = trainer.train_dataset, trainer.args
    streaming = isinstance(dataset, torch.utils.data.IterableDataset)
    if not streaming:
        try:
            n = len(dataset)
        except TypeError:
            raise ValueError(
                "trainer.train_dataset has no length and is not an IterableDataset: balanced batches need "
                "every example's length up front, or a stream to post-balance"
            ) from None
    pairs = loss_unit(trainer) == "pairs"
    if pairs and (context_parallel or streaming):
        raise ValueError(
            f"balance_trainer: {type(trainer).__name__} trains preference pairs, which are balanced as whole "
            "pairs in micro-batches of the trainer's own size; "
            + (
                "context_parallel does not split pairs"
                if context_parallel
                else "a streamed train_dataset is not"
            )
        )
    if context_parallel or streaming:
        _check_cp_model(trainer)
    if streaming:
        if lengths is not None:
            raise ValueError(
                "lengths: a streamed train_dataset is measured as it is drawn; leave lengths=None"
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError("a streamed train_dataset has no length: set TrainingArguments(max_steps=...)")
        _warn_tokens(trainer)
        trainer._mmbalance_stream = (context_parallel, max_tokens_per_rank, cost)
        trainer.get_train_dataloader = types.MethodType(stream_train_dataloader, trainer)
        balance_log(trainer).add_source("stream", partial(_stream_keys, trainer))
        return trainer
    padded = (not collator_packs(trainer)) if padding is None else padding
    if lengths is None:
        lengths = pair_lengths(trainer, dataset, padded) if pairs else dataset_lengths(trainer, dataset)
    count = len(lengths)
    if count != n:
        raise ValueError(f"lengths has {count} entries but trainer.train_dataset has {n} examples")
    world = _warn_tokens(trainer)
    seed = args.data_seed if args.data_seed is not None else args.seed
    options: dict[str, Any] = dict(
        num_replicas=world,
        rank=args.process_index if world > 1 else 0,
        cost=cost,
        seed=seed,
        drop_last=args.dataloader_drop_last,
        grad_accum=args.gradient_accumulation_steps,
        padding=padded,
        equal_counts=pairs,
    )
    if isinstance(cost, str) and cost == "quadratic":
        # a hybrid (Gated DeltaNet beside full attention) pays the quadratic term in its softmax-attention
        # layers only: the sampler's attention weight scaled by their share
        layers, attention = layer_mix(text_config(inner_model(trainer.model)))
        if attention < layers:
            options["beta"] = DEFAULT_BETA * attention / layers
    if order == "trainer":
        options["order"] = TrainerDraw(trainer, trainer._train_batch_size, args.gradient_accumulation_steps)
        options["drop_last"] = False  # (the draw decides what an epoch holds)
    trainer.balanced_sampler = BalancedBatchSampler(lengths, trainer._train_batch_size, **options)
    trainer._mmbalance_options = options
    trainer._mmbalance_cp = None
    if context_parallel:
        assert max_tokens_per_rank is not None
        if trainer.balanced_sampler.tail:
            raise ValueError(
                "context_parallel with order='trainer': the trainer's loader ends each epoch with a partial step "
                f"({len(trainer.balanced_sampler.tail[0])} of {args.gradient_accumulation_steps} micro-batches), "
                "which context parallelism does not lay out; set dataloader_drop_last=True or pick a "
                "per_device_train_batch_size and gradient_accumulation_steps that divide the epoch"
            )
        trainer._mmbalance_cp = (int(max_tokens_per_rank), cost_model_of(inner_model(trainer.model), cost))
        # the first epoch's slots now: a step that cannot fit the budget is refused here, not in
        # the middle of an epoch (later epochs are checked when they start)
        trainer.cp_sampler = CPBatchSampler(trainer.balanced_sampler, *trainer._mmbalance_cp)
        trainer.cp_sampler.slots()
    trainer.get_train_dataloader = types.MethodType(balanced_train_dataloader, trainer)
    balance_log(trainer).add_source("batches", partial(_batch_keys, trainer))
    return trainer


def _batch_keys(trainer, state) -> dict[str, float]:
    """The ``mmbalance/*`` keys of the optimizer step that just ended (``logs.py``): its entry in
    the sampler's epoch (every epoch has the sampler's number of steps); under context parallelism
    (whose loader iterates the CP sampler's slots, not the balanced sampler) the CP schedule of
    the step's slots."""
    sampler = trainer.balanced_sampler
    if state is None or state.global_step < 1:
        return {}
    out = {"batches/plan_ms": 1e3 * sampler.plan_seconds / max(sampler.num_steps, 1)}
    if sampler.epoch_stats:
        st = sampler.epoch_stats[(state.global_step - 1) % len(sampler.epoch_stats)]
        out.update({
            "batches/cost_before": st["cost_before"], "batches/cost_after": st["cost"],
            "batches/micro_before": st["micro_cost_before"], "batches/micro_after": st["micro_cost"],
        })  # fmt: skip
    cp = getattr(trainer, "cp_sampler", None)
    if trainer._mmbalance_cp is not None and cp is not None and cp.stats:
        g, step = sampler.grad_accum, (state.global_step - 1) % max(sampler.num_steps, 1)
        layouts = [lay for _, lay in cp.slots()[step * g : (step + 1) * g]]
        out.update({
            "cp/max_degree": max((int(grp.degree) for lay in layouts for grp in lay.schedule), default=1),
            "cp/groups": sum(len(lay.schedule) for lay in layouts) / max(len(layouts), 1),
            "cp/largest_shard": max((int(lay.shard_tokens.max(initial=0)) for lay in layouts), default=0),
        })  # fmt: skip
    elif not sampler.epoch_stats:
        return {}
    return out


def _cp_keys(stats: dict) -> dict[str, float]:
    degrees = stats.get("degrees") or [1]
    return {
        "cp/max_degree": max(degrees),
        "cp/groups": len(degrees),
        "cp/largest_shard": stats.get("largest_shard", 0),
    }


def _stream_keys(trainer, state=None) -> dict[str, float]:
    """The ``mmbalance/*`` keys of a streamed step: its last micro-batch's post-balancing."""
    handle = getattr(trainer, "_mmbalance_stream_handle", None)
    st = handle.stats if handle is not None else {}
    if "before" not in st:
        return {}
    out = _cp_keys(st)
    out.update({f"cp/{k}": st[k] for k in ("before", "after", "moved_tokens", "plan_ms") if k in st})
    return out


def _warn_tokens(trainer) -> int:
    args = trainer.args
    world = max(1, args.world_size)
    if world > 1:
        _arrange_teardown(trainer)
    if world > 1 and not args.average_tokens_across_devices:
        warnings.warn(
            "average_tokens_across_devices is off: with balanced batches the ranks' micro-batches hold "
            "different numbers of tokens, so a per-rank loss normalization weights tokens by the batch they "
            "landed in; set TrainingArguments(average_tokens_across_devices=True)",
            stacklevel=3,
        )
    return world


def _check_cp_model(trainer) -> None:
    model = inner_model(trainer.model)
    vlm_family(model)  # a multimodal model the sharding does not support is refused by name
    why = model_refusal(model)
    if why is not None:
        raise ValueError(f"trainer.model: dynamic context parallelism does not run {why}")

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise ValueError(
            f"trainer.model: context parallelism and streamed post-balancing run in the {ATTENTION_NAME!r} "
            f"attention, the model uses {impl!r}: register_attention() and "
            f"model.set_attn_implementation({ATTENTION_NAME!r}) before building the Trainer"
        )


_CALLBACK_CLASS: type | None = None


def _teardown_callback_class() -> type:
    """The ``TrainerCallback`` that ends training in an order that cannot hang at teardown (built on
    first use: transformers is imported lazily)."""
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is None:
        from transformers import TrainerCallback

        class ReleaseGroupsAtExit(TrainerCallback):
            """At train end: wait until gloo's worker threads have released what the last collectives
            held, and keep the process groups until the process exits. Whatever frees the model later
            (DDP's reducer is often a group's last owner) then no longer destroys a group whose worker
            still needs the GIL, which could hang (``collectives/teardown.py``). Local: no collective,
            so evaluation, saving and the program's own collectives after ``train()`` work as before."""

            def on_train_end(self, args, state, control, **kwargs):
                release_at_exit()
                wait_for_backend_threads()

        _CALLBACK_CLASS = ReleaseGroupsAtExit
    return _CALLBACK_CLASS


def _arrange_teardown(trainer) -> None:
    """Keep the process groups until exit now (a run that fails before its end is covered too) and
    add the train-end callback once."""
    release_at_exit()
    cls = _teardown_callback_class()
    if not any(isinstance(cb, cls) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(cls())
