"""A tiny, randomly initialised Qwen3.5 (a Gated DeltaNet layer beside a full-attention layer in its
language model, hidden size 32, Qwen3-VL's 2-layer vision tower) with the tokenizer of
``tiny_qwen2vl.py`` and a Qwen3-VL processor, saved to a folder, offline: what the framework tests
train with LLaMA-Factory's ``qwen3_5`` template.

    python tests/frameworks/tiny_qwen3_5.py OUT_DIR [--seed 0]

Images of 28 to 56 pixels a side give 1 to 4 image tokens (16-pixel patches merged 2 x 2). The
decays of the Gated DeltaNet layer are set to e^-0.1 .. e^-1 a token, as the integration tests set
them (random ones decay the state to nothing within a few tokens, which would hide a state lost
between sequences).
"""

import argparse
import json
import os

import torch
from tiny_qwen2vl import CHAT_TEMPLATE, QWEN_VOCAB, SPECIAL_TOKENS, build_tokenizer, save_tokenizer


def build_model(ids: dict):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(
        vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2],
                         "mrope_interleaved": True, "partial_rotary_factor": 1.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)  # fmt: skip
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):
                module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    torch.manual_seed(args.seed)
    model = build_model(ids)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(args.out_dir, safe_serialization=True)
    tokenizer = save_tokenizer(tokenizer, args.out_dir)
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    try:  # the PIL backend (transformers 5.x), else the default class
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Images,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Images
    pixels = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
    images = Images(min_pixels=32 * 32, max_pixels=64 * 64, **pixels)
    videos = Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 2}, **pixels)
    proc = Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                            chat_template=CHAT_TEMPLATE)  # fmt: skip
    proc.save_pretrained(args.out_dir)
    print(json.dumps({"out_dir": args.out_dir, "special_ids": ids,
                      "n_params": sum(p.numel() for p in model.parameters())}))  # fmt: skip


if __name__ == "__main__":
    main()
