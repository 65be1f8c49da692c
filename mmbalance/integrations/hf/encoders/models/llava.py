"""LLaVA (1.5), LLaVA-NeXT and LLaVA-OneVision: fixed-resolution CLIP / SigLIP towers, one item per
tile (LLaVA-OneVision: per image with its tiles, and per video frame).

The tower's feature layer and selection strategy come from the forward's ``vision_feature_layer`` /
``vision_feature_select_strategy`` when given there, else from the config, as in the models
themselves; every rank must pass the same ones (items of all ranks are encoded together).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...compat import forward_adds_video_newline
from ..adapter import Items, packed_rows, register_adapter
from .common import TileAdapter, as_int, core, mm_outputs, pending_pixels, pooled, vision_feature_options

__all__ = ["LlavaAdapter", "LlavaNextAdapter", "LlavaOnevisionAdapter"]


class _ClipTiles(TileAdapter):
    def call_options(self, model, kwargs):
        layer, strategy = vision_feature_options(model, kwargs)
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
        return {
            "vision_feature_layer": tuple(layer) if isinstance(layer, (list, tuple)) else int(layer),
            "vision_feature_select_strategy": strategy,
        }

    def _selected(self, model, tiles, vision_feature_layer, vision_feature_select_strategy):
        """The chosen hidden state(s) of the tower, CLS dropped for the "default" strategy."""
        hs = self._tower(model)(tiles, output_hidden_states=True, return_dict=True).hidden_states
        drop = vision_feature_select_strategy == "default"
        if isinstance(vision_feature_layer, int):
            feat = hs[vision_feature_layer]
            return feat[:, 1:] if drop else feat
        return torch.cat([hs[k][:, 1:] if drop else hs[k] for k in vision_feature_layer], dim=-1)

    def _tokens_per_tile(self, model, vision_feature_select_strategy: str) -> int:
        cfg = self._tower(model).config
        side = as_int(cfg.image_size) // as_int(cfg.patch_size)
        return side * side + (0 if vision_feature_select_strategy == "default" else 1)

    def out_rows(self, model, meta, vision_feature_select_strategy=None, **options):
        strategy = vision_feature_select_strategy or model.config.vision_feature_select_strategy
        return np.full(meta.shape[0], self._tokens_per_tile(model, strategy), dtype=np.int64)

    def encode(self, model, payload, meta, **options):
        options = options or self.call_options(model, {})
        feats = core(model).multi_modal_projector(self._selected(model, payload[0], **options))
        return [feats.reshape(-1, feats.shape[-1])]


@register_adapter
class LlavaAdapter(_ClipTiles):
    model_classes = ("LlavaForConditionalGeneration", "LlavaModel")

    def extract(self, model, kwargs):
        if kwargs.get("image_sizes") is not None and pending_pixels(kwargs) is not None:
            raise ValueError("image_sizes (variable-resolution backbones such as Pixtral) are not supported")
        pix = pending_pixels(kwargs, 4, "images, C, H, W")
        if pix is None:
            return None
        return self._tiles(model, kwargs, pix, {"options": self.call_options(model, kwargs)})

    def restore(self, model, kwargs, items, outputs):
        mm = mm_outputs(kwargs)
        mm["image"] = pooled(
            packed_rows(outputs[0], self.out_rows(model, items.meta, **items.context["options"]))
        )
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


@register_adapter
class LlavaNextAdapter(_ClipTiles):
    """Items are the real tiles of every image (the base tile and the grid tiles that
    ``image_sizes`` implies; padding tiles are dropped before anything moves). The tower, feature
    selection and projector run per tile anywhere; unpadding and the newline tokens (which need
    ``image_sizes``) run on the image's own rank."""

    model_classes = ("LlavaNextForConditionalGeneration", "LlavaNextModel")

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs)
        if pix is None:
            return None
        sizes = kwargs.get("image_sizes")
        if sizes is None:
            raise ValueError("pixel_values is given without image_sizes")
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        cfg = model.config
        ntiles = [
            image_size_to_num_patches(
                image_size=s, grid_pinpoints=cfg.image_grid_pinpoints, patch_size=cfg.vision_config.image_size
            )  # fmt: skip
            for s in torch.as_tensor(sizes).tolist()
        ]
        if pix.dim() == 5:
            tiles = torch.cat([p[:n] for p, n in zip(pix, ntiles)])
        elif pix.dim() == 4 and pix.shape[0] == sum(ntiles):
            tiles = pix
        else:
            raise ValueError(
                f"pixel_values of shape {tuple(pix.shape)} does not match image_sizes ({sum(ntiles)} tiles)"
            )
        context = {"ntiles": ntiles, "image_sizes": sizes, "options": self.call_options(model, kwargs)}
        return self._tiles(model, kwargs, tiles, context)

    def restore(self, model, kwargs, items, outputs):
        c = core(model)
        strategy = items.context["options"]["vision_feature_select_strategy"]
        per_tile = self._tokens_per_tile(model, strategy)
        feats = outputs[0].reshape(len(items), per_tile, outputs[0].shape[-1])
        packed, _ = c.pack_image_features(
            torch.split(feats, items.context["ntiles"]),
            items.context["image_sizes"],
            vision_feature_select_strategy=strategy,
            image_newline=c.image_newline,
        )
        mm = mm_outputs(kwargs)
        mm["image"] = pooled(packed)
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


