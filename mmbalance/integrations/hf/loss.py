"""Which trainers' losses stay what they are when their micro-batches are regrouped.

Balanced batches give the ranks micro-batches of different sizes, which is exact only where the
trainer's loss is the step's token sum over the step's global token count (transformers'
``num_items_in_batch`` reaching the loss, ``model_accepts_loss_kwargs`` on): then whichever
micro-batch a token lands in, its gradient weight is the same. A mean over each micro-batch (of
tokens, pairs, groups or sequences) changes when the micro-batches do.

The trainers known to compute such a token mean are listed by the class that defines their
``compute_loss`` (a subclass that keeps it is one of them; one that overrides it is not, until it
is listed): transformers' ``Trainer`` (the model's own loss, which must then take the count:
:func:`~mmbalance.integrations.hf.compat.loss_takes_token_count`), TRL's ``SFTTrainer`` (its
token sum over ``num_items_in_batch``), the SFT and pre-training trainers of LLaMA-Factory 0.9
and ms-swift's ``Seq2SeqTrainer`` (``swift sft``, ``swift pt``).

DPO (TRL's ``DPOTrainer``, LLaMA-Factory's ``stage: dpo``) averages over each micro-batch's pairs:
its micro-batches are regrouped keeping their number of pairs (``PAIR_MEAN_LOSSES``;
:class:`~mmbalance.integrations.data.BalancedBatchSampler`'s ``equal_counts``), so the mean over
the step's pairs stays what it is, and the options that couple a micro-batch's pairs (a loss type
that sorts or token-averages the batch, a router auxiliary loss, RPO's token mean, a BCO running
mean) are refused by name. KTO, ORPO, CPO, SimPO, reward and PRM trainers, GRPO and PPO, and a
user's own ``compute_loss`` average over their own micro-batch: their batches are never regrouped,
and the normalization is never switched on for them (it would change their loss: LLaMA-Factory's
DPO loss is no longer divided by the accumulation steps with it on). A loss function handed to the
trainer (``compute_loss_func``) counts when it takes ``num_items_in_batch``.

Whatever the trainer, two additions to the loss are a mean over each forward and are refused by
name: a mixture-of-experts router's auxiliary loss (``output_router_logits`` on with a nonzero
coefficient, :func:`router_aux_loss`; it is also refused under dynamic context parallelism, whose
shards are pieces of sequences), and label smoothing where transformers' ``LabelSmoother`` takes no
``num_items_in_batch`` (before 5.15).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .compat import install_loss_keywords, loss_takes_token_count

__all__ = [
    "PAIR_MEAN_LOSSES",
    "TOKEN_MEAN_LOSSES",
    "loss_owner",
    "loss_unit",
    "normalize_over_step",
    "router_aux_loss",
    "regrouping_changes_loss",
]

#: ``"module.Class"`` of the class that defines ``compute_loss`` -> whether the loss is the model's
#: own (True: the model's loss must take the count) or the trainer's token sum over the count
TOKEN_MEAN_LOSSES: dict[str, bool] = {
    "transformers.trainer.Trainer": True,
    "trl.trainer.sft_trainer.SFTTrainer": False,
    # LLaMA-Factory 0.9: stage sft (whose compute_loss hands on to Trainer's) and stage pt
    "llamafactory.train.sft.trainer.CustomSeq2SeqTrainer": True,
    "llamafactory.train.pt.trainer.CustomTrainer": True,
    # ms-swift 4: swift sft / swift pt (its own token sum over num_items_in_batch)
    "swift.trainers.seq2seq_trainer.Seq2SeqTrainer": False,
}

#: ``"module.Class"`` of the class that defines ``compute_loss`` for the trainers whose loss is a
#: mean over each micro-batch's preference pairs (chosen and rejected in one row pair each): a
#: regrouping that keeps every micro-batch's number of pairs keeps their loss (the mean over the
#: step's pairs, once DDP averages the ranks and Trainer the accumulation steps). TRL's
#: ``DPOTrainer``, LLaMA-Factory 0.9's ``stage: dpo`` trainer and ms-swift 4's ``swift rlhf
#: --rlhf_type dpo`` trainer (unpacked: packed, it normalizes by the step's pair count itself).
PAIR_MEAN_LOSSES: frozenset[str] = frozenset({
    "trl.trainer.dpo_trainer.DPOTrainer",
    "llamafactory.train.dpo.trainer.CustomDPOTrainer",
    "swift.rlhf_trainers.dpo_trainer.DPOTrainer",
})  # fmt: skip

#: DPO loss types that couple the pairs of a micro-batch (a sort over the batch, a token mean)
_BATCH_COUPLED = {
    "aot": "sorts the micro-batch's log-ratios",
    "aot_pair": "sorts the micro-batch's log-ratios",
    "aot_unpaired": "sorts the micro-batch's log-ratios",
    "sft": "is a token mean over the micro-batch",
}


def loss_unit(trainer) -> str:
    """``"pairs"`` for a trainer of :data:`PAIR_MEAN_LOSSES` (its micro-batches keep their number
    of pairs when balanced), else ``"tokens"``."""
    return "pairs" if loss_owner(trainer) in PAIR_MEAN_LOSSES else "tokens"


def _pair_refusal(trainer, name: str) -> str | None:
    """Why a pair trainer's options couple the pairs of a micro-batch (so that regrouping them,
    even in equal numbers, changes its loss), or ``None``."""
    types = getattr(trainer, "loss_types", None) or getattr(trainer, "loss_type", None)
    types = [types] if isinstance(types, str) else list(types or [])
    for t in types:
        if t in _BATCH_COUPLED:
            return (
                f"{name}'s loss_type {t!r} {_BATCH_COUPLED[t]}, so regrouping the pairs would change training"
            )
    if getattr(trainer, "aux_loss_enabled", False):
        return (
            f"{name} adds the router's auxiliary loss, computed over each micro-batch's tokens, so regrouping "
            "the pairs would change training"
        )
    if getattr(getattr(trainer, "template", None), "packing", False):
        return (
            f"{name} packs its pairs (ms-swift's packing), and then normalizes by the step's pair count itself; "
            "balanced pairs are for unpacked batches"
        )
    if (
        getattr(trainer, "rpo_alpha", None) is not None
        or getattr(trainer.args, "rpo_alpha", None) is not None
    ):
        return (
            f"{name}'s rpo_alpha adds a token mean over each micro-batch's chosen answers, so regrouping the "
            "pairs would change training"
        )
    if (
        float(getattr(trainer, "bco_gemma", 0.0) or 0.0) > 1e-6
        or getattr(trainer, "running", None) is not None
    ):
        return (
            f"{name}'s BCO term keeps a running mean of the rewards updated micro-batch by micro-batch, so "
            "regrouping the pairs would change training"
        )
    return None


def loss_owner(trainer) -> str:
    """``"module.Class"`` of the class in ``trainer``'s hierarchy that defines ``compute_loss``."""
    for cls in type(trainer).__mro__:
        if "compute_loss" in vars(cls):
            return f"{cls.__module__}.{cls.__qualname__}"
    return f"{type(trainer).__module__}.{type(trainer).__qualname__}"


