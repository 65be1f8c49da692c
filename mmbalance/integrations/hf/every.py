"""Every ``transformers.Trainer`` a program builds, balanced without editing the program:
:func:`balance_every_trainer` (what ``mmbalance launch`` switches on before the program runs).

After the call, every ``Trainer`` (any subclass: TRL's, LLaMA-Factory's, ms-swift's, a user's)
constructed is balanced when its ``train()`` starts (the trainer is complete then: the framework
has set its model, collator and arguments, and DDP has not wrapped the model yet):

* encoders: ``apply_encoder_balance`` on the model inside the trainer's (a peft model included),
  on several ranks, when the model is a supported multimodal model (with ``context_parallel`` the
  CP groups encode their own media in the forward instead);
* batches: :func:`~mmbalance.integrations.hf.balance_trainer` with ``order="trainer"`` (every
  optimizer step takes the examples the trainer's own loader gives it, split over the ranks and
  micro-batches by cost; a last, partial step of an epoch trained as drawn; with
  ``context_parallel`` dynamic context parallelism of any degree, the model switched to the
  ``mmbalance_varlen`` attention);
* with balanced batches, the loss normalized by the step's global token count (Trainer's
  ``num_items_in_batch`` reaches the model, ``average_tokens_across_devices``), so that balancing
  changes no step's gradient, also for a trainer that normalized per micro-batch (LLaMA-Factory's
  multimodal SFT sets ``model_accepts_loss_kwargs = False``), where the model's loss takes the
  count (``compat.loss_takes_token_count``). Only the trainers whose loss is a token mean are
  regrouped and switched (``loss.py``: transformers', TRL's SFT, LLaMA-Factory's and ms-swift's
  SFT and pre-training trainers); DPO (TRL's, LLaMA-Factory's ``stage: dpo``) is regrouped as
  whole pairs in micro-batches of its own number of pairs, its loss untouched; the others (KTO,
  ORPO, reward, GRPO, a ``compute_loss`` of one's own) keep their batches as drawn and their loss
  exactly as it was, with a warning that says so, and so does every trainer whose batches are not
  balanced (``batches=False``);
* the balance in every ``Trainer.log`` call (``logs.py``: ``mmbalance/*`` keys).

What a trainer's own options make impossible is decided per case, on every rank, before the
first step (the same options on every rank give the same decision):

* refused with a ``ValueError`` naming the option and the fix: accelerate's ``split_batches`` or
  ``dispatch_batches`` (one global batch per step), LLaMA-Factory's ``disable_shuffling`` (the
  dataset's order, which balanced batches change), a model context parallelism cannot run,
  context parallelism where the trainer's loader ends an epoch with a partial step;
* left as the framework runs it, with one warning that says so: encoders of a multimodal model
  without an adapter, encoders a framework encodes itself before the model's forward (ms-swift's
  template pre-hook), the batches of a trainer whose loss is not a token mean (above) or of a model
  whose loss is a mean over each micro-batch whatever it is given (Gemma 3, Qwen2-Audio) and of a
  streamed dataset without context parallelism; context parallelism on such a trainer or model is
  refused (it regroups every step's sequences);
  ``group_by_length`` is replaced by the balanced sampler (whose padded cost groups lengths too).
"""

from __future__ import annotations

import functools
import warnings
import weakref

from .attention import ATTENTION_NAME, register_attention
from .encoders import adapters_for, apply_encoder_balance
from .logs import balance_log, mean_rows
from .loss import loss_unit, normalize_over_step, regrouping_changes_loss
from .mixers import keep_sequences_apart
from .trainer import balance_trainer, check_cp_budget, shared_batch_parallelism
from .wrappers import inner_model

__all__ = ["EveryTrainerHandle", "LeftAsDrawn", "balance_every_trainer"]

_ACTIVE: list[EveryTrainerHandle] = []


class LeftAsDrawn(UserWarning):
    """What a balanced program's trainer leaves as the framework runs it (encoders, batches, its
    loss), and why."""


