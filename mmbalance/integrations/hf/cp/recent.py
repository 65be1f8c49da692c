"""The vision-language families since Qwen3-VL that dynamic context parallelism shards, besides the
Qwen-VL kind (GLM-4.xV) and the Omni thinkers (:mod:`.families`): Kimi-K2.5, Mistral 3, MiniCPM-V
4.6 and 4.7, MiniCPM-OCR, Gemma 3, Gemma 4, PaliGemma and LLaVA-OneVision (each a
:class:`~.family.VLMFamily`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..compat import forward_adds_video_newline
from ..encoders import as_int, core, image_attention_flops, pooled
from .family import VLMFamily, assign_media, mrope_rows
from .inputs import text_config

__all__ = [
    "GEMMA3",
    "GEMMA4",
    "KIMI",
    "MINICPMV",
    "MINICPMV47",
    "MISTRAL3",
    "ONEVISION",
    "PALIGEMMA",
    "recent_family",
]

KIMI = {"Kimi_K25ForConditionalGeneration": "Kimi-K2.5"}
MISTRAL3 = {"Mistral3ForConditionalGeneration": "Mistral 3"}
GEMMA3 = {"Gemma3ForConditionalGeneration": "Gemma 3"}
GEMMA4 = {"Gemma4ForConditionalGeneration": "Gemma 4"}
PALIGEMMA = {"PaliGemmaForConditionalGeneration": "PaliGemma"}
# a NaViT SigLIP tower, a Qwen3.5 (Gated DeltaNet) language model: its layers under a shard as Qwen3.5's
MINICPMV = {
    "MiniCPMV4_6ForConditionalGeneration": "MiniCPM-V 4.6",
    "MiniCPMOcrForConditionalGeneration": "MiniCPM-OCR",
}
# and MiniCPM-V 4.7, whose M-RoPE positions lay every image out on a canvas (get_rope_index)
MINICPMV47 = {"MiniCPMV4_7ForConditionalGeneration": "MiniCPM-V 4.7"}
# anyres images (an image's tiles packed into its rows where it is encoded) and pooled video frames
ONEVISION = {"LlavaOnevisionForConditionalGeneration": "LLaVA-OneVision"}


class _ImagesAndVideos(VLMFamily):
    """Images and videos at placeholder tokens of their own; an item's stream is the adapter's
    first metadata column (1 for a video's)."""

    def streams(self, model):
        cfg = model.config
        return [("image", int(cfg.image_token_id)), ("video", int(cfg.video_token_id))]

    def item_streams(self, adapter, meta):
        return meta[:, 0].astype(np.int64)  # the adapter's "video" column


class _Kimi(_ImagesAndVideos):
    """Kimi-K2.5: images and video clips (a clip's frames pooled into one frame's rows) through its
    ViT; 1-D positions (its DeepSeek-V3 language model has no M-RoPE)."""

    label = "Kimi-K2.5"
    batch_keys = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"})


class _Mistral3(VLMFamily):
    """Mistral 3: images at their own sizes through Pixtral (``image_sizes``), 1-D positions."""

    label = "Mistral 3"
    batch_keys = frozenset({"pixel_values", "image_sizes", "vision_feature_layer"})

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)


