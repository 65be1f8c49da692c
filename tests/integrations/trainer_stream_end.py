"""Launched by test_trainer_cp.py on 2 or 4 CPU ranks (the environment torchrun gives its workers):
transformers' Trainer on streams of every shape, through ``balance_trainer``, each of which must
end. Per case: a stream of ``n`` examples (a ``datasets.IterableDataset`` of ``shards`` shards),
``per_device_train_batch_size``, ``gradient_accumulation_steps`` and ``max_steps`` below or above
what one pass gives, with and without context parallelism. Every example starts with a marker token
of its own; every rank logs the markers its loader drew and those its model's embedding saw, and
the optimizer steps taken, to ``$MMB_TMP/stream-end-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations import trainer_cp  # noqa: E402 - after the path

VOCAB, MARK = 160, 100  # example i starts with the token MARK + i; the rest lie in [3, MARK)
# (n, shards, batch, accumulation, max_steps, context parallel, loader workers)
CASES = [
    (5, 1, 4, 2, 3, False, 0),  # a stream shorter than one step, max_steps above it
    (5, 1, 4, 2, 3, True, 0),
    (1, 1, 1, 1, 2, False, 0),
    (1, 1, 2, 4, 3, True, 0),
    (2, 2, 1, 3, 1, False, 0),
    (3, 3, 2, 2, 5, True, 0),
    (7, 2, 1, 4, 2, False, 0),
    (7, 3, 2, 3, 6, True, 0),
    (11, 1, 1, 2, 2, True, 0),
    (11, 2, 2, 1, 9, False, 0),
    (20, 3, 2, 4, 1, True, 0),
    (20, 2, 1, 2, 12, False, 0),
    (20, 1, 2, 3, 4, True, 0),
    (13, 3, 1, 2, 5, False, 2),  # two loader workers, each reading its shards
    (13, 2, 2, 2, 3, True, 2),  # and with context parallelism (the steps formed from raw examples)
    (0, 1, 2, 2, 3, False, 0),  # an empty stream: Trainer stops at once
]
BUDGET = 48  # example 3 (70 tokens) is split over two ranks


def length(i: int) -> int:
    return 70 if i == 3 else 4 + (i * 7) % 29  # 4 .. 32 tokens, and one of 70


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(500 + i)
        ids = torch.randint(3, MARK, (length(i),), generator=g)
        ids[0] = MARK + i
        out.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return out


def stream(n: int, shards: int):
    import datasets

    data = rows(n)
    parts = [list(range(s, n, shards)) for s in range(shards)]

    def gen(part):
        for group in part:
            for i in group:
                yield data[i]

    return datasets.IterableDataset.from_generator(gen, gen_kwargs={"part": parts})


def collate_with(drawn: list):
    from transformers import DataCollatorWithFlattening

    flat = DataCollatorWithFlattening(return_tensors="pt")

    def collate(batch_rows):
        drawn.extend(int(r["input_ids"][0]) - MARK for r in batch_rows)
        return flat(batch_rows)

    return collate


def run_case(case, tmp: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer

    n, shards, batch, accum, max_steps, cp, workers = case
    model = trainer_cp.build_model(vocab=VOCAB, layers=1)
    seen: list[int] = []

    def embed_hook(module, inputs, output):
        ids = inputs[0].reshape(-1)
        seen.extend(int(x) - MARK for x in ids[ids >= MARK])

    model.get_input_embeddings().register_forward_hook(embed_hook)
    drawn: list[int] = []
    args = TrainingArguments(
        output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        max_steps=max_steps, learning_rate=0.1, optim="sgd", report_to=[], use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, save_strategy="no", logging_steps=1, dataloader_num_workers=workers,
    )  # fmt: skip
    data = stream(n, shards)
    if workers:  # the collator runs in the workers: log the draws through what the model saw instead
        collate = collate_with([])
    else:
        collate = collate_with(drawn)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    kw = {"context_parallel": True, "max_tokens_per_rank": BUDGET} if cp else {}
    balance_trainer(trainer, **kw)
    t0 = time.perf_counter()
    trainer.train()
    return {
        "case": list(case),
        "global_step": trainer.state.global_step,
        "drawn": drawn if not workers else None,
        "seen": seen,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    tmp = os.environ["MMB_TMP"]
    rank = int(os.environ["RANK"])
    # on 4 ranks (2 cores here) every other shape: each range is still covered there
    cases = CASES if int(os.environ["WORLD_SIZE"]) <= 2 else CASES[::2]
    out = [run_case(case, tmp) for case in cases]
    with open(os.path.join(tmp, f"stream-end-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