_MARK = "_mmbalance_every"


class EveryTrainerHandle:
    """What :func:`balance_every_trainer` returns: the options, the trainers it balanced, and
    :meth:`remove` (a context manager too)."""

    def __init__(self, options: dict):
        self.options = dict(options)
        #: the trainers set up so far (those whose ``train()`` has started), weakly held
        self.trainers: weakref.WeakSet = weakref.WeakSet()
        #: per trainer: the encoder balancing handle it got (weakly keyed: a finished trainer and its
        #: model are freed as usual)
        self.encoder_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.removed = False
        #: called with each Trainer built while the switch is on (``mmbalance launch`` notes there
        #: that the program built one)
        self.on_build: list = []
        self._stock: dict[str, object] = {}

    def remove(self) -> None:
        """Trainers constructed from now on are plain again (the ones set up keep their balancing
        until they are freed). Idempotent."""
        if self.removed:
            return
        self.removed = True
        from transformers import Trainer

        for name, stock in self._stock.items():
            setattr(Trainer, name, stock)
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __enter__(self) -> EveryTrainerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"EveryTrainerHandle({self.options}, trainers={len(self.trainers)}, removed={self.removed})"


def balance_every_trainer(*, encoders: bool = True, batches: bool = True, context_parallel: bool = False,
                          max_tokens_per_rank: int | None = None, cost="quadratic",
                          token_mean_loss: bool = False) -> EveryTrainerHandle:  # fmt: skip
    """Balance every ``transformers.Trainer`` constructed after this call (module docstring).

    Args:
        encoders: balance the vision and audio encoders of supported multimodal models
            (``apply_encoder_balance``) on several ranks.
        batches: balanced per-rank batches (``balance_trainer``).
        context_parallel: dynamic context parallelism of any degree (needs ``batches`` and
            ``max_tokens_per_rank``); the model is switched to ``mmbalance_varlen``.
        max_tokens_per_rank: tokens one rank may hold in a forward (with ``context_parallel``).
        cost: ``balance_trainer``'s cost (``"quadratic"``, ``"sum"``, a ``CostModel``).
        token_mean_loss: with ``batches=False``, still normalize the loss by the step's global token
            count as balanced batches do (the trainers of ``loss.TOKEN_MEAN_LOSSES`` only; any other
            keeps its loss, with a warning): the reference a balanced run is compared with.

    Returns:
        An :class:`EveryTrainerHandle`; ``remove()`` undoes the switch.

    Raises:
        TypeError: a flag that is not a bool.
        ValueError: ``context_parallel`` without ``batches`` or ``max_tokens_per_rank``, or the
            switch is on already (``remove()`` its handle first).
    """
    for name, flag in (("encoders", encoders), ("batches", batches), ("context_parallel", context_parallel),
                       ("token_mean_loss", token_mean_loss)):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if context_parallel and not batches:
        raise ValueError(
            "context_parallel=True needs batches=True (its slots are the balanced micro-batches)"
        )
    check_cp_budget(context_parallel, max_tokens_per_rank)
    if _ACTIVE:
        raise ValueError("balance_every_trainer is on already: remove() its handle first")
    from transformers import Trainer

    handle = EveryTrainerHandle(
        dict(
            encoders=encoders,
            batches=batches,
            context_parallel=context_parallel,
            max_tokens_per_rank=max_tokens_per_rank,
            cost=cost,
            token_mean_loss=token_mean_loss,
        )  # fmt: skip
    )
    stock_init, stock_train = Trainer.__init__, Trainer.train
    handle._stock = {"__init__": stock_init, "train": stock_train}

    @functools.wraps(stock_init)
    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        if not handle.removed:
            self.__dict__[_MARK] = handle
            for hook in list(handle.on_build):
                hook(self)

    @functools.wraps(stock_train)
    def train(self, *args, **kwargs):
        owner = self.__dict__.get(_MARK)
        if owner is not None and not owner.removed and self not in owner.trainers:
            _set_up(self, owner)  # raises (a refusal) before the trainer counts as balanced
            owner.trainers.add(self)
        return stock_train(self, *args, **kwargs)

    Trainer.__init__ = __init__  # type: ignore[method-assign]
    Trainer.train = train  # type: ignore[method-assign]
    _ACTIVE.append(handle)
    return handle


