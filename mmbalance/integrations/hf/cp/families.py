"""Dynamic context parallelism for multimodal models: :meth:`DynamicCPHandle.shard` on the
batches their processors give (images, videos, audio clips), for Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, GLM-4.1V/4.6V, Kimi-K2.5, Mistral 3, Gemma 3, Gemma 4, PaliGemma, MiniCPM-V 4.6, LLaVA
and the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (images and videos). This module holds the model families (batch
keys, feature streams, M-RoPE positions, encoder FLOPs, the streams placed into the input
embeddings) and the encoder cost (a group plans with its members' share of it,
:func:`~mmbalance.balancing.cp_schedule`'s ``encoder_seconds``); the numpy side of a
step is in :mod:`.vlm_plan`, the step itself (:func:`~.vlm_step.shard_vlm`)
in :mod:`.vlm_step`, the Trainer's collator side in :mod:`.vlm_cut` and the hooks in :mod:`.media`.

One step, on every rank (every decision from gathered facts, so identical everywhere):

1. The batch is cut into sequences (:func:`~.inputs.split_sequences`). The M-RoPE positions
   of every sequence come from the model's own ``get_rope_index`` over the whole sequence, before
   anything is split; they travel with the tokens, so every shard has exactly the positions the
   unsplit sequence gives its tokens.
2. The media become encoder items (the adapters of ``encoders/models/``: an image, one frame of a video
   for the Qwen ViTs, an image for LLaVA) and are matched to their sequences by placeholder count.
3. One gather of a small integer table: per sequence its tokens (vision tokens included) and
   labelled tokens, per item its sequence, stream (image or video), input and output rows and
   metadata, per sequence the run-length code of its placeholder tokens. Every rank then computes
   the same plan: CP groups under ``max_tokens_per_rank`` (:func:`~.plan.plan_layout`),
   the zigzag pieces, and an encoding rank for every item:

   * with :func:`~mmbalance.integrations.hf.encoders.apply_encoder_balance` on the same model: the encoder balancing's own
     plan over the whole world (its cost, ``ranks_per_node`` and ``split_frames``);
   * without it: each CP group encodes its own sequences' items, spread over its members
     (longest-processing-time first on the items' encoder cost; video frames are items).

4. Three all-to-alls: the token columns (ids, labels, shifted labels, text and M-RoPE positions)
   to the ranks of their pieces; the encoder inputs to their encoding ranks; and, after one
   encoder call per rank, the feature rows straight to the ranks that hold their placeholder
   tokens: OrchMLLM's rearrangement composition (``plan_LLM o plan_encoder^-1``, section 6), so no
   feature returns to its source first. An item whose placeholder tokens straddle two shards is
   cut at the boundary. Backward sends the features' gradients back along the same move (one
   all-to-all) to the rank that encoded them. Without encoder balancing the feature rows never
   leave their CP group, so they move over the group's own process group (none for a group of
   one): a group starts its LLM phase when its members have encoded, not when the whole world has.
5. The shard's keywords give the features through the model's own hook (``mm_encoder_outputs``,
   in the order of the shard's placeholder tokens) and ``position_ids`` ``[4, 1, T]`` (each
   token's position in its own sequence, then the three M-RoPE rows: the layout the Qwen text
   models read; LLaVA takes ``[1, T]``). The Omni thinker reads audio only from
   ``input_features``: its audio rows ride in ``mm_encoder_outputs["audio"]`` and a forward
   pre-hook the handle puts on the model (:func:`~.media.embed_streams`; in Trainer and under FSDP2, the
   media hook) places them into the input embeddings at the audio placeholders before the
   thinker runs.

Under FSDP2 (``fully_shard``), which gathers a unit's weights only once the root's forward has
begun, step 4 stops after the encoder inputs' move: the encoder call and the feature move run in
the model's forward, from the :class:`~.vlm_plan.PendingMedia` the shard carries
(the Trainer's media hook, which FSDP2's own pre-hook precedes), over the group's process group
or, with encoder balancing, over the world's.

Every image and frame is encoded exactly once in the world. A rank with nothing to encode (for an
encoder that has items somewhere) encodes one tiny stand-in item, so every rank runs the encoder
once and DDP/FSDP see the same calls; its output, and every rank's received features, feed a zero
that the shard's attention adds (:attr:`CPShard.anchor`), so every rank's backward reaches the
feature all-to-all.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import CostModel

from ..encoders import EncoderAdapter, adapters_for, as_int, audio_out_len, core, flops_linear, pooled
from ..wrappers import wrapper_hint
from .inputs import ffn_size, text_config

__all__ = [
    "SUPPORTED",
    "VLMFamily",
    "assign_media",
    "entry_rows",
    "check_feature_rows",
    "encoder_seconds",
    "vlm_family",
]

_QWEN = {
    "Qwen2VLForConditionalGeneration": "Qwen2-VL",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
    "Qwen3VLForConditionalGeneration": "Qwen3-VL",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE",
    # Gated DeltaNet language models (their layers under a shard: linear.py), Qwen3-VL's tower
    "Qwen3_5ForConditionalGeneration": "Qwen3.5",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5-MoE",
}
_LLAVA = {"LlavaForConditionalGeneration": "LLaVA"}
_OMNI = {"Qwen2_5OmniThinkerForConditionalGeneration": "Qwen2.5-Omni thinker"}
_OMNI3 = {"Qwen3OmniMoeThinkerForConditionalGeneration": "Qwen3-Omni-MoE thinker"}
# GLM-4.1V and GLM-4.6V (images; GLM-4.5V's language model runs packed rows wrong: mixers.py)
_GLM = {"Glm4vForConditionalGeneration": "GLM-4.1V", "Glm46VForConditionalGeneration": "GLM-4.6V"}
_KIMI = {"Kimi_K25ForConditionalGeneration": "Kimi-K2.5"}
_MISTRAL3 = {"Mistral3ForConditionalGeneration": "Mistral 3"}
_GEMMA3 = {"Gemma3ForConditionalGeneration": "Gemma 3"}
_GEMMA4 = {"Gemma4ForConditionalGeneration": "Gemma 4"}
_PALIGEMMA = {"PaliGemmaForConditionalGeneration": "PaliGemma"}
# a NaViT SigLIP tower, a Qwen3.5 (Gated DeltaNet) language model: its layers under a shard as Qwen3.5's
_MINICPMV = {"MiniCPMV4_6ForConditionalGeneration": "MiniCPM-V 4.6"}
#: the multimodal model classes ``apply_dynamic_cp`` shards (text decoders work as they are)
SUPPORTED: tuple[str, ...] = (
    tuple(_QWEN)
    + tuple(_LLAVA)
    + tuple(_OMNI)
    + tuple(_OMNI3)
    + tuple(_GLM)
    + tuple(_KIMI)
    + tuple(_MISTRAL3)
    + tuple(_GEMMA3)
    + tuple(_GEMMA4)
    + tuple(_PALIGEMMA)
    + tuple(_MINICPMV)
)
#: vision-language models ``apply_dynamic_cp`` refuses with the reason (their encoders may be balanced)
NOT_SHARDED = {
    "Glm4vMoeForConditionalGeneration": "transformers' GLM-4.5V language model runs packed rows into one "
    "another under every attention, and a CP shard is a packed row",
    "LlavaOnevisionForConditionalGeneration": "an image's rows come from packing all its tiles together "
    "(anyres unpadding and newlines), so its tiles cannot be encoded where the rows are needed",
}
# a FLOP rate to turn encoder FLOPs into the seconds of the "quadratic" cost (CostModel.transformer)
_FLOPS = 400e12


# --------------------------------------------------------------------------------- the families
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

    def entry(self, rows: Tensor, deepstack=None):
        """A stream's ``mm_encoder_outputs`` entry holding ``rows`` (and deepstack rows)."""
        return pooled((rows,) if self.rows_in_tuple else rows, deepstack)


