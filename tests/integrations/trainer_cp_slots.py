"""Launched by test_trainer_cp.py on 4 CPU ranks (the environment torchrun gives its workers):
long-tail data whose balanced micro-batch slots do not fit the context-parallel budget, so the
slots of some steps must be re-formed (96 short texts and 3 of 173 tokens, 4 ranks,
``max_tokens_per_rank=64``: 256 tokens a slot). For ``per_device_train_batch_size`` 2 and 4
(``MMB_BATCHES``; accumulation 2 and 4), Trainer trains one epoch without and with ``context_parallel=True``; rank 0
saves the initial and final weights and every step's slots (as planned, and as the sampler's
balanced split would have had them) to ``$MMB_TMP``. Then TRL's SFTTrainer (bfloat16,
padding-free), as the refused run was started, trains three steps with context parallelism.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations import trainer_cp  # noqa: E402 - after the path

VOCAB, BUDGET, LR = 96, 64, 0.5
ACCUM = {2: 2, 4: 4}  # accumulation per batch size: a step of 16 or 64 examples


def lengths() -> list[int]:
    rng = np.random.default_rng(11)
    out = [int(x) for x in rng.integers(3, 13, size=96)]
    for at in (5, 40, 77):
        out.insert(at, 173)
    return out


def example(i: int, n: int) -> dict:
    g = torch.Generator().manual_seed(2000 + i)
    ids = torch.randint(3, VOCAB, (n,), generator=g)
    return {"input_ids": ids.tolist(), "labels": ids.tolist()}


def build_model():
    return trainer_cp.build_model(vocab=VOCAB, max_positions=256)


def train(name: str, batch: int, cp: bool) -> None:
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer

    tmp = os.environ["MMB_TMP"]
    data = [example(i, n) for i, n in enumerate(lengths())]
    model = build_model()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seen = trainer_cp.watch(model)
    args = TrainingArguments(
        output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=batch, gradient_accumulation_steps=ACCUM[batch],
        num_train_epochs=1, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
        weight_decay=0.0, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=DataCollatorWithFlattening(return_tensors="pt"))  # fmt: skip
    kw = {"context_parallel": True, "max_tokens_per_rank": BUDGET} if cp else {}
    balance_trainer(trainer, **kw)
    trainer.train()
    rank = int(os.environ["RANK"])
    if rank == 0:
        out = {"max_tokens": max(seen)}
        if cp:
            sampler = trainer.cp_sampler
            plan = sampler.base.plan_epoch()
            g = sampler.base.grad_accum
            slots = sampler.slots()
            out["slots"] = [sorted(int(i) for i in idx) for idx, _ in slots]
            out["balanced"] = [
                sorted(int(i) for i in plan.indices[s][plan.micro[s] == k])
                for s in range(sampler.base.num_steps)
                for k in range(g)
            ]
            out["tokens"] = lengths()
        with open(os.path.join(tmp, f"{name}.json"), "w") as f:
            json.dump(out, f)
        torch.save({"init": init, "final": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   os.path.join(tmp, f"{name}.pt"))  # fmt: skip
    else:
        assert max(seen) <= BUDGET or not cp, (rank, max(seen))


def sft() -> None:
    """TRL's SFTTrainer (its default bfloat16, padding-free) with context parallelism: the issue's
    setup (batch 2, accumulation 2, 4 ranks, budget 64 on texts of 173 tokens) trains, no refusal."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from mmbalance.integrations.hf import balance_trainer

    tmp = os.environ["MMB_TMP"]
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )
    data = Dataset.from_dict({"input_ids": [example(i, n)["input_ids"] for i, n in enumerate(lengths())]})
    args = SFTConfig(
        output_dir=os.path.join(tmp, "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, padding_free=True, max_length=None, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        logging_steps=1,
    )  # fmt: skip
    assert args.bf16, "SFTConfig's default is bf16=True"
    trainer = SFTTrainer(model=build_model(), args=args, processing_class=tok, train_dataset=data)
    balance_trainer(trainer, context_parallel=True, max_tokens_per_rank=BUDGET)
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(tmp, "sft.json"), "w") as f:
            json.dump({"global_step": trainer.state.global_step, "losses": losses}, f)


def main() -> None:
    for batch in (int(b) for b in os.environ.get("MMB_BATCHES", "2,4").split(",")):
        train(f"plain-{batch}", batch, cp=False)
        train(f"cp-{batch}", batch, cp=True)
    sft()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