_AUX_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def _configs(config, depth: int = 2):
    """``config`` and the configs inside it (a vision-language model's text config, an omni
    model's thinker's), ``depth`` levels down."""
    yield config
    if depth:
        for value in vars(config).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                yield from _configs(value, depth - 1)


def router_aux_loss(model) -> str | None:
    """Where ``model`` adds a mixture-of-experts router's auxiliary loss to its loss (a config of it
    with ``output_router_logits`` on and a nonzero coefficient), as ``"key=value, ..."``; ``None``
    where it adds none. The auxiliary loss is a mean over the forward's tokens: regrouping the
    micro-batches, or splitting sequences over ranks, changes it."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    for cfg in _configs(config):
        if not getattr(cfg, "output_router_logits", False):
            continue
        for key in _AUX_COEFFICIENTS:
            coef = getattr(cfg, key, None)
            if coef is not None and float(coef) != 0.0:
                return f"output_router_logits=True, {key}={coef}"
    return None


def _label_smoothing_refusal(trainer, name: str) -> str | None:
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is None or _takes_count(smoother.__call__):
        return None
    factor = getattr(getattr(trainer, "args", None), "label_smoothing_factor", None)
    return (
        f"{name}'s label smoothing (label_smoothing_factor={factor}) is a mean over each micro-batch in this "
        "transformers release (its LabelSmoother takes no num_items_in_batch; 5.15 on it does), so regrouping "
        "the micro-batches would change training"
    )


def regrouping_changes_loss(trainer, model) -> str | None:
    """Why regrouping ``trainer``'s micro-batches would change its loss (a sentence naming the
    trainer class, or the model), or ``None`` where its loss over the step's global token count is
    the same however the micro-batches are formed, or, for a pair loss (:func:`loss_unit`), however
    its pairs are regrouped in micro-batches of the trainer's own number of pairs."""
    owner = loss_owner(trainer)
    name = type(trainer).__name__
    aux = router_aux_loss(model)
    if aux is not None:
        return (
            f"{type(model).__name__} adds its router's auxiliary loss ({aux}), a mean over each micro-batch's "
            "tokens, so regrouping the micro-batches would change training; set output_router_logits=False "
            "(LLaMA-Factory: leave moe_aux_loss_coef unset) to balance them"
        )
    if owner in PAIR_MEAN_LOSSES:  # balanced with every micro-batch's number of pairs kept
        return _pair_refusal(trainer, name)
    if owner not in TOKEN_MEAN_LOSSES:
        return (
            f"{name}'s loss ({owner}.compute_loss) is not a token mean over the step: a preference, reward "
            "or RL loss, or a compute_loss of its own, averages over each micro-batch, so regrouping the "
            "micro-batches would change training (a compute_loss that is the step's token sum over "
            "num_items_in_batch can say so: mmbalance.integrations.hf.loss.TOKEN_MEAN_LOSSES"
            f"[{owner!r}] = False)"
        )
    smoothing = _label_smoothing_refusal(trainer, name)
    if smoothing is not None:
        return smoothing
    func = getattr(trainer, "compute_loss_func", None)
    if func is not None:  # transformers hands it the step's count, where it takes one
        if _takes_count(func):
            return None
        return (
            f"{name}'s loss function ({getattr(func, '__qualname__', type(func).__name__)}) takes no "
            "num_items_in_batch: a mean over each micro-batch, so regrouping the micro-batches would change "
            "training"
        )
    if TOKEN_MEAN_LOSSES[owner] and not loss_takes_token_count(model):
        return (
            f"{type(model).__name__}'s loss is a mean over each micro-batch (it does not take the step's "
            "token count), so regrouping the micro-batches would change training"
        )
    return None


def _takes_count(func) -> bool:
    """Whether a loss function can be handed ``num_items_in_batch`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "num_items_in_batch" or p.kind is p.VAR_KEYWORD for p in params)


def normalize_over_step(trainer, model) -> Callable[[], None]:
    """Make ``trainer``'s loss the step's token sum over its global token count (where
    :func:`regrouping_changes_loss` returned ``None``): the model's loss takes the count on every
    release (``compat.install_loss_keywords``) and ``model_accepts_loss_kwargs`` is on (a trainer that
    turned it off, as LLaMA-Factory's multimodal SFT does, averaged each micro-batch). Returns
    what puts the trainer and the model back as they were."""
    keywords = install_loss_keywords(model, trainer.model)
    had = "model_accepts_loss_kwargs" in trainer.__dict__
    before = trainer.__dict__.get("model_accepts_loss_kwargs")
    trainer.model_accepts_loss_kwargs = True

    def undo() -> None:
        if had:
            trainer.__dict__["model_accepts_loss_kwargs"] = before
        else:
            trainer.__dict__.pop("model_accepts_loss_kwargs", None)
        if keywords is not None:
            keywords.remove()

    return undo
