"""Launched by test_balance_trainer.py on 2 CPU ranks (the environment torchrun gives its workers):
transformers' Trainer on a tiny Llama with ``balance_trainer``, gradient accumulation 2, two epochs,
a checkpoint after 3 optimizer steps; then a second Trainer resumes from that checkpoint
(``MMB_STEPS``: that many optimizer steps instead of the epochs; ``MMB_CP``: with context
parallelism under that many tokens a rank, in ``mmbalance_varlen``). Every rank
logs the micro-batches its loader fetched (dataset indices, in order) to ``$MMB_TMP``; rank 0 saves
the final weights of both runs there."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

N, VOCAB, BATCH, ACCUM, EPOCHS, LR = 37, 64, 2, 2, 2, 0.5


def lengths() -> list[int]:
    """Skewed lengths: mostly short, a few long."""
    g = torch.Generator().manual_seed(7)
    return [int(x) for x in (3 + (torch.rand(N, generator=g) ** 4) * 60).long()]


def build_model():
    """A tiny Llama; by ``MMB_FAMILY``: ``qwen3_5``, a tiny Qwen3.5 language model (Gated DeltaNet
    beside attention); ``qwen3_5_vlm``, Qwen3.5 as a vision-language model (text only here);
    ``gemma4``, Gemma 4's vision-language class without towers. Both vision-language classes opt
    out of the step's token count (``accepts_loss_kwargs = False``: ``balance_trainer`` hands it
    the count)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    family = os.environ.get("MMB_FAMILY", "llama")
    if family == "qwen3_5_vlm":
        from tests.integrations import hf_zoo

        return hf_zoo.build("qwen3_5")
    if family == "gemma4":
        # weights of unit scale: at the default 0.02 the q/k/v norms of so small a model amplify
        # rounding, and one thread against two ends ten SGD steps 100% apart (3 steps: 1e-5)
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

        text = Gemma4TextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=16,
                                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=4,
                                vocab_size_per_layer_input=VOCAB, global_head_dim=8, initializer_range=1.0)  # fmt: skip
        torch.manual_seed(0)
        return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=None,
                                                           audio_config=None))  # fmt: skip
    if family != "llama":
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from transformers import AutoModelForCausalLM

        from tests.integrations.hybrids import tiny_config

        cfg = tiny_config(family)
        cfg.vocab_size, cfg.pad_token_id, cfg.max_position_embeddings = VOCAB, 0, 128
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # decays of e^-0.1..e^-1.3 a token (cp_plain_loop.py says why)
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
        return model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM(cfg)


def example(i: int, length: int) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(3, VOCAB, (length,), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": ids.clone()}


def collate(rows: list[dict]) -> dict:
    """Pads every micro-batch to its longest example."""
    width = max(r["input_ids"].shape[0] for r in rows)
    out = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        t = torch.full((len(rows), width), fill, dtype=torch.long)
        for j, r in enumerate(rows):
            t[j, : r[key].shape[0]] = r[key]
        out[key] = t
    return out


class Logged(torch.utils.data.Dataset):
    """The examples (``rows``, by default this script's); every micro-batch the loader fetches is
    logged (its indices, in order)."""

    def __init__(self, rows: list[dict] | None = None):
        self.rows = rows if rows is not None else [example(i, l) for i, l in enumerate(lengths())]
        self.log: list[list[int]] = []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __getitems__(self, idx):
        self.log.append([int(i) for i in idx])
        return [self.rows[i] for i in idx]


def train(name: str, resume: str | None = None):
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer

    tmp = os.environ["MMB_TMP"]
    args = TrainingArguments(
        output_dir=os.path.join(tmp, "out"), num_train_epochs=EPOCHS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, report_to=[], save_strategy="steps", save_steps=3,
        seed=0, use_cpu=True, disable_tqdm=True, max_steps=int(os.environ.get("MMB_STEPS", -1)),
    )  # fmt: skip
    model = build_model()
    data = Logged()
    budget = os.environ.get("MMB_CP")  # context parallelism under that many tokens a rank
    cp = {"context_parallel": True, "max_tokens_per_rank": int(budget)} if budget else {}
    if budget:
        from mmbalance.integrations.hf import register_attention

        model.set_attn_implementation(register_attention())
    trainer = balance_trainer(
        Trainer(model=model, args=args, train_dataset=data, data_collator=collate), **cp
    )
    trainer.train(resume_from_checkpoint=resume)
    rank = int(os.environ["RANK"])
    # the teardown arrangement: a train-end callback, and the default group kept until exit (the
    # program ends with a plain destroy_process_group() and must still exit with code 0)
    import torch.distributed as dist

    from mmbalance.collectives import teardown
    from mmbalance.integrations.hf.trainer import _teardown_callback_class

    callbacks = [type(cb) for cb in trainer.callback_handler.callbacks]
    arranged = {
        "callbacks": callbacks.count(_teardown_callback_class()),
        "world held": any(g is dist.group.WORLD for g in teardown._HELD),
    }
    with open(os.path.join(tmp, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(
            {"batches": data.log, "per_epoch": len(trainer.get_train_dataloader()), "teardown": arranged}, f
        )
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(tmp, f"{name}.pt")
        )


def main() -> None:
    train("full")
    if os.environ.get("MMB_FAMILY", "llama") == "llama":
        train("resumed", resume=os.path.join(os.environ["MMB_TMP"], "out", "checkpoint-3"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
