"""What dynamic context parallelism needs to know of a vision-language model family
(:class:`VLMFamily`: its batch keys, feature streams, positions and bidirectional blocks), and the
helpers every family and the step share: placeholder counts to media (:func:`assign_media`), the
rows of an ``mm_encoder_outputs`` entry (:func:`entry_rows`) and their check
(:func:`check_feature_rows`). The families themselves are in :mod:`.families` (the Qwen-VL, GLM,
Omni and LLaVA kinds, and the lookup) and :mod:`.recent` (the families since Qwen3-VL)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from ..encoders import EncoderAdapter, pooled

__all__ = ["VLMFamily", "assign_media", "check_feature_rows", "entry_rows", "mrope_rows"]


class VLMFamily:
    """What the sharding needs to know about one family of vision-language models.

    Attributes:
        label: the family's name in messages.
        batch_keys: the batch keys of its processor besides ``input_ids``, ``attention_mask``,
            ``position_ids`` and ``labels``.
        mrope: its language model takes M-RoPE positions (``[4, 1, T]``) instead of ``[1, T]``.
    """

    label = ""
    batch_keys: frozenset[str] = frozenset()
    mrope = False
    #: streams the model takes no ``mm_encoder_outputs`` entry for: their rows reach the input
    #: embeddings through the handle's forward pre-hook (:func:`~.media.embed_streams`)
    embedded: frozenset[str] = frozenset()
    #: the batch key that carries each stream's media, for messages
    media_keys: Mapping[str, str] = {"image": "pixel_values", "video": "pixel_values_videos"}
    #: streams whose placeholder runs are bidirectional blocks (each token of an image sees the
    #: whole image: Gemma 3): the shard carries their spans (:attr:`~.shard.CPShard.blocks`) and
    #: ``token_type_ids`` (1 at their placeholders), from which the model builds its block mask
    block_streams: frozenset[str] = frozenset()
    #: every sequence's prefix (``token_type_ids`` 0 before its suffix: PaliGemma's image and
    #: prompt) is a bidirectional block (:meth:`prefix_lengths`)
    prefix_blocks = False
    #: ``pooler_output`` of a stream's ``mm_encoder_outputs`` entry as a tuple (the Qwen and LLaVA
    #: forwards concatenate it) or, ``False``, as one tensor ``[rows, hidden]`` (Gemma 3 reads it so)
    rows_in_tuple = True

    def streams(self, model) -> list[tuple[str, int]]:
        """``(mm_encoder_outputs key, placeholder token id)`` of every feature stream."""
        raise NotImplementedError

    def item_streams(self, adapter: EncoderAdapter, meta: np.ndarray) -> np.ndarray:
        """The stream (index into :meth:`streams`) of every item."""
        raise NotImplementedError

    def positions(
        self, model, batch: Mapping, ids: list[Tensor], kinds: list[np.ndarray], spans
    ) -> Tensor | None:
        """int64 ``[T, 3]``: the M-RoPE positions of every token, sequence by sequence (``None``
        for models without M-RoPE)."""
        return None

    def encoder_flops(self, model, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Forward FLOPs of encoding every item (float64 ``[n]``): by default the adapter's FLOP model."""
        return np.asarray(adapter.cost(model, meta, rows), dtype=np.float64)

    def check_batch(self, model, batch: Mapping, kinds: list[np.ndarray], spans) -> None:
        """Raise ValueError naming the key for an input the shard would not carry as the model
        reads it (``kinds``: every sequence's placeholder kinds, ``spans``: its ``(row, start,
        end)`` in the batch)."""

    @property
    def has_blocks(self) -> bool:
        """Its shards carry bidirectional blocks and give the model ``token_type_ids``."""
        return bool(self.block_streams) or self.prefix_blocks

    def prefix_lengths(self, model, batch: Mapping, kinds: list[np.ndarray], spans) -> np.ndarray:
        """int64, per sequence: the tokens of its bidirectional prefix (0 for families without)."""
        return np.zeros(len(kinds), dtype=np.int64)

    def block_keywords(self, model, input_ids: Tensor, in_block: Tensor) -> dict[str, Tensor]:
        """The keywords from which the model builds its block mask for a shard's tokens
        (``input_ids [1, T]``, ``in_block [T]``: whether each lies in a block): ``token_type_ids``
        1 inside (Gemma 3's images), or 0 inside for a family that marks its prefix so (PaliGemma)."""
        marks = ~in_block if self.prefix_blocks else in_block
        return {"token_type_ids": marks.long().reshape(1, -1).to(input_ids.device)}

    def item_order(self, model, batch: Mapping, kinds: list[np.ndarray], spans, items, rows: np.ndarray):
        """The order in which an adapter's ``items`` (``rows`` placeholder rows each, as extracted)
        meet their placeholders in the batch, where it differs from the extraction order (GLM's
        videos share the image placeholders: :class:`~.families._Glm`); ``None``: as extracted."""
        return None

    def token_keywords(self, model, input_ids: Tensor) -> dict[str, Tensor]:
        """Per-token keywords the model reads for a shard's tokens (``input_ids [1, T]``) besides
        its positions and blocks: Ernie-4.5-VL's experts by token kind; none by default."""
        return {}

    def entry(self, rows: Tensor, deepstack=None, stream: str = ""):
        """The ``mm_encoder_outputs`` entry of ``stream`` holding ``rows`` (and deepstack rows)."""
        return pooled((rows,) if self.rows_in_tuple else rows, deepstack)


