"""Gemma 3 and PaliGemma: a fixed-resolution SigLIP tower, one item per image (Gemma 3's pan-and-scan
crops are images of their own), each encoded alone without a mask, so an image gives the same
rows wherever it is encoded: Gemma 3's ``mm_tokens_per_image`` (the projector pools the patches),
PaliGemma's patches. The projector runs with the tower, on the item's encoding rank."""

from __future__ import annotations

import numpy as np

from ..adapter import register_adapter
from .common import TileAdapter, as_int, core, mm_outputs, pending_pixels, pooled

__all__ = ["Gemma3Adapter", "PaliGemmaAdapter"]


class _ProjectedTiles(TileAdapter):
    """Tiles whose projected features ``get_image_features`` returns as ``[tiles, tokens, hidden]``."""

    def _tokens_per_tile(self, model) -> int:
        raise NotImplementedError

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs, 4, "images, C, H, W")
        return None if pix is None else self._tiles(model, kwargs, pix)

    def out_rows(self, model, meta):
        return np.full(meta.shape[0], self._tokens_per_tile(model), dtype=np.int64)

    def encode(self, model, payload, meta):
        feats = core(model).get_image_features(pixel_values=payload[0], return_dict=True).pooler_output
        return [feats.reshape(-1, feats.shape[-1])]

    def restore(self, model, kwargs, items, outputs):
        mm = mm_outputs(kwargs)
        tokens = self._tokens_per_tile(model)
        mm["image"] = pooled(outputs[0].reshape(len(items), tokens, outputs[0].shape[-1]))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs


@register_adapter
class Gemma3Adapter(_ProjectedTiles):
    model_classes = ("Gemma3ForConditionalGeneration", "Gemma3Model")

    def _tokens_per_tile(self, model) -> int:
        return int(model.config.mm_tokens_per_image)


@register_adapter
class PaliGemmaAdapter(_ProjectedTiles):
    model_classes = ("PaliGemmaForConditionalGeneration", "PaliGemmaModel")

    def _tokens_per_tile(self, model) -> int:
        cfg = self._tower(model).config
        return (as_int(cfg.image_size) // as_int(cfg.patch_size)) ** 2
