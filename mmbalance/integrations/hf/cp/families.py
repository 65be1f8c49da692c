"""Dynamic context parallelism for multimodal models: :meth:`DynamicCPHandle.shard` on the
batches their processors give (images, videos, audio clips), for Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5, GLM-4.1V/4.6V, Ernie-4.5-VL, LLaVA and the Qwen2.5-Omni and Qwen3-Omni-MoE thinkers
(images and videos), and the families of :mod:`.recent` (Kimi-K2.5, Mistral 3, MiniCPM-V 4.6/4.7,
MiniCPM-OCR, Gemma 3, Gemma 4, PaliGemma). This module holds those model families (batch keys,
feature streams, M-RoPE positions, encoder FLOPs, the streams placed into the input embeddings;
what a family declares: :class:`~.family.VLMFamily`), the lookup (:func:`vlm_family`) and the
encoder cost (a group plans with its members' share of it,
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
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mmbalance.balancing import CostModel

from ..encoders import EncoderAdapter, adapters_for, as_int, audio_out_len, core, flops_linear
from ..wrappers import wrapper_hint
from .family import VLMFamily, assign_media, check_feature_rows, entry_rows, mrope_rows
from .inputs import ffn_size, text_config
from .recent import GEMMA3, GEMMA4, KIMI, MINICPMV, MINICPMV47, MISTRAL3, ONEVISION, PALIGEMMA, recent_family

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
# GLM-4.1V, GLM-4.5V (its mixture-of-experts language model) and GLM-4.6V: images and videos
_GLM = {
    "Glm4vForConditionalGeneration": "GLM-4.1V",
    "Glm4vMoeForConditionalGeneration": "GLM-4.5V",
    "Glm46VForConditionalGeneration": "GLM-4.6V",
}
# its resampler merges a video's frames two by two; its vision tokens have experts of their own
_ERNIE = {"Ernie4_5_VLMoeForConditionalGeneration": "Ernie-4.5-VL"}
RECENT = {**KIMI, **MISTRAL3, **GEMMA3, **GEMMA4, **PALIGEMMA, **MINICPMV, **MINICPMV47, **ONEVISION}
#: the multimodal model classes ``apply_dynamic_cp`` shards (text decoders work as they are)
SUPPORTED: tuple[str, ...] = (
    tuple(_QWEN)
    + tuple(_LLAVA)
    + tuple(_OMNI)
    + tuple(_OMNI3)
    + tuple(_GLM)
    + tuple(_ERNIE)
    + tuple(KIMI)
    + tuple(MISTRAL3)
    + tuple(GEMMA3)
    + tuple(GEMMA4)
    + tuple(PALIGEMMA)
    + tuple(MINICPMV)
    + tuple(MINICPMV47)
    + tuple(ONEVISION)
)
#: vision-language models ``apply_dynamic_cp`` refuses with the reason (their encoders may be balanced)
NOT_SHARDED = {
    "Molmo2ForConditionalGeneration": "all image tokens of a sequence form one bidirectional block (every image "
    "attends to every other), which neither a shard nor mmbalance_varlen carries",
}
# a FLOP rate to turn encoder FLOPs into the seconds of the "quadratic" cost (CostModel.transformer)
_FLOPS = 400e12


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

    def _frames_merged(self, model) -> int:
        """A video's frames per placeholder row (Ernie's resampler merges them two by two)."""
        return 1

    def _merge2(self, model) -> int:
        c = core(model)
        tower: Any = getattr(c, "visual", None) or getattr(c, "vision_tower")  # noqa: B009 (Ernie's name)
        return int(tower.spatial_merge_size) ** 2

    def positions(self, model, batch, ids, kinds, spans):
        c = core(model)
        grids = _grids(batch, kinds, self._merge2(model), self._frames_merged(model))
        seconds = batch.get("second_per_grid_ts")
        takes_seconds = "second_per_grid_ts" in inspect.signature(c.get_rope_index).parameters

        def rope(s: int, seq: Tensor, tt: Tensor) -> Tensor:
            img, vid = grids["image"][0][grids["image"][1][s]], grids["video"][0][grids["video"][1][s]]
            kw = {
                "mm_token_type_ids": tt,
                "image_grid_thw": img if img.shape[0] else None,
                "video_grid_thw": vid if vid.shape[0] else None,
                "attention_mask": None,
            }
            if takes_seconds and seconds is not None and vid.shape[0]:
                kw["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)[grids["video"][1][s]]
            return c.get_rope_index(seq, **kw)[0]

        return mrope_rows(batch, ids, kinds, spans, rope)


class _Glm(_Qwen):
    """GLM-4.1V, GLM-4.5V and GLM-4.6V: images and video frames through their Qwen-style ViT, M-RoPE
    positions from ``get_rope_index`` (which reads ``mm_token_type_ids``). A video's placeholders are
    image tokens (the models fill every image token from either kind's rows, and only
    ``mm_token_type_ids`` tells a video's apart: 2 there), so the shard carries one stream of image
    tokens whose rows are the images' and the frames' in the order they meet them."""

    def streams(self, model):
        return [("image", int(model.config.image_token_id))]

    def item_streams(self, adapter, meta):
        return np.zeros(meta.shape[0], dtype=np.int64)

    def _typed(self, batch, kinds, spans) -> list[np.ndarray]:
        """Every sequence's placeholder kinds by ``mm_token_type_ids``: 1 image, 2 video."""
        tt = batch.get("mm_token_type_ids")
        if tt is None:
            if batch.get("pixel_values_videos") is not None:
                raise ValueError(
                    f"batch['mm_token_type_ids'] is missing: {self.label}'s video placeholders are image tokens "
                    "that only mm_token_type_ids (2 at a video's) tells apart; its processor gives it"
                )
            return kinds
        tt = torch.as_tensor(tt).cpu().numpy()
        out = []
        for s, (kind, (r, a, z)) in enumerate(zip(kinds, spans)):
            t = tt[r, a:z]
            if not np.isin(t[kind == 1], (1, 2)).all():
                raise ValueError(
                    f"batch['mm_token_type_ids'] of sequence {s}: an image placeholder token is neither an image's "
                    "(1) nor a video's (2)"
                )
            out.append(np.where(kind == 1, t, 0).astype(np.int64))
        return out

    def check_batch(self, model, batch, kinds, spans):
        self._typed(batch, kinds, spans)

    def positions(self, model, batch, ids, kinds, spans):
        return super().positions(model, batch, ids, self._typed(batch, kinds, spans), spans)

    def item_order(self, model, batch, kinds, spans, items, rows):
        video = items.meta[:, 0] == 1  # the adapter's "video" column
        if not bool(video.any()):
            return None
        typed = self._typed(batch, kinds, spans)
        placeholders = np.concatenate([t[t > 0] for t in typed] or [np.zeros(0, dtype=np.int64)])
        start = np.zeros(len(items), dtype=np.int64)
        for flag, kind, name in ((False, 1, "image"), (True, 2, "video")):
            idx = np.flatnonzero(video == flag)
            where = np.flatnonzero(placeholders == kind)
            ends = np.cumsum(rows[idx])
            if int(ends[-1] if idx.size else 0) != where.size:
                raise ValueError(
                    f"batch['mm_token_type_ids'] marks {where.size} {name} placeholder tokens but the {name}s give "
                    f"{int(ends[-1] if idx.size else 0)} feature rows"
                )
            start[idx] = where[ends - rows[idx]] if idx.size else start[idx]
        return np.argsort(start, kind="stable")


class _Ernie(_Qwen):
    """Ernie-4.5-VL: images and videos through its Qwen-style ViT and a resampler that merges a
    video's frames two by two, M-RoPE positions from ``get_rope_index``; its language model sends
    vision tokens (and their start and end markers) to experts of their own by
    ``moe_mm_token_type_ids``, which the shard gives for its own tokens, by the processor's rule."""

    def __init__(self, cls_name: str):
        self.label = _ERNIE[cls_name]
        self.batch_keys = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                     "mm_token_type_ids", "moe_mm_token_type_ids"})  # fmt: skip

    def _frames_merged(self, model) -> int:
        tower: Any = core(model).vision_tower
        return int(tower.config.temporal_merge_size)

    def _expert_kinds(self, model, ids: Tensor) -> Tensor:
        """The processor's ``moe_mm_token_type_ids`` of ``ids``: 1 at image placeholders and the image
        start and end markers, 2 at the video ones, 0 elsewhere."""
        cfg = model.config
        out = torch.zeros_like(ids)
        for kind, keys in ((1, ("image_token_id", "image_start_token_id", "image_end_token_id")),
                           (2, ("video_token_id", "video_start_token_id", "video_end_token_id"))):  # fmt: skip
            for key in keys:
                out[ids == int(getattr(cfg, key))] = kind
        return out

    def check_batch(self, model, batch, kinds, spans):
        given = batch.get("moe_mm_token_type_ids")
        ids = torch.as_tensor(batch["input_ids"]).cpu()
        if given is None:
            if bool(self._expert_kinds(model, ids).ne(0).any()):
                raise ValueError(
                    "batch['moe_mm_token_type_ids'] is missing: Ernie-4.5-VL sends its vision tokens to their own "
                    "experts only with it (its processor gives it), and handle.shard gives the shards the experts "
                    "the processor's rule says"
                )
            return
        given = torch.as_tensor(given).cpu()
        for s, (r, a, z) in enumerate(spans):
            if not torch.equal(given[r, a:z].long(), self._expert_kinds(model, ids[r, a:z]).long()):
                raise ValueError(
                    f"batch['moe_mm_token_type_ids'] of sequence {s} is not the processor's (1 at image tokens and "
                    "their markers, 2 at video ones); handle.shard gives the shards that rule's experts"
                )

    def token_keywords(self, model, input_ids):
        return {"moe_mm_token_type_ids": self._expert_kinds(model, input_ids)}