@register_adapter
class LlavaOnevisionAdapter(_ClipTiles):
    """LLaVA-OneVision: an item is an image with all its tiles (the base tile and the grid tiles
    ``image_sizes`` implies; the base tile alone for an image of a sample that holds several, as the
    model does when ``batch_num_images`` says so), or one frame of a video. The rank that encodes an
    image runs the tower, feature selection and projector on its tiles and packs them as the model
    does (anyres unpadding, the newline rows), so an item's rows are exactly its placeholders' rows,
    wherever they are needed; a frame is pooled there, and a video's last frame carries the video's
    newline row where ``get_video_features`` returns it (releases with ``mm_encoder_outputs``; before,
    the forward appends it)."""

    model_classes = ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionModel")
    # video: 1 for a frame; tiles: the item's tiles; h, w: an image's size (pixels); last: the last
    # frame of its video
    meta_columns: tuple[str, ...] = ("video", "tiles", "h", "w", "last")

    def _tokens_per_tile(self, model, vision_feature_select_strategy: str) -> int:
        cfg = self._tower(model).config
        side = as_int(cfg.image_size) // as_int(cfg.patch_size)
        cls = 1 if str(getattr(cfg, "model_type", "")).startswith("clip") else 0  # SigLIP has no CLS token
        return side * side + cls - (1 if vision_feature_select_strategy == "default" else 0)

    def call_options(self, model, kwargs):
        options = super().call_options(model, kwargs)
        # the config's: the forward takes a vision_aspect_ratio keyword but calls get_image_features
        # without it (transformers 5.6 to 5.24), which then reads the config's
        ratio = getattr(model.config, "vision_aspect_ratio", None)
        options["vision_aspect_ratio"] = str(ratio or "anyres_max_9")
        return options

    def dummy(self, model):
        payload, _ = super().dummy(model)
        side = as_int(self._tower(model).config.image_size)
        return payload, np.array([[0, 1, side, side, 0]], dtype=np.int64)

    def cost(self, model, meta, rows):
        return meta[:, 1].astype(np.float64)  # every tile alike

    def _image_rows(self, model, tiles: int, h: int, w: int, strategy: str, ratio: str) -> int:
        """An image's rows: the model's own packing, run on zeros of one channel."""
        owner: Any = core(model)
        with torch.no_grad():
            packed, _ = owner.pack_image_features(
                [torch.zeros(tiles, self._tokens_per_tile(model, strategy), 1)],
                torch.tensor([[h, w]]),
                image_newline=torch.zeros(1),
                vision_aspect_ratio=ratio,
            )
        return int(packed[0].shape[0])

    def _frame_rows(self, model, strategy: str) -> int:
        owner: Any = core(model)
        with torch.no_grad():
            return int(
                owner.apply_pooling(torch.zeros(1, self._tokens_per_tile(model, strategy), 1)).shape[1]
            )

    def out_rows(self, model, meta, vision_feature_select_strategy=None, vision_aspect_ratio=None, **options):
        strategy = vision_feature_select_strategy or model.config.vision_feature_select_strategy
        ratio = vision_aspect_ratio or self.call_options(model, {})["vision_aspect_ratio"]
        newline = not forward_adds_video_newline(model)
        frame = self._frame_rows(model, strategy) if bool((meta[:, 0] == 1).any()) else 0
        return np.array(
            [frame + int(newline and last) if video else self._image_rows(model, tiles, h, w, strategy, ratio)
             for video, tiles, h, w, last in meta.tolist()],
            dtype=np.int64,
        )  # fmt: skip

    def encode(self, model, payload, meta, **options):
        options = options or self.call_options(model, {})
        ratio = options.pop("vision_aspect_ratio")
        c = core(model)
        feats = c.multi_modal_projector(self._selected(model, payload[0], **options))
        out, at = [], 0
        newline = not forward_adds_video_newline(model)
        for video, tiles, h, w, last in meta.tolist():
            own = feats[at : at + tiles]
            at += tiles
            if video:
                rows = c.apply_pooling(own)[0]
                if newline and last:
                    rows = torch.cat([rows, c.image_newline[None].to(rows)])
            else:
                packed, _ = c.pack_image_features(
                    [own], torch.tensor([[h, w]]), image_newline=c.image_newline, vision_aspect_ratio=ratio
                )
                rows = packed[0]
            out.append(rows)
        return [torch.cat(out)]

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs)
        videos = kwargs.get("pixel_values_videos")
        if videos is not None and mm_outputs(kwargs).get("video") is not None:
            videos = None
        if pix is None and videos is None:
            return None
        parts, meta, context = [], [], {"options": self.call_options(model, kwargs), "videos": None}
        if pix is not None:
            sizes = kwargs.get("image_sizes")
            if sizes is None:
                raise ValueError("pixel_values is given without image_sizes")
            from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

            cfg = model.config
            sizes_list = torch.as_tensor(sizes).tolist()
            counts = kwargs.get("batch_num_images")
            patching = (
                [True] * len(sizes_list)
                if counts is None
                else [int(n) == 1 for n in torch.as_tensor(counts).tolist() for _ in range(int(n))]
            )
            if len(patching) != len(sizes_list):
                raise ValueError(
                    f"batch_num_images adds up to {len(patching)} images, image_sizes holds {len(sizes_list)}"
                )
            ntiles = [
                image_size_to_num_patches(image_size=s, grid_pinpoints=cfg.image_grid_pinpoints,
                                          patch_size=cfg.vision_config.image_size) if patch else 1
                for s, patch in zip(sizes_list, patching)
            ]  # fmt: skip
            if pix.dim() == 5:
                parts.append(torch.cat([p[:n] for p, n in zip(pix, ntiles)]))
            elif pix.dim() == 4 and pix.shape[0] == sum(ntiles):
                parts.append(pix)
            else:
                raise ValueError(
                    f"pixel_values of shape {tuple(pix.shape)} does not match image_sizes ({sum(ntiles)} tiles)"
                )
            meta += [[0, n, int(h), int(w), 0] for n, (h, w) in zip(ntiles, sizes_list)]
        if videos is not None:
            if videos.dim() != 5:
                raise ValueError(
                    f"pixel_values_videos must be [videos, frames, C, H, W], got {tuple(videos.shape)}"
                )
            count, frames = int(videos.shape[0]), int(videos.shape[1])
            context["videos"] = (count, frames)
            parts.append(videos.reshape(-1, *videos.shape[2:]))
            meta += [[1, 1, 0, 0, int(f == frames - 1)] for _ in range(count) for f in range(frames)]
            kwargs["pixel_values_videos"] = None
        items = self._tiles(model, kwargs, torch.cat(parts) if len(parts) > 1 else parts[0])
        return Items(items.payload, np.array([m[1] for m in meta], dtype=np.int64), np.array(meta, dtype=np.int64),
                     context)  # fmt: skip

    def restore(self, model, kwargs, items, outputs):
        context = items.context
        rows = packed_rows(outputs[0], self.out_rows(model, items.meta, **context["options"]))
        video = items.meta[:, 0] == 1
        mm = mm_outputs(kwargs)
        images = [r for r, v in zip(rows, video) if not v]
        if images:
            mm["image"] = pooled(images)
        if context["videos"] is not None:
            count, frames = context["videos"]
            clips = [r for r, v in zip(rows, video) if v]
            mm["video"] = pooled(
                torch.stack([torch.cat(clips[i * frames : (i + 1) * frames]) for i in range(count)])
            )
        kwargs["mm_encoder_outputs"] = mm
        return kwargs
