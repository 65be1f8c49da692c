"""Launched by test_trainer_cp.py on 4 CPU ranks (the environment torchrun gives its workers):
transformers' Trainer on a tiny Llama with ``balance_trainer``, first without context parallelism,
then with ``context_parallel=True`` and a budget that splits the long examples, then resumed from
the CP run's checkpoint after 3 optimizer steps. The CP run uses gradient checkpointing (backward
recomputes every layer, its ring attention included), the resumed run does not. Every rank logs what its loader fetched and the
largest number of tokens its embedding saw in one forward to ``$MMB_TMP``; rank 0 saves the final
weights of every run there.

``MMB_MODE=stream`` instead streams an ``IterableDataset`` (post-balanced by all-to-all), with and
without context parallelism, logging every drawn example per micro-batch for a replay.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations.trainer_balanced_batches import (  # noqa: E402 - after the path
    ACCUM,
    BATCH,
    EPOCHS,
    LR,
    VOCAB,
    Logged,
    collate,
    lengths,
)

BUDGET = 52


def build_model(vocab: int = VOCAB, layers: int = 2, max_positions: int = 128):
    """A tiny Llama (seed 0) on the ``mmbalance_varlen`` attention (the CP trainer scripts share it);
    ``MMB_FAMILY=qwen3_5``: a tiny Qwen3.5 instead (a Gated DeltaNet layer and a full-attention one,
    its decays e^-0.1..e^-1.3 a token as in ``cp_plain_loop.py``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mmbalance.integrations.hf import register_attention

    register_attention()
    family = os.environ.get("MMB_FAMILY", "llama")
    if family != "llama":
        from transformers import AutoModelForCausalLM

        from tests.integrations.hybrids import tiny_config

        cfg = tiny_config(family)
        cfg.vocab_size, cfg.pad_token_id, cfg.max_position_embeddings = vocab, 0, max_positions
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation="mmbalance_varlen", dtype=torch.float32
        )
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
        return model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM._from_config(cfg, attn_implementation="mmbalance_varlen")


def example(i: int, length: int) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(3, VOCAB, (length,), generator=g)
    labels = ids.clone()
    labels[: min(2, length)] = -100  # a prompt
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(length, dtype=torch.long),
        "labels": labels,
        "idx": i,
    }


def examples() -> list[dict]:
    """The skewed examples of ``trainer_balanced_batches`` (the two longest, 53 and 56 tokens, exceed
    the budget), with a 2-token prompt masked out of the labels and their index."""
    return [example(i, n) for i, n in enumerate(lengths())]


class Stream(torch.utils.data.IterableDataset):
    """The examples as a stream (every rank sees the same stream); draws are logged per rank."""

    def __init__(self):
        self.rows = examples()
        self.drawn: list = []  # [optimizer steps done when drawn, example ids] per micro-batch
        self.trainer = None

    def __iter__(self):
        yield from self.rows


def logging_collate(stream: Stream):
    def fn(rows):
        trainer = getattr(stream, "trainer", None)
        step = trainer.state.global_step if trainer is not None else -1
        stream.drawn.append([step, [int(r["idx"]) for r in rows]])
        return collate(rows)

    return fn


def args_for(tmp: str, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        **extra,
    )  # fmt: skip


def watch(model) -> list[int]:
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(int(i[0].numel())))
    return seen


def train(name: str, cp: bool, resume: str | None = None, ckpt: bool = False):
    from transformers import Trainer

    from mmbalance.integrations.hf import balance_trainer

    tmp = os.environ["MMB_TMP"]
    args = args_for(
        tmp, num_train_epochs=EPOCHS, save_strategy="steps" if cp and not resume else "no", save_steps=3,
        gradient_checkpointing=ckpt,
    )  # fmt: skip
    model = build_model()
    seen = watch(model)
    attn: list[int] = []  # layer 0's attention calls: twice a forward under gradient checkpointing
    next(
        layer for layer in model.model.layers if hasattr(layer, "self_attn")
    ).self_attn.register_forward_hook(lambda m, i, o: attn.append(1))
    data = Logged(examples())
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    kw = {"context_parallel": True, "max_tokens_per_rank": BUDGET} if cp else {}
    balance_trainer(trainer, **kw)
    trainer.train(resume_from_checkpoint=resume)
    rank = int(os.environ["RANK"])
    with open(os.path.join(tmp, f"{name}-rank{rank}.json"), "w") as f:
        json.dump(
            {"batches": data.log, "max_tokens": max(seen), "forwards": len(seen), "attention": len(attn)}, f
        )
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(tmp, f"{name}.pt")
        )


def stream(name: str, cp: bool):
    from transformers import Trainer

    from mmbalance.integrations.hf import balance_trainer

    tmp = os.environ["MMB_TMP"]
    model = build_model()
    seen = watch(model)
    data = Stream()
    trainer = Trainer(model=model, args=args_for(tmp, max_steps=3), train_dataset=data,
                      data_collator=logging_collate(data))  # fmt: skip
    data.trainer = trainer
    kw = {"context_parallel": True, "max_tokens_per_rank": stream_budget()} if cp else {}
    balance_trainer(trainer, **kw)
    trainer.train()
    rank = int(os.environ["RANK"])
    with open(os.path.join(tmp, f"{name}-rank{rank}.json"), "w") as f:
        json.dump({"drawn": data.drawn, "max_tokens": max(seen)}, f)
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(tmp, f"{name}.pt")
        )


def stream_budget() -> int:
    """Tokens per rank for the streamed runs: the longest examples (53, 56) are split either way."""
    return 48 if int(os.environ["WORLD_SIZE"]) >= 4 else 50


def loop(name: str):
    """A plain loop over this rank's slice of the stream: ``handle.batches`` post-balances every
    micro-batch; gradients summed over ranks, one SGD step per micro-batch."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from mmbalance.integrations.hf import apply_dynamic_cp
    from mmbalance.integrations.hf.cp import RankSlice

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = os.environ["MMB_TMP"]
    model = build_model()
    seen = watch(model)
    data = Stream()
    loader = DataLoader(RankSlice(data, rank, world), batch_size=BATCH, collate_fn=logging_collate(data))
    handle = apply_dynamic_cp(model, max_tokens_per_rank=stream_budget())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    degrees = []
    for kw in handle.batches(loader):
        opt.zero_grad()
        model(**kw).loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        degrees.append(handle.stats["degrees"])
    data.drawn = [[i, d[1]] for i, d in enumerate(data.drawn)]
    with open(os.path.join(tmp, f"{name}-rank{rank}.json"), "w") as f:
        json.dump({"drawn": data.drawn, "max_tokens": max(seen), "degrees": degrees}, f)
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(tmp, f"{name}.pt")
        )
    handle.remove()


def main() -> None:
    if os.environ.get("MMB_MODE") == "stream":
        stream("stream", cp=False)
        stream("stream-cp", cp=True)
        loop("loop")
    elif os.environ.get("MMB_MODE") == "hybrid":  # a Gated DeltaNet hybrid, with and without CP
        train("plain", cp=False)
        train("cp", cp=True)
    else:
        train("plain", cp=False)
        train("cp", cp=True, ckpt=True)
        train("resumed", cp=True, resume=os.path.join(os.environ["MMB_TMP"], "out", "checkpoint-3"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
