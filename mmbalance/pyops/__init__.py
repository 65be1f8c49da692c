"""``torch.library`` custom ops, namespace ``torch.ops.mmbalance`` (``mmbalance.pyops``).

Importing this package registers every op.
"""

from .varlen import (
    cu_seqlens_from_lengths,
    gathered_cu_seqlens,
    inverse_permutation,
    pack,
    position_ids_from_cu_seqlens,
    segment_gather,
    segment_ids_from_cu_seqlens,
    segment_scatter,
    unpack,
)

__all__ = [
    "pack",
    "unpack",
    "segment_gather",
    "segment_scatter",
    "cu_seqlens_from_lengths",
    "position_ids_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "gathered_cu_seqlens",
    "inverse_permutation",
]

# attention block ops (registers mmbalance::attention_block_fwd/_bwd and merge_attention_states)
from .attention_ops import attention_block, attention_block_backward, merge_attention_states  # noqa: E402, F401
