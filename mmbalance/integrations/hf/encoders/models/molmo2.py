"""Molmo2: a fixed-size ViT over each image's crops (its resized view and its overlapping tiles),
then an attention pooling whose every output token pools a window of its image's patches, one item
per image and per video.

The processor gives ``pixel_values [crops, patches, pixels]`` for all images of the batch,
``image_num_crops`` (crops per image), ``image_grids`` (per image the pooled grids of its resized
view and of its tiles: ``h1 * w1 + h2 * w2`` tokens) and ``image_token_pooling [tokens, window]``:
per token the indices of the patches it pools, into the batch's flattened patches (``-1`` pads a
window at the image's edge). The tower runs crop by crop and a token pools its own image's patches
only, so an image encoded apart gives exactly its rows once its indices count from its own first
patch: that is how they travel (beside the image's patch rows, ``-1`` filling the window up to
:data:`POOL_CAP` columns and the rows past its tokens), and the encoding rank adds back where its
items' patches start. A video is one item: its frames are its crops and ``video_grids`` ``(frames,
rows, cols)`` its pooled grid (``get_video_features`` takes it as an image of ``frames * rows x
cols`` tokens).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..adapter import EncoderAdapter, Items, packed_rows, register_adapter
from .common import as_int, core, dtype_device, image_attention_flops, mm_outputs, pooled

__all__ = ["Molmo2Adapter", "POOL_CAP"]

#: the widest pooling window that travels (a 4 x 4 window; the processors pool 2 x 2 for images, 3 x 3
#: for video frames)
POOL_CAP = 16


@register_adapter
class Molmo2Adapter(EncoderAdapter):
    encoder = "vision"
    meta_columns = ("video", "crops", "h1", "w1", "h2", "w2", "window")
    model_classes = ("Molmo2ForConditionalGeneration", "Molmo2Model")

    def _tower(self, model):
        return core(model).vision_tower

    def _patches(self, model) -> int:
        """Patches of one crop."""
        cfg = self._tower(model).config
        size = cfg.image_size if isinstance(cfg.image_size, (list, tuple)) else [cfg.image_size] * 2
        p = as_int(cfg.patch_size)
        return (int(size[0]) // p) * (int(size[-1]) // p)

    def _pixels(self, model) -> int:
        cfg = self._tower(model).config
        return as_int(cfg.patch_size) ** 2 * int(getattr(cfg, "num_channels", 3))

    def _stream(self, model, pix: Tensor, pool, grids, crops: list[int], key: str, pool_key: str, video: int):
        """``(patch rows, window rows, meta)`` of one stream's items, their windows counted from each
        item's own first patch; raises ValueError naming the key of an input that does not fit."""
        per = self._patches(model)
        if pix.dim() == 4:  # [images, crops, patches, pixels]: as get_image_features flattens it
            pix = pix.reshape(-1, pix.shape[-2], pix.shape[-1])
        if pix.dim() != 3 or pix.shape[1] != per:
            raise ValueError(f"{key} must be [crops, {per} patches, pixels], got shape {tuple(pix.shape)}")
        if pool is None:
            raise ValueError(f"{key} is given without {pool_key}")
        pool = torch.as_tensor(pool).cpu().long()
        if pool.dim() != 2 or pool.shape[1] > POOL_CAP:
            raise ValueError(
                f"{pool_key} must be [tokens, window] with a window of at most {POOL_CAP} patches, got shape "
                f"{tuple(pool.shape)}"
            )
        if sum(crops) != pix.shape[0]:
            raise ValueError(f"{key} holds {pix.shape[0]} crops, the grids and crop counts give {sum(crops)}")
        tokens = [int(g[0] * g[1] + g[2] * g[3]) for g in grids]
        if sum(tokens) != pool.shape[0]:
            raise ValueError(f"{pool_key} has {pool.shape[0]} rows, the grids give {sum(tokens)} tokens")
        windows, meta, at, first = [], [], 0, 0
        for i, (n, t, g) in enumerate(zip(crops, tokens, grids)):
            own = pool[at : at + t]
            rebased = torch.where(own >= 0, own - first, own)
            if bool((rebased >= n * per).any()) or bool(((own >= 0) & (rebased < 0)).any()) or t > n * per:
                raise ValueError(
                    f"{pool_key}: the tokens of item {i} pool patches outside its own {n} crops (or it has more "
                    f"tokens than patches)"
                )
            block = torch.full((n * per, POOL_CAP), -1, dtype=torch.long)
            block[:t, : own.shape[1]] = rebased
            windows.append(block)
            meta.append((video, n, *[int(x) for x in g], int(pool.shape[1])))
            at, first = at + t, first + n * per
        return pix.reshape(-1, pix.shape[-1]), torch.cat(windows), meta

    def extract(self, model, kwargs):
        mm = mm_outputs(kwargs)
        patches, windows, meta, context = [], [], [], {}
        pix = kwargs.get("pixel_values")
        if pix is not None and mm.get("image") is None:
            grids, counts = kwargs.get("image_grids"), kwargs.get("image_num_crops")
            if grids is None or counts is None:
                raise ValueError("pixel_values is given without image_grids and image_num_crops")
            grids = torch.as_tensor(grids).cpu().long().reshape(-1, 4).tolist()
            crops = [int(c) for c in torch.as_tensor(counts).reshape(-1).tolist()]
            if len(crops) != len(grids):
                raise ValueError(f"image_num_crops has {len(crops)} images, image_grids {len(grids)}")
            rows, win, m = self._stream(model, pix, kwargs.get("image_token_pooling"), grids, crops,
                                        "pixel_values", "image_token_pooling", 0)  # fmt: skip
            patches.append(rows)
            windows.append(win)
            meta += m
            context["image"] = len(m)
            kwargs["pixel_values"] = kwargs["image_token_pooling"] = None
        videos = kwargs.get("pixel_values_videos")
        if videos is not None and mm.get("video") is None:
            vgrids = kwargs.get("video_grids")
            if vgrids is None:
                raise ValueError("pixel_values_videos is given without video_grids")
            vgrids = torch.as_tensor(vgrids).cpu().long().reshape(-1, 3).tolist()
            grids = [[f * r, c, 0, 0] for f, r, c in vgrids]  # as get_video_features lays a video out
            rows, win, m = self._stream(model, videos, kwargs.get("video_token_pooling"), grids,
                                        [f for f, _, _ in vgrids], "pixel_values_videos", "video_token_pooling", 1)  # fmt: skip
            patches.append(rows)
            windows.append(win)
            meta += m
            context["video"] = len(m)
            kwargs["pixel_values_videos"] = kwargs["video_token_pooling"] = None
        if not patches:
            return None
        dtype, _ = dtype_device(self._tower(model))
        meta_np = np.array(meta, dtype=np.int64).reshape(-1, len(self.meta_columns))
        rows = meta_np[:, 1] * self._patches(model)
        return Items([torch.cat(patches).to(dtype), torch.cat(windows)], rows, meta_np, context)

    def empty_payload(self, model):
        dtype, device = dtype_device(self._tower(model))
        return [
            torch.empty(0, self._pixels(model), dtype=dtype, device=device),
            torch.empty(0, POOL_CAP, dtype=torch.long, device=device),
        ]

    def dummy(self, model):
        dtype, device = dtype_device(self._tower(model))
        per = self._patches(model)
        windows = torch.full((per, POOL_CAP), -1, dtype=torch.long, device=device)
        windows[0, 0] = 0  # one token pooling the first patch
        x = torch.zeros(per, self._pixels(model), dtype=dtype, device=device)
        return [x, windows], np.array([[0, 1, 1, 1, 0, 0, 1]], dtype=np.int64)

    def out_rows(self, model, meta, **options):
        return meta[:, 2] * meta[:, 3] + meta[:, 4] * meta[:, 5]

    def encode(self, model, payload, meta, **options):
        per = self._patches(model)
        rows = meta[:, 1] * per
        tokens = self.out_rows(model, meta)
        width = int(meta[:, 6].max())
        pools, first = [], 0
        for win, n, t in zip(packed_rows(payload[1], rows), rows.tolist(), tokens.tolist()):
            own = win[:t, :width]
            pools.append(torch.where(own >= 0, own + first, own))
            first += n
        pix = payload[0].reshape(-1, per, payload[0].shape[-1])
        grids = torch.as_tensor(meta[:, 2:6], dtype=torch.long, device=pix.device)
        out = core(model).get_image_features(pix, torch.cat(pools).to(pix.device), grids).pooler_output
        return [torch.cat(list(out))]

    def restore(self, model, kwargs, items, outputs):
        per = packed_rows(outputs[0], self.out_rows(model, items.meta))
        mm = mm_outputs(kwargs)
        start = 0
        for name in ("image", "video"):
            count = items.context.get(name, 0)
            if count:
                mm[name] = pooled(tuple(per[start : start + count]))
                start += count
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        """Each crop through the tower, attending within itself (the pooling is a small part)."""
        per_crop = float(
            image_attention_flops(self._tower(model).config, np.array([self._patches(model)]))[0]
        )
        return meta[:, 1].astype(np.float64) * per_crop