def entry_rows(entry) -> Tensor:
    """The feature rows ``[rows, hidden]`` of an ``mm_encoder_outputs`` entry made by
    :meth:`VLMFamily.entry`."""
    out = entry.pooler_output
    return out[0] if isinstance(out, (tuple, list)) else out


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


class _Qwen(VLMFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE: images and videos
    through the Qwen ViT, M-RoPE positions from ``get_rope_index``."""

    mrope = True

    def __init__(self, cls_name: str):
        self.label = _QWEN.get(cls_name) or _GLM[cls_name]
        keys = {
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "mm_token_type_ids",
        }
        if cls_name.startswith("Qwen2_5"):
            keys.add("second_per_grid_ts")
        self.batch_keys = frozenset(keys)

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column

    def positions(self, model, batch, ids, kinds, spans):
        c = core(model)
        grids = _grids(batch, kinds, int(c.visual.spatial_merge_size) ** 2)
        seconds = batch.get("second_per_grid_ts")
        tt_all = batch.get("mm_token_type_ids")
        rope = c.get_rope_index
        takes_seconds = "second_per_grid_ts" in inspect.signature(rope).parameters
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
                else:  # as the processor writes it: 1 at image placeholders, 2 at video ones
                    tt = torch.from_numpy(kind.astype(np.int32)).reshape(1, -1)
                img, vid = grids["image"][0][grids["image"][1][s]], grids["video"][0][grids["video"][1][s]]
                kw = {
                    "mm_token_type_ids": tt,
                    "image_grid_thw": img if img.shape[0] else None,
                    "video_grid_thw": vid if vid.shape[0] else None,
                    "attention_mask": None,
                }
                if takes_seconds and seconds is not None and vid.shape[0]:
                    kw["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[grids["video"][1][s]]
                pos, _ = rope(seq_ids.reshape(1, -1), **kw)
                out.append(pos[:, 0, :].t().to(torch.int64).cpu())
        return torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)


class _Glm(_Qwen):
    """GLM-4.1V and GLM-4.6V: images through their Qwen-style ViT, M-RoPE positions from
    ``get_rope_index`` (which reads ``mm_token_type_ids``). Their videos' placeholders are image
    tokens (only ``mm_token_type_ids`` tells them apart), which the shard's placeholder streams do not
    follow yet: a batch with videos is refused by name."""

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def positions(self, model, batch, ids, kinds, spans):
        if batch.get("pixel_values_videos") is not None:
            raise ValueError(
                f"batch['pixel_values_videos']: handle.shard does not split {self.label} videos (their placeholders "
                "are image tokens that only mm_token_type_ids tells apart); train videos without dynamic CP"
            )
        return super().positions(model, batch, ids, kinds, spans)


class _Kimi(VLMFamily):
    """Kimi-K2.5: images and video clips (a clip's frames pooled into one frame's rows) through its
    ViT; 1-D positions (its DeepSeek-V3 language model has no M-RoPE)."""

    label = "Kimi-K2.5"
    batch_keys = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"})

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column


class _Mistral3(VLMFamily):
    """Mistral 3: images at their own sizes through Pixtral (``image_sizes``), 1-D positions."""

    label = "Mistral 3"
    batch_keys = frozenset({"pixel_values", "image_sizes", "vision_feature_layer"})

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)


class _MiniCPMV(VLMFamily):
    """MiniCPM-V 4.6: every slice of an image or a video frame through its NaViT tower
    (``target_sizes``), 1-D positions (its Qwen3.5 language model repeats them on its M-RoPE rows)."""

    label = "MiniCPM-V 4.6"
    batch_keys = frozenset({"pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos",
                            "downsample_mode"})  # fmt: skip

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column


class _Gemma3(VLMFamily):
    """Gemma 3: one SigLIP tile per image (pan-and-scan crops are images of their own), 1-D
    positions, and each image's tokens a bidirectional block (``token_type_ids``): the shard
    carries the blocks' spans and gives the model ``token_type_ids`` for its own tokens."""

    label = "Gemma 3"
    batch_keys = frozenset({"pixel_values", "token_type_ids"})
    block_streams = frozenset({"image"})
    rows_in_tuple = False

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)

    def check_batch(self, model, batch, kinds, spans):
        tt = batch.get("token_type_ids")
        if tt is None:
            if any(bool((k == 1).any()) for k in kinds):
                raise ValueError(
                    "batch['token_type_ids'] is missing: Gemma 3 runs its images as bidirectional blocks only with "
                    "it (its processor gives it), and handle.shard gives the shards the blocks the batch asks for"
                )
            return
        tt = torch.as_tensor(tt).cpu()
        for s, (r, a, z) in enumerate(spans):
            if not torch.equal(tt[r, a:z].ne(0), torch.from_numpy(kinds[s] == 1)):
                raise ValueError(
                    f"batch['token_type_ids'] of sequence {s} is not 1 exactly at its image tokens (the blocks "
                    "Gemma 3's mask widens); handle.shard gives the model token_type_ids of its own images"
                )


