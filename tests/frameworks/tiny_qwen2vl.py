"""A tiny, randomly initialised Qwen2-VL (hidden size 32, 2 layers, a 2-layer vision tower) with
its tokenizer and processor, saved to a folder, offline: what the framework tests train.

    python tests/frameworks/tiny_qwen2vl.py OUT_DIR [--seed 0] [--text]

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small corpus, the
special tokens Qwen2-VL needs follow its vocabulary, and the model config's token ids come from
the tokenizer. Images of 28 to 56 pixels a side give 1 to 4 image tokens. The processor includes
a video processor, which needs torchvision (the frameworks' environments have it). ``--text``
saves the same language model alone, a Qwen2 causal LM with the same tokenizer.
"""

import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A Qwen2-VL style chat template (written for this test; supports string content and
# list content with {"type": "image"} / {"type": "text"} parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a helpful assistant.",
    "system user assistant",
    "Describe the picture. What color is the square? How many images are there?",
    "The image shows a red square on a blue background. There are two images.",
    "Count from one to ten: one two three four five six seven eight nine ten.",
    "The quick brown fox jumps over the lazy dog. A tiny model learns slowly.",
    "Answer briefly. Yes. No. Maybe. Hello world! Thanks, goodbye.",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? ' \" \n\t",
]


QWEN_SPECIAL_START = 151643  # <|endoftext|> in Qwen2's vocabulary
QWEN_VOCAB = 151936  # the embedding rows of Qwen2-VL


def build_tokenizer(
    vocab_size: int = 400, special_start: int = QWEN_SPECIAL_START
) -> PreTrainedTokenizerFast:
    """The byte-level BPE, its special tokens from id ``special_start`` on (Qwen2's own ids by
    default; a small vocabulary for tests that need no framework's hard-coded ids)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    # the special tokens at Qwen2's own ids (151643 on, in its order): frameworks hard-code some of
    # them (ms-swift's Qwen2-VL template expands images at <|image_pad|> = 151655), so the small
    # vocabulary is padded with entries no text produces up to there
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), special_start):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out_dir: str):
    """Save ``tokenizer`` to ``out_dir`` loadable as a Qwen2 tokenizer, and return it reloaded so.

    Processors check the class (Qwen2VLProcessor wants Qwen2Tokenizer/Qwen2TokenizerFast);
    "Qwen2TokenizerFast" loads from tokenizer.json alone. transformers 5.x writes
    "extra_special_tokens" as a list, which 4.x can't read, so the list goes under the old key."""
    tokenizer.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg["tokenizer_class"] = "Qwen2TokenizerFast"
    tcfg.pop("backend", None)
    extra = tcfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        tcfg["additional_special_tokens"] = extra
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f, indent=1)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out_dir)


def build_image_processor():
    kw = dict(
        min_pixels=28 * 28,  # 28x28 image -> grid (1, 2, 2) -> 1 merged image token
        max_pixels=56 * 56,  # 56x56 image -> grid (1, 4, 4) -> 4 merged image tokens
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    try:  # transformers >= 5.x: the PIL (non-torchvision) backend class
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(**kw)
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(**kw)


def build_config(ids: dict, vocab_size: int) -> Qwen2VLConfig:
    """The tiny Qwen2-VL's config for a tokenizer's special token ``ids``."""
    hidden = 32
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_dim 16 -> rotary half-dim 8 = sum(mrope_section)
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=hidden,  # merger output dim == LM hidden size
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    return config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", action="store_true", help="the language model alone (a Qwen2 causal LM)")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert ids["<|image_pad|>"] == 151655, ids
    vocab_size = QWEN_VOCAB

    config = build_config(ids, vocab_size)
    torch.manual_seed(args.seed)
    if args.text:  # the same language model without the tower: LLaMA-Factory's text-only stages
        from transformers import Qwen2Config, Qwen2ForCausalLM

        text = config.text_config.to_dict()
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in text.items() if k != "model_type"}))
    else:
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(args.out_dir, safe_serialization=True)
    tokenizer = save_tokenizer(tokenizer, args.out_dir)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == ids["<|image_pad|>"]

    if args.text:
        with open(os.path.join(args.out_dir, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
        print(f"tiny Qwen2 (text): {sum(p.numel() for p in model.parameters())} parameters -> {args.out_dir}")
        return
    image_processor = build_image_processor()
    image_processor.save_pretrained(args.out_dir)
    # Qwen2VLProcessor = image processor + tokenizer + video processor; the video processor
    # class (Qwen2VLVideoProcessor) needs torchvision. Without torchvision only the tokenizer
    # and image processor files are written (and the frameworks then fail to load a processor).
    try:
        from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor(
            size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56 * 2},
            patch_size=14,
            temporal_patch_size=2,
            merge_size=2,
        )
        proc = Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=CHAT_TEMPLATE,
        )
        proc.save_pretrained(args.out_dir)
        print("saved Qwen2VLProcessor")
    except Exception as e:  # noqa: BLE001
        print(f"WARNING Qwen2VLProcessor not saved ({type(e).__name__}: {e})")
        with open(os.path.join(args.out_dir, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)

    n_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "out_dir": args.out_dir,
                "len_tokenizer": len(tokenizer),
                "vocab_size": vocab_size,
                "special_ids": ids,
                "n_params": n_params,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