class _LlavaOnevision(_ImagesAndVideos):
    """LLaVA-OneVision: an image with its tiles (its rows packed, anyres and newlines, on the rank
    that encodes it) and video frames (pooled, a video's newline row with its last frame), 1-D
    positions. Before ``mm_encoder_outputs`` the forward appends each video's newline to the rows
    it is given, which a shard holding part of a video cannot take: videos are refused there."""

    label = "LLaVA-OneVision"
    batch_keys = frozenset({"pixel_values", "image_sizes", "pixel_values_videos", "batch_num_images",
                            "vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio"})  # fmt: skip

    def check_batch(self, model, batch, kinds, spans):
        if batch.get("pixel_values_videos") is not None and forward_adds_video_newline(model):
            raise ValueError(
                "batch['pixel_values_videos']: the installed transformers' LLaVA-OneVision forward (before "
                "mm_encoder_outputs) appends a newline row to each video's rows, which a shard holding part of a "
                "video cannot take; "
                "handle.shard splits its videos from the release with mm_encoder_outputs (5.19 in the tested ones)"
            )

    def encoder_flops(self, model, adapter, meta, rows):
        cfg = core(model).vision_tower.config
        per_tile = image_attention_flops(
            cfg, np.array([(as_int(cfg.image_size) // as_int(cfg.patch_size)) ** 2])
        )
        return meta[:, 1].astype(np.float64) * float(per_tile[0])

    def entry(self, rows, deepstack=None, stream=""):
        # its forward reads a video entry as [videos, rows, hidden] and flattens it
        return pooled(rows[None] if stream == "video" else (rows,), deepstack)


class _MiniCPMV(_ImagesAndVideos):
    """MiniCPM-V 4.6 and MiniCPM-OCR: every slice of an image or a video frame through their NaViT
    tower (``target_sizes``), 1-D positions (their Qwen3.5 language model repeats them on its M-RoPE
    rows)."""

    batch_keys = frozenset({"pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos",
                            "downsample_mode"})  # fmt: skip

    def __init__(self, cls_name: str):
        self.label = {**MINICPMV, **MINICPMV47}[cls_name]


class _MiniCPMV47(_MiniCPMV):
    """MiniCPM-V 4.7: MiniCPM-V 4.6's tower and language model, with M-RoPE positions that lay each
    image (its thumbnail and crops) and each video frame out on a canvas, from ``get_rope_index``
    over the whole sequence (``mm_token_type_ids`` and the crops' ``target_sizes``)."""

    mrope = True
    batch_keys = _MiniCPMV.batch_keys | {"mm_token_type_ids"}

    def positions(self, model, batch, ids, kinds, spans):
        mode = batch.get("downsample_mode") or model.config.downsample_mode
        merge = 2 if mode == "4x" else 4  # patches a side per token, as get_rope_index counts them
        sizes = {}
        for col, (name, key) in enumerate((("image", "target_sizes"), ("video", "target_sizes_videos"))):
            counts = np.array([int((k == col + 1).sum()) for k in kinds], dtype=np.int64)
            got = batch.get(key)
            if got is None and int(counts.sum()):
                raise ValueError(
                    f"input_ids holds {int(counts.sum())} {name} placeholder tokens but the batch has no {key}"
                )
            got = (
                torch.zeros(0, 2, dtype=torch.long)
                if got is None
                else torch.as_tensor(got).reshape(-1, 2).cpu()
            )
            rows = ((got[:, 0] // merge) * (got[:, 1] // merge)).long().numpy()
            sizes[name] = (got.long(), assign_media(rows, counts, key, name))

        owner: Any = core(model)

        def rope(s: int, seq: Tensor, tt: Tensor) -> Tensor:
            img, vid = (sizes[k][0][sizes[k][1][s]] for k in ("image", "video"))
            return owner.get_rope_index(
                seq,
                mm_token_type_ids=tt,
                target_sizes=img if img.shape[0] else None,
                target_sizes_videos=vid if vid.shape[0] else None,
                downsample_mode=mode,
            )[0]

        return mrope_rows(batch, ids, kinds, spans, rope)


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


class _Gemma4(_ImagesAndVideos):
    """Gemma 4: images and video frames at their own sizes through its ViT, 1-D positions; where
    its text config says ``use_bidirectional_attention="vision"`` each run of vision tokens is a
    bidirectional block in its sliding layers (``mm_token_type_ids``: 1 image, 2 video)."""

    label = "Gemma 4"
    batch_keys = frozenset({"pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids",
                            "num_frames_per_video", "mm_token_type_ids"})  # fmt: skip

    def __init__(self, model):
        bidirectional = getattr(text_config(model), "use_bidirectional_attention", None) == "vision"
        self.block_streams = frozenset({"image", "video"}) if bidirectional else frozenset()

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


def recent_family(model, cls_name: str) -> VLMFamily | None:
    """The family of ``model`` if ``cls_name`` (a class along its MRO) is one of this module's, else
    ``None``; a Gemma 4 built without its towers is a text model (``None`` as well)."""
    if cls_name in KIMI:
        return _Kimi()
    if cls_name in MISTRAL3:
        return _Mistral3()
    if cls_name in GEMMA3:
        return _Gemma3()
    if cls_name in GEMMA4:
        return _Gemma4(model) if getattr(model.config, "vision_config", None) is not None else None
    if cls_name in PALIGEMMA:
        return _PaliGemma()
    if cls_name in MINICPMV:
        return _MiniCPMV(cls_name)
    if cls_name in MINICPMV47:
        return _MiniCPMV47(cls_name)
    if cls_name in ONEVISION:
        return _LlavaOnevision()
    return None
