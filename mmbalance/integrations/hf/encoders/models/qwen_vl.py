"""The natural-resolution Qwen ViTs: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, the
Qwen2.5-Omni and Qwen3-Omni thinkers' vision towers; and the towers that take the same inputs
(patches with ``*_grid_thw`` rows): GLM-4.1V / 4.5V / 4.6V, Kimi-K2.5 and Ernie-4.5-VL (below).

One item per image, and one per temporal frame of a video (``t`` frames of ``h x w`` patches): the
towers attend within each frame only (``cu_seqlens`` restart at every frame; Qwen2.5's windows lie
inside a frame too) and their position embeddings depend on ``h`` and ``w`` alone, so a frame
encoded apart gives exactly the rows it gives inside its video. Each frame returns ``h*w / merge**2``
rows (and as many per deepstack layer in Qwen3-VL); ``restore`` puts a video's frames back together.
"""

from __future__ import annotations

import numpy as np
import torch

from ...compat import feature_rows
from ..adapter import EncoderAdapter, Items, flops_linear, packed_rows, register_adapter
from .common import as_int, core, dtype_device, mm_outputs, pooled

__all__ = ["ErnieVisionAdapter", "GlmVisionAdapter", "KimiVisionAdapter", "Qwen3OmniVisionAdapter",
           "Qwen3VLMoeVisionAdapter", "QwenVisionAdapter"]  # fmt: skip