# ------------------------------------------------------------------------------ one trainer
def _set_up(trainer, handle: EveryTrainerHandle) -> None:
    """Balance ``trainer`` as ``handle.options`` say (its ``train()`` is starting). A refusal
    raises with the trainer and its model as they were (the changes made before it, the loss
    keywords, the attention switch and the encoders' balancing, are taken back)."""
    opts = handle.options
    notes: list[str] = []
    _refuse_options(trainer, opts)
    model = inner_model(trainer.model)
    undo: list = []  # what a refusal below takes back, last first: no half-balanced trainer is left
    try:
        enc, batches = _set_up_parts(trainer, model, handle, notes, undo)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    log = balance_log(trainer)
    if enc is not None:
        log.add_source("encoders", _EncoderKeys(enc))
    if notes:
        # the warning names exactly what is left as the framework runs it, the options' part too
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        multimodal = _multimodal(model) or bool(adapters_for(model))
        encoders = enc is None and several and not opts["context_parallel"] and multimodal
        left = [part for part, kept in (("the encoders", encoders), ("the batches", not batches)) if kept]
        if encoders and not opts["encoders"]:
            notes.append("encoders are not balanced (--no-encoders)")
        if not opts["batches"]:
            notes.append("batches are left as drawn (--no-batches)")
        if left:
            notes[-1] += f" (left as the framework runs them: {' and '.join(left)})"
        # shown even where the framework silenced every warning (LLaMA-Factory's DPO, KTO and PPO
        # trainers call warnings.simplefilter("ignore") when they start): what is left unbalanced
        # must be said
        with warnings.catch_warnings():
            warnings.simplefilter("default", LeftAsDrawn)
            warnings.warn(
                f"mmbalance: {type(trainer).__name__}: " + "; ".join(notes), LeftAsDrawn, stacklevel=3
            )


