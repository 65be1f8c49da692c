"""TRL's ``DPOTrainer`` on 2 CPU ranks, plain or with ``balance_trainer`` (run by
test_preference.py under ``torch.distributed.run``).

    preference_program.py OUT_DIR KIND MODE

KIND: ``text`` (a tiny Llama, word-level tokenizer, prompt / chosen / rejected texts of skewed
lengths) or ``vlm`` (the tiny Qwen2-VL of ``tests/frameworks/tiny_qwen2vl.py`` with a small
vocabulary, 0 to 3 images of 28 to 56 pixels a side per pair). MODE: ``plain`` (the trainer as it comes),
``trainer`` (``balance_trainer(trainer, order="trainer")``: the steps take the trainer's own pairs)
or ``sampler`` (``balance_trainer(trainer)``: the balanced sampler's own draw). 24 pairs, 2 pairs
per micro-batch, 2 micro-batches per step, 3 SGD steps (one epoch), gradient clipping off.

Rank 0 writes ``weights.pt`` and ``log.json`` (the log history); every rank writes
``rows.RANK.json``: each micro-batch's rows as the loss saw them (the tokens under the attention
mask), and ``pairs.json`` (rank 0) the two rows of every pair as the collator makes them alone.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "frameworks"))

VOCAB = 48
PAIRS = 24
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=int(os.environ.get("PREF_STEPS", "3")), learning_rate=0.5,
              optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
              report_to=[], save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True, bf16=False)  # fmt: skip


def _skewed(count: int, seed: int, top: int) -> list[int]:
    """Mostly short, a few long: what balancing regroups."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in (1 + (torch.rand(count, generator=g) ** 3) * top).long()]


def _words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def text_parts():
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", eos_token="t2", bos_token="t1")

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        return LlamaForCausalLM(cfg)

    n = _skewed(PAIRS, 3, 60)
    data = datasets.Dataset.from_dict({
        "prompt": [_words(i, 2 + k % 5) for i, k in enumerate(n)],
        "chosen": [_words(100 + i, k) for i, k in enumerate(n)],
        "rejected": [_words(200 + i, 1 + k // 2) for i, k in enumerate(n)],
    })  # fmt: skip
    return model, tok, data


def _processor(tiny, tokenizer):
    """Qwen2-VL's processor without a video processor (whose class needs torchvision): images only."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    stock = ProcessorMixin.check_argument_for_proper_class

    def check(self, name, arg):
        if name == "video_processor" and arg is None:
            return None
        return stock(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check
    try:
        return Qwen2VLProcessor(image_processor=tiny.build_image_processor(), tokenizer=tokenizer,
                                video_processor=None, chat_template=tiny.CHAT_TEMPLATE)  # fmt: skip
    finally:
        ProcessorMixin.check_argument_for_proper_class = stock


SPECIAL_START = 400  # the tiny Qwen2-VL's special tokens right after its 400 BPE entries


def vlm_parts():
    import datasets
    import numpy as np
    import tiny_qwen2vl
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = tiny_qwen2vl.build_tokenizer(special_start=SPECIAL_START)
    proc = _processor(tiny_qwen2vl, tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny_qwen2vl.SPECIAL_TOKENS}
    config = tiny_qwen2vl.build_config(ids, SPECIAL_START + len(ids))
    words = " ".join(tiny_qwen2vl.CORPUS).split()

    def model():
        torch.manual_seed(0)
        return Qwen2VLForConditionalGeneration(config).to(torch.float32)

    def text(seed, n):
        g = torch.Generator().manual_seed(seed)
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    rows = []
    n = _skewed(PAIRS, 5, 40)
    for i, k in enumerate(n):
        g = np.random.default_rng(i)
        images = [
            Image.fromarray(
                g.integers(0, 255, (int(g.integers(1, 3)) * 28, int(g.integers(1, 3)) * 28, 3), np.uint8)
            )
            for _ in range(int(g.integers(0, 4)))
        ]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text(i, 2 + i % 4)}]
        rows.append({
            "images": images,
            "prompt": [{"role": "user", "content": content}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": text(100 + i, k)}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": text(200 + i, 1 + k // 2)}]}],
        })  # fmt: skip
    return model, proc, datasets.Dataset.from_list(rows)


def build(kind: str, out: str):
    from trl import DPOConfig, DPOTrainer

    model, processing, data = text_parts() if kind == "text" else vlm_parts()
    args = DPOConfig(output_dir=out, **COMMON)
    return DPOTrainer(
        model=model(), ref_model=model(), args=args, train_dataset=data, processing_class=processing
    )


def _rows(batch) -> list[list[int]]:
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [ids[r][mask[r]].tolist() for r in range(ids.shape[0])]


def main() -> int:
    out, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    trainer = build(kind, out)
    if rank == 0:  # every pair's two rows as the collator makes them alone
        pairs = []
        trainer._set_signature_columns_if_needed()
        for i in range(len(trainer.train_dataset)):
            item = {k: v for k, v in trainer.train_dataset[i].items() if k in trainer._signature_columns}
            pairs.append(_rows(trainer.data_collator([copy.deepcopy(item)])))
        with open(os.path.join(out, "pairs.json"), "w") as f:
            json.dump(pairs, f)
    if mode != "plain":
        from mmbalance.integrations.hf import balance_trainer

        balance_trainer(trainer, order="trainer") if mode == "trainer" else balance_trainer(trainer)
    seen = []
    stock = trainer.compute_loss

    def compute_loss(model, inputs, *a, **k):
        seen.append(_rows(inputs))
        loss = stock(model, inputs, *a, **k)
        if os.environ.get("PREF_ALL_WEIGHTS"):
            seen[-1].append([float(loss.detach() if not isinstance(loss, tuple) else loss[0].detach())])
            seen[-1].append(
                [float(x.grad.abs().sum()) if x.grad is not None else 0.0 for x in model.parameters()][:4]
            )
        return loss

    trainer.compute_loss = compute_loss
    if os.environ.get("PREF_ALL_WEIGHTS"):
        step = trainer.training_step

        def training_step(*a, **k):
            out = step(*a, **k)
            seen[-1].append(
                [
                    float(x.grad.double().abs().sum()) if x.grad is not None else -1.0
                    for x in trainer.model.parameters()
                ]
            )
            return out

        trainer.training_step = training_step
    trainer.train()
    with open(os.path.join(out, f"rows.{rank}.json"), "w") as f:
        json.dump(seen, f)
    if os.environ.get("PREF_ALL_WEIGHTS"):
        torch.save(trainer.model.state_dict(), os.path.join(out, f"weights.{rank}.pt"))
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            os.path.join(out, "weights.pt"),
        )
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    return 0


if __name__ == "__main__":
    from tests.dist_utils import exit_after_barrier

    exit_after_barrier(main())