@register_adapter
class QwenVisionAdapter(EncoderAdapter):
    """Items: images and video frames (a ``*_grid_thw`` row ``t x h x w`` is ``t`` items of ``1 x h
    x w``; whole videos with ``splits_frames = False``). Images and frames of all ranks are encoded
    together in one call of the tower."""

    encoder = "vision"
    meta_columns = ("video", "t", "h", "w")
    splits_frames = True
    model_classes: tuple[str, ...] = (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLModel",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLModel",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLModel",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        # Qwen3.5 (Gated DeltaNet language model, Qwen3-VL's tower without deepstack)
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5Model",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeModel",
    )
    _SOURCES = (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    )

    #: the tower's attribute on the model's feature owner
    tower = "visual"
    #: whether the tower attends within each temporal frame only (else within a whole video)
    per_frame_attention = True
    #: whether a video's frames are pooled into one frame's rows (Kimi-K2.5's temporal mean)
    pools_frames = False

    def _visual(self, model):
        return getattr(core(model), self.tower)

    def _row(self, model) -> int:
        """Values per patch, from the config (reading a weight would gather it under FSDP2)."""
        cfg = self._visual(model).config
        return int(cfg.in_channels) * int(cfg.temporal_patch_size) * as_int(cfg.patch_size) ** 2

    def _patch_shape(self, model) -> tuple[int, ...]:
        """The shape of one patch as the tower takes it (a flat row here)."""
        return (self._row(model),)

    def _merge(self, model) -> int:
        return int(self._visual(model).spatial_merge_size)

    def extract(self, model, kwargs):
        mm = mm_outputs(kwargs)
        dtype, _ = dtype_device(self._visual(model))
        parts, metas, frames = [], [], []
        for kind, (name, pix_key, grid_key) in enumerate(self._SOURCES):
            pix = kwargs.get(pix_key)
            if pix is None or mm.get(name) is not None:
                continue
            grid = kwargs.get(grid_key)
            if grid is None:
                raise ValueError(f"{pix_key} is given without {grid_key}")
            grid = torch.as_tensor(grid).reshape(-1, 3).cpu().numpy().astype(np.int64)
            rows = grid.prod(-1)
            if int(rows.sum()) != pix.shape[0]:
                raise ValueError(
                    f"{grid_key} describes {int(rows.sum())} patches but {pix_key} has {pix.shape[0]} rows"
                )
            parts.append(pix.reshape(pix.shape[0], -1).type(dtype))
            if self.splits_frames:  # frame by frame: the rows of a video are frame-major
                t = grid[:, 0]
                per = np.repeat(np.concatenate([np.ones((len(grid), 1), np.int64), grid[:, 1:]], 1), t, 0)
                metas.append(np.concatenate([np.full((per.shape[0], 1), kind), per], axis=1))
                frames += [(kind, int(n)) for n in t]
            else:
                metas.append(np.concatenate([np.full((grid.shape[0], 1), kind), grid], axis=1))
                frames += [(kind, 1)] * len(grid)
            kwargs[pix_key] = None
        if not parts:
            return None
        meta = np.concatenate(metas)
        return Items([torch.cat(parts)], meta[:, 1:].prod(1), meta, {"frames": frames})

    def empty_payload(self, model):
        dtype, device = dtype_device(self._visual(model))
        return [torch.empty(0, self._row(model), dtype=dtype, device=device)]

    def encode(self, model, payload, meta):
        grid = torch.as_tensor(meta[:, 1:4], dtype=torch.long, device=payload[0].device)
        pixels = payload[0].reshape(-1, *self._patch_shape(model))
        out = core(model).get_image_features(pixels, grid, return_dict=True)
        outs = [feature_rows(out.pooler_output)]  # one tensor, or per item, by version
        for layer in getattr(out, "deepstack_features", None) or []:
            outs.append(feature_rows(layer))
        return outs

    def out_rows(self, model, meta):
        frames = 1 if self.pools_frames else meta[:, 1]
        return frames * meta[:, 2] * meta[:, 3] // self._merge(model) ** 2

    def dummy(self, model):
        m = self._merge(model)
        dtype, device = dtype_device(self._visual(model))
        x = torch.zeros(m * m, self._row(model), dtype=dtype, device=device)
        return [x], np.array([[0, 1, m, m]], dtype=np.int64)

    def restore(self, model, kwargs, items, outputs):
        per_item = self.out_rows(model, items.meta)
        feats = packed_rows(outputs[0], per_item)
        deep = [packed_rows(t, per_item) for t in outputs[1:]]
        # an image or video of the forward is `count` consecutive items (its frames)
        groups: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        start = 0
        for kind, count in items.context["frames"]:
            groups[kind].append((start, start + count))
            start += count

        def joined(pieces, a, b):
            return pieces[a] if b - a == 1 else torch.cat(pieces[a:b])

        mm = mm_outputs(kwargs)
        for kind, name in enumerate(("image", "video")):
            if not groups[kind]:
                continue
            features = tuple(joined(feats, a, b) for a, b in groups[kind])
            layers = [tuple(joined(layer, a, b) for a, b in groups[kind]) for layer in deep] if deep else None
            mm[name] = pooled(features, layers)
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        cfg = self._visual(model).config
        depth = int(getattr(cfg, "depth", None) or cfg.num_hidden_layers)
        hidden = int(getattr(cfg, "embed_dim", None) or cfg.hidden_size)
        ffn = int(getattr(cfg, "intermediate_size", 0) or hidden * getattr(cfg, "mlp_ratio", 4))
        frame = (meta[:, 2] * meta[:, 3]).astype(np.float64)  # patches per frame
        t = meta[:, 1].astype(np.float64)
        if not self.per_frame_attention:  # one attention span per video
            frame, t = frame * t, np.ones_like(t)
        full = depth
        window = frame
        if getattr(cfg, "window_size", None) and getattr(cfg, "fullatt_block_indexes", None) is not None:
            full = len(cfg.fullatt_block_indexes)  # Qwen2.5: windowed attention in the other layers
            side = int(cfg.window_size) // as_int(cfg.patch_size)
            window = np.minimum(frame, float(side * side))
        attention = 4.0 * hidden * t * frame * (full * frame + (depth - full) * window)
        return depth * flops_linear(hidden, ffn) * t * frame + attention


@register_adapter
class Qwen3VLMoeVisionAdapter(QwenVisionAdapter):
    """Qwen3-VL-MoE: the Qwen3-VL vision tower (the experts are in the language model only)."""

    model_classes: tuple[str, ...] = ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel")


@register_adapter
class Qwen3OmniVisionAdapter(QwenVisionAdapter):
    """The Qwen3-Omni thinker's vision tower: Qwen3-VL's (deepstack layers included)."""

    model_classes: tuple[str, ...] = ("Qwen3OmniMoeThinkerForConditionalGeneration",)


@register_adapter
class GlmVisionAdapter(QwenVisionAdapter):
    """GLM-4.1V, GLM-4.5V (GLM-4.1V's tower beside a mixture-of-experts language model) and
    GLM-4.6V: one item per image and one per temporal frame of a video. The tower attends within
    each frame and resamples its position table to each item's own grid, so a frame encoded apart
    gives exactly its rows. The models take a video's placeholders as image tokens
    (``mm_token_type_ids`` tells them apart): a batch carries images or videos, as the models
    themselves require."""

    model_classes: tuple[str, ...] = (
        "Glm4vForConditionalGeneration",
        "Glm4vModel",
        "Glm4vMoeForConditionalGeneration",
        "Glm4vMoeModel",
        "Glm46VForConditionalGeneration",
        "Glm46VModel",
    )

    def encode(self, model, payload, meta):
        # the tower takes one grid row per frame (get_video_features flattens a video so; a whole
        # video's [t, h, w] would index its position table out of range): an item of several
        # frames (split_frames=False) goes as its frames, in order
        t = np.asarray(meta[:, 1])
        if (t > 1).any():
            meta = np.repeat(meta, t, axis=0)
            meta[:, 1] = 1
        return super().encode(model, payload, meta)


