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
InternVL                               vision    a tile                         one per tile
Idefics3, SmolVLM                      vision    a real tile (padding dropped)  one per tile
Qwen2-Audio                            audio     a clip (always 30 s)           one per clip
Qwen2.5-Omni thinker                   audio     a clip (its valid frames)      linear in its frames
=====================================  ========  =============================  ==========================

Encoder outputs go back through the models' public hooks: ``mm_encoder_outputs`` for images and
videos (the model then skips its encoder and scatters the given features), the input embeddings
for audio towers (which have no such hook). Everything after the encoder (LLaVA-NeXT's tile
packing, M-RoPE positions, the language model) runs on the item's own rank, unchanged.
"""

from .idefics3 import Idefics3Adapter
from .internvl import InternVLAdapter
from .llava import LlavaAdapter, LlavaNextAdapter
from .qwen_audio import Qwen2AudioAdapter
from .qwen_omni import QwenOmniAudioAdapter
from .qwen_vl import Qwen3VLMoeVisionAdapter, QwenVisionAdapter

__all__ = [
    "Idefics3Adapter",
    "InternVLAdapter",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "Qwen2AudioAdapter",
    "Qwen3VLMoeVisionAdapter",
    "QwenOmniAudioAdapter",
    "QwenVisionAdapter",
]
