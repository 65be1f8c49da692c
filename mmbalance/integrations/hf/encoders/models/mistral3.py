"""Mistral 3 (Mistral Small 3.x): a Pixtral tower at each image's own resolution, one item per image.

Pixtral runs the images of a call as one sequence with a block-diagonal mask (each image attends
to itself only) and rotary positions on the image's own patch grid, so an image encoded apart
gives exactly its rows: ``(h / p / m) * (w / p / m)`` for patch ``p`` and merge ``m``. Only an
image's own patches travel (``pixel_values`` is padded to the batch's largest image); the encoding
rank puts them back into a padded batch of its items with their ``image_sizes``. The forward's
``vision_feature_layer`` is honoured (every rank must pass the same one)."""

from __future__ import annotations

import numpy as np
import torch

from ..adapter import EncoderAdapter, Items, packed_rows, register_adapter
from .common import as_int, core, dtype_device, image_attention_flops, mm_outputs, pending_pixels, pooled

__all__ = ["Mistral3Adapter"]


@register_adapter
class Mistral3Adapter(EncoderAdapter):
    encoder = "vision"
    meta_columns = ("height", "width")
    model_classes = ("Mistral3ForConditionalGeneration", "Mistral3Model")

    def _tower(self, model):
        return core(model).vision_tower

    def _patch(self, model) -> int:
        return as_int(self._tower(model).config.patch_size)

    def _channels(self, model) -> int:
        return int(getattr(self._tower(model).config, "num_channels", 3))

    def _merge(self, model) -> int:
        return int(model.config.spatial_merge_size)

    def call_options(self, model, kwargs):
        layer = kwargs.get("vision_feature_layer")
        layer = model.config.vision_feature_layer if layer is None else layer
        return {"vision_feature_layer": list(layer) if isinstance(layer, (list, tuple)) else int(layer)}

    def extract(self, model, kwargs):
        pix = pending_pixels(kwargs, 4, "images, C, H, W")
        if pix is None:
            return None
        sizes = kwargs.get("image_sizes")
        if sizes is None:
            raise ValueError("pixel_values is given without image_sizes")
        sizes = torch.as_tensor(sizes).reshape(-1, 2).cpu().numpy().astype(np.int64)
        if sizes.shape[0] != pix.shape[0]:
            raise ValueError(
                f"image_sizes has {sizes.shape[0]} rows for {pix.shape[0]} images in pixel_values"
            )
        p, step = self._patch(model), self._patch(model) * self._merge(model)
        if (sizes % step).any():
            raise ValueError(
                f"image_sizes {sizes.tolist()}: every side must be a multiple of {step} (patch x merge)"
            )
        dtype, _ = dtype_device(self._tower(model))
        c = pix.shape[1]
        parts = []
        for img, (h, w) in zip(pix, sizes.tolist()):
            crop = img[:, :h, :w].reshape(c, h // p, p, w // p, p)
            parts.append(crop.permute(1, 3, 0, 2, 4).reshape(-1, c * p * p))
        kwargs["pixel_values"] = None
        rows = (sizes[:, 0] // p) * (sizes[:, 1] // p)
        return Items([torch.cat(parts).to(dtype)], rows, sizes, {"options": self.call_options(model, kwargs)})

    def empty_payload(self, model):
        dtype, device = dtype_device(self._tower(model))
        return [torch.empty(0, self._channels(model) * self._patch(model) ** 2, dtype=dtype, device=device)]

    def dummy(self, model):
        dtype, device = dtype_device(self._tower(model))
        # two merged tokens (see encode)
        step, m = self._patch(model) * self._merge(model), self._merge(model)
        x = torch.zeros(
            2 * m * m, self._channels(model) * self._patch(model) ** 2, dtype=dtype, device=device
        )
        return [x], np.array([[step, 2 * step]], dtype=np.int64)

    def out_rows(self, model, meta, **options):
        step = self._patch(model) * self._merge(model)
        return (meta[:, 0] // step) * (meta[:, 1] // step)

    def encode(self, model, payload, meta, **options):
        options = options or self.call_options(model, {})
        want = int(self.out_rows(model, meta).sum())
        if want == 1:  # get_image_features squeezes a one-token call's rows away: a second item pads it
            extra, extra_meta = self.dummy(model)
            out = self.encode(
                model, [torch.cat([payload[0], extra[0]])], np.concatenate([meta, extra_meta]), **options
            )
            return [out[0][:want]]
        p, c = self._patch(model), self._channels(model)
        rows = (meta[:, 0] // p) * (meta[:, 1] // p)
        pix = payload[0].new_zeros(len(meta), c, int(meta[:, 0].max()), int(meta[:, 1].max()))
        for i, (patches, (h, w)) in enumerate(zip(packed_rows(payload[0], rows), meta.tolist())):
            img = patches.reshape(h // p, w // p, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, h, w)
            pix[i, :, :h, :w] = img
        sizes = torch.as_tensor(meta, dtype=torch.long, device=pix.device)
        out = core(model).get_image_features(pixel_values=pix, image_sizes=sizes, return_dict=True, **options)
        return [torch.cat(list(out.pooler_output))]

    def restore(self, model, kwargs, items, outputs):
        mm = mm_outputs(kwargs)
        mm["image"] = pooled(tuple(packed_rows(outputs[0], self.out_rows(model, items.meta))))
        kwargs["mm_encoder_outputs"] = mm
        return kwargs

    def cost(self, model, meta, rows):
        return image_attention_flops(self._tower(model).config, rows)  # rows: its patches
