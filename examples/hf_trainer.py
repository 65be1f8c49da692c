"""Balanced batches in transformers' Trainer with one call (tiny random Llama, CPU).

    torchrun --nproc-per-node 2 examples/hf_trainer.py [--epochs 1] [--accum 2] [--no-balance]

A dataset of skewed lengths (most examples short, a few long) trains with gradient accumulation;
the collator pads every micro-batch to its longest example. With ``balance_trainer`` every rank's
k-th micro-batch costs about the same, so no rank waits long at each micro-batch; with
``--no-balance`` Trainer's own random sampler deals out examples regardless of length. At the end,
rank 0 prints what the ranks did: per optimizer step, the padded tokens of the slowest rank's
micro-batch summed over the micro-batches (ranks synchronize at each), the examples trained, and
the last loss.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from mmbalance.collectives import shutdown
from mmbalance.integrations.hf import balance_trainer

VOCAB = 128


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same random weights on every rank
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM(cfg)


class Skewed(torch.utils.data.Dataset):
    """``n`` token sequences: 90% of 8-40 tokens, 10% of 200-400."""

    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(0)
        long = torch.rand(n, generator=g) < 0.1
        lengths = torch.where(
            long, torch.randint(200, 401, (n,), generator=g), torch.randint(8, 41, (n,), generator=g)
        )
        self.rows = [torch.randint(3, VOCAB, (int(l),), generator=g) for l in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids = self.rows[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class PadCollator:
    """Pads each micro-batch to its longest example and records its padded size (examples x longest)."""

    def __init__(self):
        self.padded: list[int] = []
        self.examples = 0

    def __call__(self, rows: list[dict]) -> dict:
        width = max(r["input_ids"].shape[0] for r in rows)
        out = {}
        for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
            t = torch.full((len(rows), width), fill, dtype=torch.long)
            for j, r in enumerate(rows):
                t[j, : r[key].shape[0]] = r[key]
            out[key] = t
        self.padded.append(len(rows) * width)
        self.examples += len(rows)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    p.add_argument("--no-balance", action="store_true", help="Trainer's own sampler, for comparison")
    args = p.parse_args()
    collate = PadCollator()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accum, learning_rate=1e-3, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = Trainer(model=tiny_llama(), args=targs, train_dataset=Skewed(), data_collator=collate)
        if not args.no_balance:
            balance_trainer(trainer)  # lengths from len(input_ids); padded costs (the collator pads)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # every rank's micro-batch sizes, to model the steps: ranks wait for the slowest at each one
    mine = torch.tensor(collate.padded, dtype=torch.float64)
    world = dist.get_world_size() if dist.is_initialized() else 1
    sizes = [torch.zeros_like(mine) for _ in range(world)]
    examples = torch.tensor([collate.examples])
    if dist.is_initialized():
        dist.all_gather(sizes, mine)
        dist.all_reduce(examples)
    else:
        sizes = [mine]
    if int(os.environ.get("RANK", "0")) == 0:
        slowest = torch.stack(sizes).max(dim=0).values
        steps = slowest.numel() // args.accum
        per_step = slowest[: steps * args.accum].reshape(steps, args.accum).sum(dim=1)
        mode = "not balanced (--no-balance)" if args.no_balance else "balanced (balance_trainer)"
        print(f"{mode}: {world} ranks, {steps} optimizer steps of {args.accum} micro-batches")
        print(f"padded tokens per step (slowest rank per micro-batch, summed): {per_step.mean().item():.1f}")
        print(f"examples trained: {int(examples.item())} of {len(Skewed())} x {args.epochs} epoch(s)")
        print(f"last loss: {losses[-1]:.4f}")
    # instead of dist.destroy_process_group(): the trainer's DDP model still holds the group, and
    # freeing it right after the last collective above can hang in torch's gloo teardown
    shutdown()


if __name__ == "__main__":
    main()