class _Gemma4(VLMFamily):
    """Gemma 4: images and video frames at their own sizes through its ViT, 1-D positions; where
    its text config says ``use_bidirectional_attention="vision"`` each run of vision tokens is a
    bidirectional block in its sliding layers (``mm_token_type_ids``: 1 image, 2 video)."""

    label = "Gemma 4"
    batch_keys = frozenset({"pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids",
                            "num_frames_per_video", "mm_token_type_ids"})  # fmt: skip

    def __init__(self, model):
        bidirectional = getattr(text_config(model), "use_bidirectional_attention", None) == "vision"
        self.block_streams = frozenset({"image", "video"}) if bidirectional else frozenset()

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column

    def check_batch(self, model, batch, kinds, spans):
        tt = batch.get("mm_token_type_ids")
        if tt is None:
            if self.block_streams and any(bool((k > 0).any()) for k in kinds):
                raise ValueError(
                    "batch['mm_token_type_ids'] is missing: Gemma 4 runs its images and frames as bidirectional "
                    "blocks only with it (its processor gives it), and handle.shard gives the shards the blocks "
                    "the batch asks for"
                )
            return
        tt = torch.as_tensor(tt).cpu()
        for s, (r, a, z) in enumerate(spans):
            if not torch.equal(tt[r, a:z].long(), torch.from_numpy(kinds[s])):
                raise ValueError(
                    f"batch['mm_token_type_ids'] of sequence {s} is not 1 exactly at its image tokens and 2 at its "
                    "video tokens (the blocks Gemma 4's mask widens)"
                )

    def block_keywords(self, model, input_ids, in_block):
        cfg = model.config
        types = (input_ids == int(cfg.image_token_id)).long() + 2 * (
            input_ids == int(cfg.video_token_id)
        ).long()
        return {"mm_token_type_ids": types}


class _PaliGemma(VLMFamily):
    """PaliGemma: one SigLIP tile per image, 1-D positions, and every sequence's prefix (its
    images and prompt, ``token_type_ids`` 0) a bidirectional block before its causal suffix."""

    label = "PaliGemma"
    batch_keys = frozenset({"pixel_values", "token_type_ids"})
    prefix_blocks = True
    rows_in_tuple = False

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)

    def prefix_lengths(self, model, batch, kinds, spans):
        tt = batch.get("token_type_ids")
        if tt is None:
            if any(bool((k == 1).any()) for k in kinds):
                raise ValueError(
                    "batch['token_type_ids'] is missing: PaliGemma's prefix (images and prompt) attends both ways "
                    "only with it (its processor gives it with a suffix), and handle.shard gives the shards the "
                    "prefix the batch asks for"
                )
            return np.zeros(len(kinds), dtype=np.int64)
        tt = torch.as_tensor(tt).cpu()
        out = np.zeros(len(kinds), dtype=np.int64)
        for s, (r, a, z) in enumerate(spans):
            row = tt[r, a:z].ne(0).numpy()
            n = int(np.argmax(row)) if row.any() else row.size  # the leading zeros: the prefix
            if row[n:].size and not row[n:].all():
                raise ValueError(
                    f"batch['token_type_ids'] of sequence {s} has 0s after its suffix began: PaliGemma's "
                    "bidirectional prefix must come first (0s, then 1s)"
                )
            out[s] = n
        return out


