"""Hugging Face transformers integration (``pip install "mmbalance[hf]"``, transformers >= 5.18).

* :func:`apply_encoder_balance`: balance the vision/audio encoders of a Hugging Face multimodal
  model over the data-parallel ranks in every training forward, with results identical to not
  balancing::

      handle = apply_encoder_balance(model)          # after init_process_group, before training
      loss = model(**batch).loss                      # unchanged training loop (Trainer, DDP, FSDP2 ...)
      handle.stats["vision"]                          # {"before": 1.9, "after": 1.01, "moved": 0.3}

* :func:`apply_dynamic_cp`: dynamic context parallelism of any degree for long sequences: every
  step, each rank's batch is post-balanced over the ranks into CP groups of any integer degree
  (ring attention inside ``mmbalance_varlen``)::

      handle = apply_dynamic_cp(model, max_tokens_per_rank=8192)
      loss = model(**handle.shard(batch)).loss

* :class:`EncoderAdapter` / :func:`register_adapter`: teach it a model class it does not know
  (the built-in adapters are in ``encoders/models/``, one file per family).
* :func:`register_attention`: a packed (padding-free) varlen attention backend for transformers'
  ``AttentionInterface``, named ``"mmbalance_varlen"``.
* :func:`balance_trainer`: ``Trainer`` trains on balanced per-rank batches
  (:class:`~mmbalance.integrations.data.BalancedBatchSampler`, gradient accumulation included)::

      trainer = balance_trainer(Trainer(model=model, args=args, train_dataset=ds, data_collator=collate))
      trainer.train()
"""

from __future__ import annotations

_MIN_TRANSFORMERS = (5, 18)


def _require_transformers() -> None:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'mmbalance.integrations.hf needs transformers: pip install "mmbalance[hf]"'
        ) from exc
    parts = []
    for p in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < _MIN_TRANSFORMERS:
        raise ImportError(
            f"mmbalance.integrations.hf needs transformers >= {'.'.join(map(str, _MIN_TRANSFORMERS))} "
            f'(the mm_encoder_outputs hook), found {transformers.__version__}: pip install -U "mmbalance[hf]"'
        )


_require_transformers()

from .attention import ATTENTION_NAME, register_attention  # noqa: E402
from .cp import DynamicCPHandle, apply_dynamic_cp  # noqa: E402
from .encoders import (  # noqa: E402
    EncoderAdapter,
    EncoderBalanceHandle,
    Items,
    apply_encoder_balance,
    register_adapter,
    registered_adapters,
)
from .trainer import balance_trainer  # noqa: E402

__all__ = [
    "ATTENTION_NAME",
    "DynamicCPHandle",
    "EncoderAdapter",
    "EncoderBalanceHandle",
    "Items",
    "apply_dynamic_cp",
    "apply_encoder_balance",
    "balance_trainer",
    "register_adapter",
    "register_attention",
    "registered_adapters",
]
