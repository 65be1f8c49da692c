"""Kimi-K2.5: a natural-resolution ViT over ``[patches, 3, p, p]`` pixels with ``*_grid_thw`` rows,
one item per image or video clip.

A clip is one attention span (its frames attend to one another) and its frames are averaged into
one frame's rows before the 2 x 2 merge, so a clip is never split: it returns ``h * w / 4`` rows
whatever its ``t``, and costs the attention of all its ``t * h * w`` patches. Position embeddings
are resampled to each item's own grid, so an item encoded apart gives exactly its rows."""

from __future__ import annotations

import numpy as np

from ..adapter import register_adapter
from .common import as_int
from .qwen_vl import QwenVisionAdapter

__all__ = ["KimiVisionAdapter"]


@register_adapter
class KimiVisionAdapter(QwenVisionAdapter):
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

    def _merge(self, model) -> int:
        kernel = self._visual(model).merge_kernel_size
        h, w = (kernel, kernel) if isinstance(kernel, int) else kernel
        if h != w:
            raise ValueError(
                f"Kimi-K2.5: merge_kernel_size {kernel} is not square (an item's rows assume it is)"
            )
        return int(h)