@register_adapter
class KimiVisionAdapter(QwenVisionAdapter):
    """Kimi-K2.5: a ViT over ``[patches, 3, p, p]`` pixels, one item per image or video clip. A
    clip is one attention span and its frames are averaged into one frame's rows before the 2 x 2
    merge, so a clip is never split: it returns ``h * w / 4`` rows whatever its ``t``, and costs the
    attention of all its ``t * h * w`` patches."""

    model_classes: tuple[str, ...] = ("Kimi_K25ForConditionalGeneration", "Kimi_K25Model")
    tower = "vision_tower"
    splits_frames = False
    per_frame_attention = False
    pools_frames = True

    def _patch_shape(self, model):
        p = as_int(self._visual(model).config.patch_size)
        return (3, p, p)

    def _row(self, model) -> int:
        return int(np.prod(self._patch_shape(model)))

    def encode(self, model, payload, meta):
        # the tower and projector as get_image_features runs them, split here by each item's
        # pooled rows (before 5.2x get_image_features split a clip's rows by its frames)
        c = core(model)
        grid = torch.as_tensor(meta[:, 1:4], dtype=torch.long, device=payload[0].device)
        pixels = payload[0].reshape(-1, *self._patch_shape(model))
        rows = c.mm_projector(c.vision_tower(pixels, grid_thw=grid).pooler_output).squeeze(1)
        return [rows.reshape(-1, rows.shape[-1])]

    def _merge(self, model) -> int:
        kernel = self._visual(model).merge_kernel_size
        h, w = (kernel, kernel) if isinstance(kernel, int) else kernel
        if h != w:
            raise ValueError(
                f"Kimi-K2.5: merge_kernel_size {kernel} is not square (an item's rows assume it is)"
            )
        return int(h)


@register_adapter
class ErnieVisionAdapter(QwenVisionAdapter):
    """Ernie-4.5-VL: the Qwen ViT's inputs (patches with ``*_grid_thw`` rows, attention within each
    frame), then a resampler that merges ``2 x 2`` patches and, in a video, each pair of frames (an
    image's frame is paired with itself). Items: images, and a video's frames two by two (whole videos
    with ``splits_frames = False``); the tower and the resampler run once on every rank's items, images
    and frame pairs together, as ``get_image_features`` and ``get_video_features`` run them."""

    model_classes = ("Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VLMoeModel")
    tower = "vision_tower"

    def _row(self, model) -> int:
        cfg = self._visual(model).config
        return int(cfg.in_channels) * as_int(cfg.patch_size) ** 2

    def _pair(self, model) -> int:
        return int(self._visual(model).config.temporal_merge_size)

    def extract(self, model, kwargs):
        items = super().extract(model, kwargs)
        if items is None or not self.splits_frames:
            return items
        # the frames of a video two by two (the resampler merges each pair): super() gave one per frame
        pair, meta, frames = self._pair(model), [], []
        at = 0
        for kind, count in items.context["frames"]:
            own = items.meta[at : at + count]
            if kind == 0 or count == 1:
                meta.append(own)
                frames.append((kind, count))
            else:
                if count % pair:
                    raise ValueError(
                        f"video_grid_thw: a video of {count} frames; the resampler merges frames {pair} by {pair}"
                    )
                merged = own[::pair].copy()
                merged[:, 1] = pair
                meta.append(merged)
                frames.append((kind, count // pair))
            at += count
        meta_np = np.concatenate(meta)
        return Items(items.payload, meta_np[:, 1:].prod(1), meta_np, {"frames": frames})

    def out_rows(self, model, meta):
        per_frame = meta[:, 2] * meta[:, 3] // self._merge(model) ** 2
        return np.where(meta[:, 1] > 1, meta[:, 1] * per_frame // self._pair(model), per_frame)

    def encode(self, model, payload, meta):
        c = core(model)
        grid = torch.as_tensor(meta[:, 1:4], dtype=torch.long, device=payload[0].device)
        hidden = c.vision_tower(payload[0], grid).last_hidden_state
        return [c.resampler_model(hidden, grid)]