def _grids(batch: Mapping, kinds: list[np.ndarray], merge2: int) -> dict:
    """Per vision stream (kinds 1 and 2), the batch's ``*_grid_thw`` rows and the rows of every
    sequence's media; raises ValueError naming the keys when placeholders have no media."""
    grids = {}
    for col, (name, key) in enumerate((("image", "image_grid_thw"), ("video", "video_grid_thw"))):
        counts = np.array([int((k == col + 1).sum()) for k in kinds], dtype=np.int64)
        g = batch.get(key)
        if g is None and int(counts.sum()):
            raise ValueError(
                f"input_ids holds {int(counts.sum())} {name} placeholder tokens but the batch has no "
                f"{VLMFamily.media_keys[name]} and {key}"
            )
        g = (
            torch.zeros(0, 3, dtype=torch.long)
            if g is None
            else torch.as_tensor(g).reshape(-1, 3).cpu().long()
        )
        grids[name] = (g, assign_media(g.prod(-1).numpy() // merge2, counts, key, name))
    return grids


class _QwenOmni(VLMFamily):
    """The Qwen2.5-Omni thinker: images and videos through its Qwen ViT, audio clips through its
    audio tower, M-RoPE positions from its ``get_rope_index``. The thinker reads image and video
    rows from ``mm_encoder_outputs`` but audio only from ``input_features``: the shard's audio rows
    reach the input embeddings at its audio placeholders instead (:func:`~.media.embed_streams`)."""

    label = "Qwen2.5-Omni thinker"
    mrope = True
    embedded = frozenset({"audio"})
    media_keys = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}
    batch_keys = frozenset(
        {
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "video_second_per_grid",
            "input_features",
            "feature_attention_mask",
            "use_audio_in_video",
        }
    )

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id)),
                ("audio", int(cfg.audio_token_id))]  # fmt: skip

    def item_streams(self, adapter, meta):
        if adapter.encoder == "audio":
            return np.full(meta.shape[0], 2, dtype=np.int64)
        return meta[:, 0].astype(np.int64)  # the vision adapter's "video" column

    def positions(self, model, batch, ids, kinds, spans):
        if batch.get("use_audio_in_video"):
            raise NotImplementedError(
                "batch['use_audio_in_video']: handle.shard does not interleave a video's audio with its frames "
                "(mmbalance_varlen dynamic CP takes the audio of a video as a clip of its own)"
            )
        c = core(model)
        grids = _grids(batch, kinds, int(c.visual.spatial_merge_size) ** 2)
        counts = np.array([int((k == 3).sum()) for k in kinds], dtype=np.int64)
        mask = batch.get("feature_attention_mask")
        if mask is None and int(counts.sum()):
            raise ValueError(
                f"input_ids holds {int(counts.sum())} audio placeholder tokens but the batch has no input_features "
                "and feature_attention_mask"
            )
        frames = (
            np.zeros(0, dtype=np.int64)
            if mask is None
            else torch.as_tensor(mask).sum(-1).cpu().numpy().astype(np.int64).reshape(-1)
        )
        clips = assign_media(audio_out_len(frames), counts, "input_features", "audio")
        seconds = batch.get("video_second_per_grid")
        out = []
        with torch.no_grad():
            for s, seq_ids in enumerate(ids):
                n = seq_ids.numel()
                img, vid = grids["image"][0][grids["image"][1][s]], grids["video"][0][grids["video"][1][s]]
                if not (img.shape[0] or vid.shape[0]):  # text and audio: the positions count up
                    out.append(torch.arange(n, dtype=torch.int64)[:, None].expand(n, 3))
                    continue
                if vid.shape[0] and seconds is None:
                    raise ValueError(
                        "batch['video_second_per_grid']: the thinker's video positions need it (the processor "
                        "gives it with pixel_values_videos)"
                    )
                per = torch.as_tensor(seconds).reshape(-1)[grids["video"][1][s]] if vid.shape[0] else None
                pos, _ = c.get_rope_index(
                    seq_ids.reshape(1, -1),
                    img if img.shape[0] else None,
                    vid if vid.shape[0] else None,
                    torch.ones(1, n, dtype=torch.long),  # (the Qwen3-Omni thinker reads it)
                    False,
                    torch.from_numpy(frames[clips[s]]),
                    per,
                )
                pos = pos[:, 0, :].t().cpu()
                if pos.is_floating_point() and not bool((pos == pos.round()).all()):
                    raise ValueError(
                        f"batch['video_second_per_grid'] of sequence {s} gives {self.label} fractional M-RoPE "
                        "positions (seconds per grid x position_id_per_seconds), which the shards carry as integers"
                    )
                out.append(pos.round().to(torch.int64))
        return torch.cat(out) if out else torch.zeros(0, 3, dtype=torch.int64)


