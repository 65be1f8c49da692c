"""Encoder balancing (``apply_encoder_balance``): the vision and audio encoders of a Hugging Face
multimodal model balanced over the data-parallel ranks in every training forward.

Read top-down: ``adapter.py`` (what an encoder's items are, and the registry; the built-in
adapters in ``models/``, one file per family), ``link.py`` (the zero that keeps every rank's
backward in the moves), ``plan.py`` (item costs and the plan, numpy), ``move.py`` (one encoder's
step: gather, plan, move in, encode, move back), ``balance.py`` (the handle that runs it inside
the model's forward).
"""

from .adapter import EncoderAdapter, Items, adapters_for, flops_linear, register_adapter, registered_adapters
from .balance import EncoderBalanceHandle, apply_encoder_balance, encoder_balance_of
from .link import ZeroLink
from .models.common import as_int, audio_out_len, core, embed_rows, image_attention_flops, pooled
from .plan import encoder_plan

__all__ = [
    "EncoderAdapter",
    "EncoderBalanceHandle",
    "Items",
    "ZeroLink",
    "adapters_for",
    "apply_encoder_balance",
    "as_int",
    "audio_out_len",
    "core",
    "embed_rows",
    "encoder_balance_of",
    "encoder_plan",
    "flops_linear",
    "image_attention_flops",
    "pooled",
    "register_adapter",
    "registered_adapters",
]
