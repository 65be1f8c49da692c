"""GLM-4.1V, GLM-4.5V (GLM-4.1V's tower beside a mixture-of-experts language model) and GLM-4.6V:
the Qwen ViT's item layout (flattened patches, ``*_grid_thw`` rows), one item per image and one per
temporal frame of a video.

The tower attends within each frame (``cu_seqlens`` restart at every frame) and its position
table is resampled to each item's own grid, so a frame encoded apart gives exactly the rows it
gives inside its video: ``t * h * w / merge**2`` rows. The models take a video's placeholders as
image tokens (``mm_token_type_ids`` tells them apart): a batch carries images or videos, as the
models themselves require."""

from __future__ import annotations

from ..adapter import register_adapter
from .qwen_vl import QwenVisionAdapter

__all__ = ["GlmVisionAdapter"]


@register_adapter
class GlmVisionAdapter(QwenVisionAdapter):
    model_classes: tuple[str, ...] = (
        "Glm4vForConditionalGeneration",
        "Glm4vModel",
        "Glm4vMoeForConditionalGeneration",
        "Glm4vMoeModel",
        "Glm46VForConditionalGeneration",
        "Glm46VModel",
    )