class _Qwen3Omni(_QwenOmni):
    """The Qwen3-Omni-MoE thinker: images and videos through its Qwen3-VL tower (deepstack rows
    included), M-RoPE positions from its ``get_rope_index``. Its audio tower stays with the
    thinker (its gradients depend on which clips share a call: ``encoders/models/qwen_omni.py``),
    so a batch with audio is refused by name."""

    label = "Qwen3-Omni-MoE thinker"
    embedded = frozenset()
    media_keys = {"image": "pixel_values", "video": "pixel_values_videos"}
    batch_keys = frozenset(
        {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid"}
    )

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def check_batch(self, model, batch, kinds, spans):
        ids = batch.get("input_ids")
        if ids is not None and bool((torch.as_tensor(ids) == int(model.config.audio_token_id)).any()):
            raise ValueError(
                "batch['input_ids'] holds audio placeholders: handle.shard does not carry the Qwen3-Omni thinker's "
                "audio into split sequences (its audio tower's gradients depend on which clips share a call); "
                "train audio without dynamic CP"
            )


class _Llava(VLMFamily):
    """LLaVA (1.5): one CLIP tile per image, projector outputs at the image placeholders."""

    label = "LLaVA"
    batch_keys = frozenset(
        {"pixel_values", "vision_feature_layer", "vision_feature_select_strategy", "image_sizes"}
    )

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)

    def encoder_flops(self, model, adapter, meta, rows):
        cfg = core(model).vision_tower.config
        hidden = int(cfg.hidden_size)
        tokens = (as_int(cfg.image_size) // as_int(cfg.patch_size)) ** 2 + 1
        per = int(cfg.num_hidden_layers) * (flops_linear(hidden, int(cfg.intermediate_size)) * tokens
                                            + 4.0 * hidden * tokens * tokens)  # fmt: skip
        return np.full(meta.shape[0], per, dtype=np.float64)


def vlm_family(model) -> VLMFamily | None:
    """The family of ``model`` if it is a supported vision-language model, ``None`` for a text
    model; raises ValueError naming the class, with the supported list, for any other multimodal
    model. The class is looked up along its MRO, as the encoder adapters match it: FSDP2's
    ``fully_shard`` (``FSDP<Name>``) and a user's subclass keep their family."""
    name = type(model).__name__
    for cls in type(model).__mro__:
        if cls.__name__ in _QWEN:
            return _Qwen(cls.__name__)
        if cls.__name__ in _LLAVA:
            return _Llava()
        if cls.__name__ in _OMNI:
            return _QwenOmni()
        if cls.__name__ in _OMNI3:
            return _Qwen3Omni()
        if cls.__name__ in _GLM:
            return _Glm(cls.__name__)
        if cls.__name__ in _KIMI:
            return _Kimi()
        if cls.__name__ in _MISTRAL3:
            return _Mistral3()
        if cls.__name__ in _GEMMA3:
            return _Gemma3()
        if cls.__name__ in _GEMMA4:  # built without its towers (vision_config None): a text model
            return _Gemma4(model) if getattr(model.config, "vision_config", None) is not None else None
        if cls.__name__ in _PALIGEMMA:
            return _PaliGemma()
        if cls.__name__ in _MINICPMV:
            return _MiniCPMV()
    for cls in type(model).__mro__:
        if cls.__name__ in NOT_SHARDED:
            raise ValueError(
                f"model: apply_dynamic_cp does not shard {name}{wrapper_hint(model)}: {NOT_SHARDED[cls.__name__]}"
            )
    config = getattr(model, "config", None)
    multimodal = any(
        getattr(config, key, None) is not None for key in ("vision_config", "audio_config", "thinker_config")
    )
    if multimodal or adapters_for(model):
        raise ValueError(
            f"model: apply_dynamic_cp does not shard {name}{wrapper_hint(model)} (its media would not reach the "
            f"shards); supported multimodal models: {', '.join(SUPPORTED)}; text decoders (Llama, Qwen2, Qwen3, "
            "...) work as they are"
        )
    return None


def encoder_seconds(
    handle, family: VLMFamily, adapter: EncoderAdapter, meta: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """Modelled seconds (forward + backward) of encoding every item, in the units of the handle's
    cost: ``encoder_cost`` when it is a callable, else the family's FLOP model at the LLM cost's
    rate per FLOP (``cost.linear / (6 * LLM parameters)``, which is ``1 / 400e12`` for the
    default ``"quadratic"`` cost)."""
    if callable(handle.encoder_cost):
        out = np.asarray(handle.encoder_cost(adapter.encoder, meta, rows), dtype=np.float64).reshape(-1)
        if out.shape != rows.shape or not np.all(np.isfinite(out)) or np.any(out < 0):
            raise ValueError(
                f"encoder_cost must give one finite time >= 0 per {adapter.encoder} item, got {out!r}"
            )
        return out
    flops = 3.0 * family.encoder_flops(handle.model, adapter, meta, rows)
    cost = handle.cost
    per_flop = (
        cost.linear / (6.0 * _llm_params(handle.model)) if isinstance(cost, CostModel) else 1.0 / _FLOPS
    )
    return flops * per_flop


def _llm_params(model) -> float:
    text = text_config(model)
    h = int(getattr(text, "hidden_size", 4096) or 4096)
    heads = int(getattr(text, "num_attention_heads", 32) or 32)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    kv = int(getattr(text, "num_key_value_heads", heads) or heads) * head_dim
    ffn = ffn_size(text) or 3.5 * h
    layers = int(getattr(text, "num_hidden_layers", 32) or 32)
    return max(layers * (2.0 * h * h + 2.0 * h * kv + 3.0 * h * ffn), 1.0)
