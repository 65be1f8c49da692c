"""Hugging Face transformers integration (``pip install "mmbalance[hf]"``, transformers >= 5.6;
what differs between versions is in ``compat.py``).

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
* :func:`keep_sequences_apart`: the token mixers of a hybrid decoder (Gated DeltaNet in Qwen3.5,
  Qwen3.5-MoE, Qwen3-Next and OLMo hybrid; the Mamba mixers of Jamba, Bamba, Nemotron-H, Falcon-H1
  and Zamba2; LFM2's short convolutions; MiniMax's lightning attention) keep the sequences of a
  packed row apart, as the attention does; other decoders that mix tokens outside attention are
  refused by name (``mixers.py``).
* :func:`balance_every_trainer`: every ``Trainer`` built after the call balanced (encoders,
  batches, the loss's normalization, ``mmbalance/*`` keys in its logs), what ``mmbalance launch``
  switches on before a training program (LLaMA-Factory, ms-swift) runs.
* :func:`balance_trainer`: ``Trainer`` trains on balanced per-rank batches
  (:class:`~mmbalance.integrations.data.BalancedBatchSampler`, gradient accumulation included)::

      trainer = balance_trainer(Trainer(model=model, args=args, train_dataset=ds, data_collator=collate))
      trainer.train()
"""

from __future__ import annotations

from .compat import require_supported_transformers as _require_supported_transformers

_require_supported_transformers()  # before the rooms import transformers' modules

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
from .every import EveryTrainerHandle, balance_every_trainer  # noqa: E402
from .mixers import SequencesApart, keep_sequences_apart  # noqa: E402
from .trainer import balance_trainer  # noqa: E402

__all__ = [
    "ATTENTION_NAME",
    "DynamicCPHandle",
    "EncoderAdapter",
    "EncoderBalanceHandle",
    "EveryTrainerHandle",
    "SequencesApart",
    "Items",
    "apply_dynamic_cp",
    "apply_encoder_balance",
    "balance_every_trainer",
    "balance_trainer",
    "keep_sequences_apart",
    "register_adapter",
    "register_attention",
    "registered_adapters",
]
