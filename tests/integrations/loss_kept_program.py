"""A training program that knows nothing of mmbalance (run by test_loss_kept.py, plain or as
``mmbalance launch [--no-encoders --no-batches] -- -m torch.distributed.run ... loss_kept_program.py``):
four trainers one after the other on a tiny Llama and a word-level tokenizer, 2 CPU ranks, SGD,
gradient accumulation 2, gradient clipping off (``max_grad_norm=0``), so a loss normalized
differently shows in the weights as it is:

* ``trainer``: transformers' ``Trainer`` (the model's causal-LM loss);
* ``sft``: TRL's ``SFTTrainer``;
* ``dpo``: TRL's ``DPOTrainer`` (prompt, chosen and rejected texts);
* ``grpo``: TRL's ``GRPOTrainer`` (2 generations a prompt, a reward that counts one token).

argv: OUT_DIR [NAME ...] (default: all four). Rank 0 saves each trainer's final weights
(``NAME.pt``) and log history (``NAME.json``) to OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VOCAB = 48


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="t0", eos_token="t2", bos_token="t1")


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def _lengths(count: int, seed: int) -> list[int]:
    """Skewed lengths: mostly short, a few long (what balancing would regroup)."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in (2 + (torch.rand(count, generator=g) ** 3) * 30).long()]


# bf16=False: TRL's configs default to bf16 autocast, on CPU too
COMMON = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=0.5,
              optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
              report_to=[], save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True,
              bf16=False)  # fmt: skip


def run(name: str, out: str):
    import datasets

    tok = tokenizer()
    if name == "trainer":
        from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

        rows = [tok(_words(i, n)) for i, n in enumerate(_lengths(24, 1))]
        data = datasets.Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
        return Trainer(model=model(), args=TrainingArguments(output_dir=out, **COMMON), train_dataset=data,
                       data_collator=DataCollatorForLanguageModeling(tok, mlm=False))  # fmt: skip
    if name == "sft":
        from trl import SFTConfig, SFTTrainer

        data = datasets.Dataset.from_dict({"text": [_words(i, n) for i, n in enumerate(_lengths(24, 2))]})
        return SFTTrainer(model=model(), args=SFTConfig(output_dir=out, **COMMON), train_dataset=data,
                          processing_class=tok)  # fmt: skip
    if name == "dpo":
        from trl import DPOConfig, DPOTrainer

        n = _lengths(24, 3)
        data = datasets.Dataset.from_dict({
            "prompt": [_words(i, 2 + k % 5) for i, k in enumerate(n)],
            "chosen": [_words(100 + i, k) for i, k in enumerate(n)],
            "rejected": [_words(200 + i, 1 + k // 2) for i, k in enumerate(n)],
        })  # fmt: skip
        return DPOTrainer(model=model(), ref_model=model(), args=DPOConfig(output_dir=out, **COMMON),
                          train_dataset=data,
                          processing_class=tok)  # fmt: skip
    if name == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        def reward(completions, **kwargs):
            return [float(c.count("t7")) for c in completions]

        data = datasets.Dataset.from_dict({"prompt": [_words(i, 2 + i % 4) for i in range(16)]})
        cfg = GRPOConfig(output_dir=out, num_generations=2, max_completion_length=4, **COMMON)
        return GRPOTrainer(model=model(), reward_funcs=reward, args=cfg, train_dataset=data,
                           processing_class=tok)  # fmt: skip
    raise SystemExit(f"unknown trainer {name!r}")


def main() -> int:
    out = sys.argv[1]
    names = sys.argv[2:] or ["trainer", "sft", "dpo", "grpo"]
    for name in names:
        trainer = run(name, os.path.join(out, name))
        trainer.train()
        if int(os.environ.get("RANK", "0")) == 0:
            weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            torch.save(weights, os.path.join(out, f"{name}.pt"))
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump(trainer.state.log_history, f)
    return 0


if __name__ == "__main__":
    from tests.dist_utils import exit_after_barrier

    exit_after_barrier(main())
