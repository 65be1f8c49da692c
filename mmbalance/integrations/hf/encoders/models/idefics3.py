"""Idefics3 and SmolVLM: a SigLIP-style tower over image tiles (each image split into a grid of
tiles plus a global view), then a pixel-shuffle connector. One item per real tile.

``pixel_values`` is ``[batch, tiles, C, H, W]`` with all-zero padding tiles; as in the models, a
tile whose values are all zero is padding and is never encoded (SmolVLM keeps the first tile of a
batch that has no real one). ``pixel_attention_mask`` (``[batch, tiles, H, W]``) travels with its
tile. Outputs go back through ``mm_encoder_outputs``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import EncoderAdapter, Items, register_adapter
from .common import as_int, core, dtype_device, mm_outputs, pending_pixels, pooled

__all__ = ["Idefics3Adapter"]


@register_adapter
class Idefics3Adapter(EncoderAdapter):
    encoder = "vision"
    meta_columns = ("tile",)
    model_classes = (
        "Idefics3ForConditionalGeneration",
        "Idefics3Model",
        "SmolVLMForConditionalGeneration",
        "SmolVLMModel",
    )

    def _tower(self, model):
        return core(model).vision_model

    def _tile(self, model) -> tuple[int, int]:
        cfg = self._tower(model).config
        return int(getattr(cfg, "num_channels", 3)), as_int(cfg.image_size)

    def _keeps_one(self, model) -> bool:
        return any(c.__name__.startswith("SmolVLM") for c in type(model).__mro__)

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs, 5, "batch, tiles, C, H, W")
        if pix is None:
            return None
        dtype, _ = dtype_device(self._tower(model))
        tiles = pix.reshape(-1, *pix.shape[2:])
        real = (tiles != 0).flatten(1).any(1)
        if self._keeps_one(model) and not bool(real.any()):
            real[0] = True
        mask = kwargs.get("pixel_attention_mask")
        if mask is None:
            mask = torch.ones(
                tiles.shape[0], tiles.shape[2], tiles.shape[3], dtype=torch.bool, device=pix.device
            )
        else:
            mask = mask.reshape(-1, *mask.shape[2:]).bool()
        kwargs["pixel_values"] = None
        kwargs["pixel_attention_mask"] = None
        n = int(real.sum())
        return Items([tiles[real].to(dtype), mask[real]], np.ones(n, np.int64), np.zeros((n, 1), np.int64))

    def _tiles_of(self, model, make, n: int) -> list[torch.Tensor]:
        """``n`` tiles and their pixel masks, made by ``make`` (``torch.empty``, ``torch.ones``)."""
        dtype, device = dtype_device(self._tower(model))
        c, s = self._tile(model)
        return [make(n, c, s, s, dtype=dtype, device=device), make(n, s, s, dtype=torch.bool, device=device)]

    def empty_payload(self, model):
        return self._tiles_of(model, torch.empty, 0)

    def dummy(self, model):
        # a tile of ones: an all-zero tile would count as padding and be dropped
        return self._tiles_of(model, torch.ones, 1), np.zeros((1, 1), np.int64)

    def out_rows(self, model, meta, **options):
        cfg = model.config
        side = as_int(cfg.vision_config.image_size) // as_int(cfg.vision_config.patch_size)
        return np.full(meta.shape[0], side * side // int(cfg.scale_factor) ** 2, dtype=np.int64)

    def cost(self, model, meta, rows):
        return np.ones(rows.size)

    def encode(self, model, payload, meta, **options):
        tiles, mask = payload
        out = core(model).get_image_features(tiles[None], mask[None], return_dict=True)
        return [torch.cat(list(out.pooler_output))]

    def restore(self, model, kwargs, items, outputs):
        mm = mm_outputs(kwargs)
        # one tensor [tiles, rows, hidden] (every tile gives the same rows): the form every release's
        # forward takes (lists only from 5.2x on)
        per = self.out_rows(model, items.meta)
        mm["image"] = pooled(outputs[0].reshape(len(per), int(per[0]) if len(per) else 0, -1))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs
