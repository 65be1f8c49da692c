"""Launched by test_hf_trainer.py on 2 CPU ranks (the environment torchrun gives its workers):
transformers' Trainer, default arguments but for a few steps, on a tiny Qwen2-VL whose ranks get
very different image loads, with and without ``apply_encoder_balance``; then the same with
gradient checkpointing. Rank 0 prints every run's logged losses and a checksum of the weights."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations import hf_zoo as Z  # noqa: E402

# one example per row: its images (sizes in patches), from tiny to large. Every example has one:
# without balancing, a rank whose batch has none leaves the tower unused, and DDP with gradient
# checkpointing (where Trainer turns off find_unused_parameters) would wait for its gradients.
# With balancing every rank runs the tower in every step, images or not.
SPECS = [[(8, 8), (8, 8)], [(2, 2)], [(2, 2)], [(6, 8)], [(8, 8)], [(2, 2)], [(4, 4), (2, 6)], [(2, 2)]] * 2


class Examples(torch.utils.data.Dataset):
    """Each example as the processor would give it: only forward arguments, one sequence."""

    def __init__(self, model):
        self.rows = []
        for k, spec in enumerate(SPECS):
            b = Z.batch("qwen2_vl", model, [spec], seed=100 + k)
            self.rows.append({key: v[0] if key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids") else v
                              for key, v in b.items()})  # fmt: skip

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows: list[dict]) -> dict:
    width = max(r["input_ids"].shape[0] for r in rows)

    def pad(key, value):
        out = torch.full((len(rows), width), value, dtype=rows[0][key].dtype)
        for i, r in enumerate(rows):
            out[i, : r[key].shape[0]] = r[key]
        return out

    batch = {
        k: pad(k, v)
        for k, v in (("input_ids", 0), ("attention_mask", 0), ("labels", -100), ("mm_token_type_ids", 0))
    }
    pix = [r["pixel_values"] for r in rows if "pixel_values" in r]
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows if "image_grid_thw" in r])
    return batch


def train(balance: bool, checkpointing: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import apply_encoder_balance

    model = Z.build("qwen2_vl", seed=1)
    args = TrainingArguments(
        output_dir=os.environ["MMB_TMP"], max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=True,
        gradient_checkpointing=checkpointing, disable_tqdm=True,
    )  # fmt: skip
    # under torchrun, TrainingArguments has set up torch.distributed by now
    handle = apply_encoder_balance(model) if balance else None
    trainer = Trainer(model=model, args=args, train_dataset=Examples(model), data_collator=collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    stats = dict(handle.stats.get("vision", {})) if handle else {}
    if handle:
        handle.remove()
    weights = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
    return {"losses": losses, "weights": weights, "stats": stats}


def main() -> None:
    out = {}
    runs = os.environ.get("MMB_RUNS", "plain-balanced,plain-stock,ckpt-balanced,ckpt-stock").split(",")
    for checkpointing in (False, True):
        for balance in (True, False):
            if f"{'ckpt' if checkpointing else 'plain'}-{'balanced' if balance else 'stock'}" not in runs:
                continue
            out[f"{'ckpt' if checkpointing else 'plain'}-{'balanced' if balance else 'stock'}"] = train(
                balance, checkpointing
            )
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(out))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