def _grids(batch: Mapping, kinds: list[np.ndarray], merge2: int, frames_merged: int = 1) -> dict:
    """Per vision stream (kinds 1 and 2), the batch's ``*_grid_thw`` rows and the rows of every
    sequence's media (``merge2`` patches a placeholder; a video's frames ``frames_merged`` by
    ``frames_merged`` as well); raises ValueError naming the keys when placeholders have no media."""
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
        per = merge2 * (frames_merged if name == "video" else 1)
        grids[name] = (g, assign_media(g.prod(-1).numpy() // per, counts, key, name))
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
    model, and with the reason for a family whose encoder the installed release runs wrongly on
    items gathered from several ranks (:meth:`~..encoders.EncoderAdapter.refusal`). The class is
    looked up along its MRO, as the encoder adapters match it: FSDP2's ``fully_shard``
    (``FSDP<Name>``) and a user's subclass keep their family."""
    family = _family_of(model)
    if family is not None:
        for adapter in adapters_for(model):
            reason = adapter.refusal(model)
            if reason:
                raise ValueError(
                    f"model: apply_dynamic_cp does not shard {type(model).__name__}{wrapper_hint(model)}: {reason}"
                )
    return family


def _family_of(model) -> VLMFamily | None:
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
        if cls.__name__ in _ERNIE:
            return _Ernie(cls.__name__)
        if cls.__name__ in RECENT:  # (a Gemma 4 without its towers: a text model)
            return recent_family(model, cls.__name__)
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
