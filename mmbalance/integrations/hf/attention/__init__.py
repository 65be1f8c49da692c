"""The ``"mmbalance_varlen"`` attention backend for transformers (``AttentionInterface``).

Read top-down: ``compile.py`` (planning outside ``torch.compile``'s graph, the plan cache), ``mask.py``
(transformers' mask functions read back into what the varlen op runs), ``plan.py`` (a call's
sequences turned into op calls, once per forward), ``backend.py`` (the attention function, its
registration, and the keyword through which a context-parallel shard runs a call's attention).
"""

from .backend import (
    CP_KEYWORD,
    add_block_keys,
    logit_features,
    register_attention,
    register_shard_attention,
    varlen_attention,
)
from .compile import FullgraphUnsupported, outside_graph
from .mask import ATTENTION_NAME, VarlenMask, varlen_mask
from .plan import BlockPlan

__all__ = [
    "ATTENTION_NAME",
    "BlockPlan",
    "CP_KEYWORD",
    "FullgraphUnsupported",
    "VarlenMask",
    "add_block_keys",
    "logit_features",
    "outside_graph",
    "register_attention",
    "register_shard_attention",
    "varlen_attention",
    "varlen_mask",
]
