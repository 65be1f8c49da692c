"""Built-in encoder adapters, one file per model family (transformers >= 5.18: the
``mm_encoder_outputs`` hook). Importing this package registers them.

=====================================  ========  =============================  ==========================
model class                            encoder   item                           cost ("auto")
=====================================  ========  =============================  ==========================
Qwen2-VL, Qwen2.5-VL, Qwen3-VL,        vision    an image, or one frame of a    linear in its patches plus
Qwen3-VL-MoE (and the Qwen2.5-Omni               video (``*_grid_thw`` row:     attention per frame
thinker's ViT)                                   ``t`` frames)                  (windowed in Qwen2.5)
LLaVA (1.5)                            vision    an image (one tile)            one per tile
LLaVA-NeXT                             vision    a tile (``image_sizes``:       one per tile
                                                 base tile + grid tiles)
LLaVA-OneVision                        vision    an image with its tiles        one per tile
                                                 (packed there), a video frame
InternVL                               vision    a tile                         one per tile
Idefics3, SmolVLM                      vision    a real tile (padding dropped)  one per tile
Qwen2-Audio                            audio     a clip (always 30 s)           one per clip
Qwen2.5-Omni thinker                   audio     a clip (its valid frames)      linear in its frames
Qwen3-Omni-MoE thinker                 vision    as Qwen3-VL (its audio tower   as Qwen3-VL
                                                 stays with the thinker:
                                                 ``qwen_omni.py`` says why)
GLM-4.1V, GLM-4.5V, GLM-4.6V           vision    an image, or one frame of a    linear in its patches plus
                                                 video                          attention per frame
Gemma 3, PaliGemma                     vision    an image (a pan-and-scan crop  one per image
                                                 is an image of its own)
Gemma 4                                vision    an image, or one frame of a    linear in its patches plus
                                                 video (its own size; only its  attention over the image
                                                 patches travel)
Mistral 3                              vision    an image (its own size; only   linear in its patches plus
                                                 its patches travel)            attention over the image
Kimi-K2.5                              vision    an image or a whole clip       linear in its patches plus
                                                 (frames attend to each other)  attention over the clip
MiniCPM-V 4.6                          vision    a slice (thumbnail or crop)    linear in its patches plus
                                                 of an image or a video frame   attention over the slice
                                                 (only its patches travel)      (a quarter after the merger)
Ernie-4.5-VL                           vision    an image, or two frames of a   linear in its patches plus
                                                 video (its resampler merges    attention per frame
                                                 them)
Molmo2                                 vision    an image (its crops and the    one ViT pass per crop
                                                 pooling windows of its tokens)
                                                 or a video (its frames)
=====================================  ========  =============================  ==========================

Encoder outputs go back through the models' public hooks: ``mm_encoder_outputs`` for images and
videos (the model then skips its encoder and scatters the given features), the input embeddings
for audio towers (which have no such hook). Everything after the encoder (LLaVA-NeXT's tile
packing, M-RoPE positions, the language model) runs on the item's own rank, unchanged.
"""

from .gemma import Gemma3Adapter, PaliGemmaAdapter
from .gemma4 import Gemma4VisionAdapter
from .idefics3 import Idefics3Adapter
from .internvl import InternVLAdapter
from .llava import LlavaAdapter, LlavaNextAdapter, LlavaOnevisionAdapter
from .minicpmv import MiniCPMV46Adapter
from .mistral3 import Mistral3Adapter
from .molmo2 import Molmo2Adapter
from .qwen_audio import Qwen2AudioAdapter
from .qwen_omni import QwenOmniAudioAdapter
from .qwen_vl import (
    ErnieVisionAdapter,
    GlmVisionAdapter,
    KimiVisionAdapter,
    Qwen3OmniVisionAdapter,
    Qwen3VLMoeVisionAdapter,
    QwenVisionAdapter,
)

__all__ = [
    "ErnieVisionAdapter",
    "Gemma3Adapter",
    "Gemma4VisionAdapter",
    "GlmVisionAdapter",
    "Idefics3Adapter",
    "InternVLAdapter",
    "KimiVisionAdapter",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "LlavaOnevisionAdapter",
    "MiniCPMV46Adapter",
    "Mistral3Adapter",
    "Molmo2Adapter",
    "PaliGemmaAdapter",
    "Qwen2AudioAdapter",
    "Qwen3OmniVisionAdapter",
    "Qwen3VLMoeVisionAdapter",
    "QwenOmniAudioAdapter",
    "QwenVisionAdapter",
]