def _set_up_parts(trainer, model, handle: EveryTrainerHandle, notes: list[str], undo: list):
    """:func:`_set_up`'s changes, each with its undo appended to ``undo`` as it is made; returns
    the encoder balancing handle (or ``None``) and whether the batches are balanced."""
    import torch
    import torch.distributed as dist

    opts = handle.options
    streamed = isinstance(trainer.train_dataset, torch.utils.data.IterableDataset)
    batches = opts["batches"]
    shared = shared_batch_parallelism(trainer)
    if shared is not None and (batches or opts["encoders"] or opts["context_parallel"]):
        raise ValueError(
            f"{type(trainer).__name__} runs {shared}: the ranks of one such group take the same batch and "
            "encode the same media, and mmbalance balances over data-parallel ranks only; run it without "
            "mmbalance's balancing, or with data parallelism (and --context-parallel) instead"
        )
    # batches are regrouped only where the trainer's loss over the step's global token count stays
    # what it is (loss.py); only then is that normalization switched on: a trainer whose batches
    # are left as drawn keeps its loss exactly
    changes = regrouping_changes_loss(trainer, model) if batches else None
    if changes is not None and opts["context_parallel"]:
        raise ValueError(f"--context-parallel regroups the sequences of every step: {changes}")
    if changes is not None:
        batches = False
        notes.append(f"batches are left as drawn: {changes}")
    if not opts["batches"] and opts.get("token_mean_loss"):  # the reference of a balanced run
        why = regrouping_changes_loss(trainer, model)
        if why is None and loss_unit(trainer) == "tokens":
            undo.append(normalize_over_step(trainer, model))
        elif why is None:  # a pair loss is balanced in its own micro-batch size: nothing to switch
            pass
        else:
            notes.append(f"the loss is left as the trainer computes it: {why}")
    if batches and streamed and not opts["context_parallel"]:
        batches = False
        notes.append(
            "batches of a streamed dataset are left as drawn (--context-parallel post-balances them)"
        )
    attention = getattr(model.config, "_attn_implementation", None)
    if opts["context_parallel"] and attention != ATTENTION_NAME:
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        undo.append(lambda: model.set_attn_implementation(attention))
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    enc = None
    # with context parallelism the CP groups encode their own media in the forward (balance_trainer)
    if opts["encoders"] and several and not opts["context_parallel"] and adapters_for(model):
        why = _encoders_left(trainer, model)
        if why is not None:
            notes.append(why)
        else:
            enc = apply_encoder_balance(trainer.model)
            handle.encoder_handles[trainer] = enc
            undo.append(enc.remove)
            undo.append(lambda: handle.encoder_handles.pop(trainer, None))
    elif opts["encoders"] and _multimodal(model) and not adapters_for(model):
        notes.append(f"encoders of {type(model).__name__} are not balanced (no adapter for it)")
    apart = keep_sequences_apart(model)  # packed rows in the Gated DeltaNet layers too (mixers.py)
    if apart is not None and not batches:
        undo.append(apart.remove)  # balance_trainer takes it back itself when it refuses
    if batches and loss_unit(trainer) == "tokens":  # a pair loss keeps its own (loss.py)
        undo.append(normalize_over_step(trainer, model))
    if batches:
        if getattr(trainer.args, "group_by_length", False):
            notes.append(
                "group_by_length is replaced by the balanced sampler (its padded cost groups lengths too)"
            )
        balance_trainer(
            trainer, cost=opts["cost"], context_parallel=opts["context_parallel"],
            max_tokens_per_rank=opts["max_tokens_per_rank"], order="trainer",
        )  # fmt: skip
    return enc, batches


def _refuse_options(trainer, opts: dict) -> None:
    """The options that make balancing impossible: ValueError naming the option and the fix."""
    finetuning = getattr(trainer, "finetuning_args", None)  # LLaMA-Factory's trainers keep theirs
    if opts["batches"] and getattr(finetuning, "disable_shuffling", False):
        raise ValueError(
            "LLaMA-Factory's disable_shuffling: true trains in the dataset's order, which balanced batches "
            "change: set disable_shuffling: false, or launch with --no-batches (mmbalance launch) to keep "
            "the order and balance the encoders only"
        )


def _multimodal(model) -> bool:
    config = getattr(model, "config", None)
    return any(
        getattr(config, k, None) is not None for k in ("vision_config", "audio_config", "thinker_config")
    )


def _encoders_left(trainer, model) -> str | None:
    """Why the encoders of ``model`` (which has an adapter) are left as the framework runs them,
    or ``None``."""
    for module in (trainer.model, model):
        for hook in list(getattr(module, "_forward_pre_hooks", {}).values()):
            owner = getattr(hook, "__self__", None)
            if owner is not None and type(owner).__module__.split(".")[0] == "swift":
                return (
                    "encoders are not balanced: ms-swift's template encodes the images in a forward pre-hook "
                    "of its own, before the model's forward"
                )
    return None


class _EncoderKeys:
    """The ``mmbalance/<encoder>/*`` keys: every balanced forward's stats of an encoder handle
    (it calls this back), averaged over the step."""

    def __init__(self, handle):
        self.rows: list[dict[str, float]] = []
        handle.listeners.append(self._record)

    def _record(self, handle) -> None:
        row = {}
        for enc, st in handle.stats.items():
            for k in ("before", "after", "moved"):
                if k in st:
                    row[f"{enc}/{k}"] = float(st[k])
        for enc, t in handle.timings.items():
            if "plan_ms" in t:
                row[f"{enc}/plan_ms"] = float(t["plan_ms"])
        if row:
            self.rows.append(row)

    def __call__(self, state=None) -> dict[str, float]:
        rows, self.rows = self.rows, []
        return mean_rows(rows)