def entry_rows(entry) -> Tensor:
    """The feature rows ``[rows, hidden]`` of an ``mm_encoder_outputs`` entry made by
    :meth:`VLMFamily.entry`."""
    out = entry.pooler_output
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.flatten(0, -2) if out.dim() > 2 else out  # [videos, rows, hidden]: LLaVA-OneVision's videos


def assign_media(sizes: np.ndarray, counts: np.ndarray, key: str, what: str) -> list[np.ndarray]:
    """Media (``sizes`` placeholder tokens each, in order of appearance) to sequences holding
    ``counts`` placeholders each: the indices of every sequence's media. Raises ValueError naming
    ``key`` when the counts do not add up or a medium would straddle two sequences."""
    ends = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    if int(ends[-1]) != int(bounds[-1]):
        raise ValueError(
            f"batch[{key!r}] gives {int(ends[-1])} {what} feature rows but input_ids holds {int(bounds[-1])} "
            f"{what} placeholder tokens (in its valid tokens)"
        )
    at = np.searchsorted(ends, bounds)
    if not np.array_equal(ends[np.minimum(at, ends.size - 1)], bounds):
        raise ValueError(
            f"batch[{key!r}]: the {what} placeholders of a sequence do not end where one of its {what}s ends "
            "(the media sizes do not match the placeholder tokens of input_ids)"
        )
    return [np.arange(at[s], at[s + 1], dtype=np.int64) for s in range(counts.size)]


def check_feature_rows(ids, streams, mm: Mapping) -> None:
    """Every placeholder stream of a shard (``(name, token id)`` pairs) got exactly one feature row
    per placeholder token in ``ids``; ``mm`` holds the rows by stream name, as the model reads them."""
    for name, token in streams:
        want = int((ids == token).sum())
        entry = mm.get(name)
        have = int(entry_rows(entry).shape[0]) if entry is not None else 0
        if want != have:
            raise AssertionError(
                f"the shard holds {want} {name} placeholders but {have} feature rows arrived"
            )


def mrope_rows(batch: Mapping, ids: list[Tensor], kinds: list[np.ndarray], spans, rope) -> Tensor:
    """int64 ``[T, 3]``: the M-RoPE positions of every token, sequence by sequence. A sequence
    without media counts up on all three rows; any other's come from ``rope(s, ids [1, n], types [1,
    n])`` (``[3, 1, n]``: the model's ``get_rope_index`` on the whole sequence), ``types`` its
    ``mm_token_type_ids`` from the batch, or as the processors write them: 1 at image placeholders,
    2 at video ones."""
    tt_all = batch.get("mm_token_type_ids")
    out = []
    with torch.no_grad():
        for s, (seq_ids, kind) in enumerate(zip(ids, kinds)):
            n = seq_ids.numel()
            if not bool((kind != 0).any()):
                out.append(torch.arange(n, dtype=torch.int64)[:, None].expand(n, 3))
                continue
            if tt_all is not None:
                r, a, z = spans[s]
                tt = torch.as_tensor(tt_all)[r, a:z].reshape(1, -1).cpu().to(torch.int32)
            else:
                tt = torch.from_numpy(kind.astype(np.int32)).reshape(1, -1)
            out.append(rope(s, seq_ids.reshape(1, -1), tt)[:, 0, :].t().to(torch.int64).cpu())
    return torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)
