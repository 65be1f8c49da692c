"""``torch.library`` custom ops, namespace ``torch.ops.mmbalance`` (``mmbalance.pyops``).

Importing this package registers every op. Its names are the varlen ops' (``pyops.varlen.__all__``),
the attention blocks' public functions and the gated delta rule's state hand-off
(``pyops.delta_rule``).
"""

from . import varlen
from .attention_ops import attention_block, attention_block_backward, merge_attention_states
from .delta_rule import compose_chunk_states, delta_rule_chunk_state
from .varlen import *  # noqa: F403 - exactly varlen.__all__

__all__ = [
    *varlen.__all__,
    "attention_block",
    "attention_block_backward",
    "merge_attention_states",
    "delta_rule_chunk_state",
    "compose_chunk_states",
]
