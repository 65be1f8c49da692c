"""``torch.library`` custom ops, namespace ``torch.ops.mmbalance`` (``mmbalance.pyops``).

Importing this package registers every op. Its names are the varlen ops' (``pyops.varlen.__all__``)
and the attention blocks' public functions.
"""

from . import varlen
from .attention_ops import attention_block, attention_block_backward, merge_attention_states
from .varlen import *  # noqa: F403 - exactly varlen.__all__

__all__ = [*varlen.__all__, "attention_block", "attention_block_backward", "merge_attention_states"]
