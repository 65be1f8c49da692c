"""InternVL: a fixed-resolution InternViT tower, one item per tile; the feature layer and selection
strategy of the forward are honoured (every rank must pass the same ones)."""

from __future__ import annotations

import numpy as np

from ..adapter import register_adapter
from .common import TileAdapter, as_int, core, mm_outputs, pending_pixels, pooled, vision_feature_options

__all__ = ["InternVLAdapter"]


@register_adapter
class InternVLAdapter(TileAdapter):
    model_classes = ("InternVLForConditionalGeneration", "InternVLModel")

    def call_options(self, model, kwargs):
        layer, strategy = vision_feature_options(model, kwargs)
        if strategy != "default":
            # the pixel shuffle needs the square grid of patches, without the CLS token
            raise ValueError(f"vision_feature_select_strategy={strategy!r}: InternVL takes 'default' only")
        return {
            "vision_feature_layer": list(layer) if isinstance(layer, (list, tuple)) else int(layer),
            "vision_feature_select_strategy": strategy,
        }

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs, 4, "tiles, C, H, W")
        return None if pix is None else self._tiles(model, kwargs, pix)

    def _tokens_per_tile(self, model) -> int:
        cfg = self._tower(model).config
        side = as_int(cfg.image_size) // as_int(cfg.patch_size)
        return int(round(side * model.config.downsample_ratio) ** 2)

    def out_rows(self, model, meta, **options):
        return np.full(meta.shape[0], self._tokens_per_tile(model), dtype=np.int64)

    def encode(self, model, payload, meta, **options):
        options = options or self.call_options(model, {})
        feats = (
            core(model).get_image_features(pixel_values=payload[0], return_dict=True, **options).pooler_output
        )
        return [feats.reshape(-1, feats.shape[-1])]

    def restore(self, model, kwargs, items, outputs):
        mm = mm_outputs(kwargs)
        per_tile = self._tokens_per_tile(model)
        mm["image"] = pooled(outputs[0].reshape(len(items), per_tile, outputs[0].shape[-1]))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs
