"""Dynamic context parallelism of any degree (``apply_dynamic_cp``; DHP, OrchMLLM's LLM phase).

Read in the order the data flows: ``inputs.py`` and ``shard.py`` (a batch read into sequences; what
a rank holds), ``families.py`` (the multimodal models: media, positions, encoder cost), then the
numpy planning (``plan.py``, ``slots.py``, ``vlm_plan.py``, and without communication ``vlm_cut.py``,
``collate.py``, ``stream.py`` for Trainer's data side), the moves (``step.py``, ``vlm_step.py``, ``stream_step.py``),
the hooks in the model (``attention.py``: a shard's ring; ``media.py``: the media the forward
encodes), and on top the handle (``handle.py``).
"""

from .attention import install_attention_check, model_refusal  # importing it registers the shard's attention
from .collate import CPBatchSampler, CPCollator, SlotMeta, TaggedDataset
from .families import SUPPORTED, vlm_family
from .handle import DynamicCPHandle, apply_dynamic_cp, make_handle
from .inputs import layer_mix, pad_id, split_sequences, text_config
from .media import install_media_hook
from .plan import cost_model_of, plan_layout
from .shard import CPShard
from .stream import RankSlice, StreamLoader
from .stream_step import raw_rows
from .vlm_cut import GroupCutter

__all__ = [
    "SUPPORTED", "CPBatchSampler", "CPCollator", "CPShard", "DynamicCPHandle", "GroupCutter", "RankSlice",
    "SlotMeta", "StreamLoader", "TaggedDataset", "apply_dynamic_cp", "cost_model_of", "install_attention_check", "install_media_hook",
    "layer_mix", "make_handle", "model_refusal", "pad_id", "plan_layout", "raw_rows", "split_sequences", "text_config",
    "vlm_family",
]  # fmt: skip
