"""Gemma 4: a ViT at each image's own size, one item per image and per video frame.

The processor pads every image (and frame) to the call's ``max_patches`` rows, with position
``(-1, -1)`` at the padding; the tower attends within an image only (padding masked), pools each
``k x k`` cell of its patch grid into one soft token and drops the padding, so an image gives the
same rows however many rows it is padded to and whatever shares its call (checked against the
stock forward: rows equal). Its gradients do see the padding's length (the norms' weights, 1e-7
in float64 between an image padded to 32 and to 64 rows), so the encoding rank pads every item to
the length its processor padded it to (``padded``; the largest of the call's items where ranks'
processors differ). Only an image's own patches travel; its positions are its patch grid (``x``
along the width first), which the processor writes and ``extract`` checks, so they are rebuilt
where it is encoded. A video's frames go through the same tower and projector as images
(``get_video_features``), so each frame is an item of its own.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..adapter import EncoderAdapter, Items, packed_rows, register_adapter
from .common import core, dtype_device, image_attention_flops, mm_outputs, pooled

__all__ = ["Gemma4VisionAdapter"]


def _grid(width: int, height: int) -> Tensor:
    """The processor's patch positions of a ``width x height`` grid: ``(x, y)``, row by row."""
    yy, xx = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=1)


@register_adapter
class Gemma4VisionAdapter(EncoderAdapter):
    encoder = "vision"
    meta_columns = ("video", "width", "height", "padded")
    model_classes = ("Gemma4ForConditionalGeneration", "Gemma4Model")
    splits_frames = True  # the tower sees one frame at a time: frames are items whatever this says

    def matches(self, model) -> bool:  # a Gemma 4 built without its vision tower has none to balance
        return super().matches(model) and getattr(model.config, "vision_config", None) is not None

    def _tower(self, model):
        return core(model).vision_tower

    def _k(self, model) -> int:
        return int(self._tower(model).config.pooling_kernel_size)

    def _patch_pixels(self, model) -> int:
        cfg = self._tower(model).config
        return 3 * int(cfg.patch_size) ** 2

    def _items(self, model, pix: Tensor, pos: Tensor, key: str, video: int) -> tuple[list, list]:
        if pix.dim() != 3 or pos.shape[:2] != pix.shape[:2] or pos.shape[-1] != 2:
            raise ValueError(
                f"{key}: pixel values [images, max_patches, patch_pixels] with positions [images, max_patches, 2] "
                f"expected, got {tuple(pix.shape)} and {tuple(pos.shape)}"
            )
        k = self._k(model)
        parts, meta = [], []
        pos = pos.cpu()
        for i in range(pix.shape[0]):
            valid = ~(pos[i] == -1).all(dim=-1)
            n = int(valid.sum())
            w = int(pos[i, :, 0].max()) + 1 if n else 0
            h = int(pos[i, :, 1].max()) + 1 if n else 0
            if not n or w % k or h % k or not torch.equal(pos[i, :n], _grid(w, h)) or bool(valid[n:].any()):
                raise ValueError(
                    f"{key}: item {i}'s patch positions are not a {k} x {k}-divisible grid written row by row "
                    "before its padding, as the Gemma 4 processor gives them"
                )
            parts.append(pix[i, :n])
            meta.append((video, w, h, int(pix.shape[1])))
        return parts, meta

    def extract(self, model, kwargs):
        mm = mm_outputs(kwargs)
        parts, meta, context = [], [], {"images": 0, "frames": None}
        pix = kwargs.get("pixel_values")
        if pix is not None and mm.get("image") is None:
            pos = kwargs.get("image_position_ids")
            if pos is None:
                raise ValueError("pixel_values is given without image_position_ids")
            p, m = self._items(model, pix, pos, "pixel_values", 0)
            parts += p
            meta += m
            context["images"] = len(p)
            kwargs["pixel_values"] = kwargs["image_position_ids"] = None
        videos = kwargs.get("pixel_values_videos")
        if videos is not None and mm.get("video") is None:
            pos, frames = kwargs.get("video_position_ids"), kwargs.get("num_frames_per_video")
            if pos is None:
                raise ValueError("pixel_values_videos is given without video_position_ids")
            if videos.dim() == 4:  # [videos, frames, max_patches, patch_pixels]: the releases before 5.19
                frames = [int(videos.shape[1])] * int(videos.shape[0])
                videos, pos = videos.flatten(0, 1), pos.flatten(0, 1)
            elif frames is None:
                raise ValueError(
                    "pixel_values_videos of all videos' frames is given without num_frames_per_video"
                )
            frames = [int(f) for f in torch.as_tensor(frames).reshape(-1).tolist()]
            if sum(frames) != videos.shape[0]:
                raise ValueError(
                    f"num_frames_per_video sums to {sum(frames)} frames, pixel_values_videos holds {videos.shape[0]}"
                )
            p, m = self._items(model, videos, pos, "pixel_values_videos", 1)
            parts += p
            meta += m
            context["frames"] = frames
            kwargs["pixel_values_videos"] = kwargs["video_position_ids"] = kwargs["num_frames_per_video"] = (
                None
            )
        if not parts:
            return None
        dtype, _ = dtype_device(self._tower(model))
        rows = np.array([int(t.shape[0]) for t in parts], dtype=np.int64)
        return Items(
            [torch.cat(parts).to(dtype)], rows, np.array(meta, dtype=np.int64).reshape(-1, 4), context
        )

    def empty_payload(self, model):
        dtype, device = dtype_device(self._tower(model))
        return [torch.empty(0, self._patch_pixels(model), dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = dtype_device(self._tower(model))
        k = self._k(model)
        x = torch.zeros(k * k, self._patch_pixels(model), dtype=dtype, device=device)
        return [x], np.array([[0, k, k, k * k]], dtype=np.int64)

    def out_rows(self, model, meta, **options):
        k = self._k(model)
        return (meta[:, 1] // k) * (meta[:, 2] // k)

    def encode(self, model, payload, meta, **options):
        rows = meta[:, 1] * meta[:, 2]
        # padded as the processor padded them (the tower's gradients, not its rows, see the padding)
        longest = int(meta[:, 3].max())
        pix = payload[0].new_zeros(len(meta), longest, payload[0].shape[-1])
        pos = torch.full((len(meta), longest, 2), -1, dtype=torch.long, device=pix.device)
        for i, (patches, (_, w, h, _)) in enumerate(zip(packed_rows(payload[0], rows), meta.tolist())):
            pix[i, : patches.shape[0]] = patches
            pos[i, : patches.shape[0]] = _grid(w, h).to(pix.device)
        out = core(model).get_image_features(pix, pos, return_dict=True).pooler_output
        return [out if isinstance(out, Tensor) else torch.cat(list(out))]  # one tensor before 5.16

    def restore(self, model, kwargs, items, outputs):
        per = packed_rows(outputs[0], self.out_rows(model, items.meta))
        mm = mm_outputs(kwargs)
        n = items.context["images"]
        if n:
            mm["image"] = pooled(tuple(per[:n]))
        frames = items.context["frames"]
        if frames is not None:
            bounds = np.concatenate([[n], n + np.cumsum(frames)]).tolist()
            mm["video"] = pooled(tuple(torch.cat(per[a:b]) for a, b in zip(bounds[:-1], bounds[1:])))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        return image_attention_flops(self._tower(model).config, rows)  # rows: its patches
