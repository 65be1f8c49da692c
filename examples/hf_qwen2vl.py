"""Balance the vision encoder of a Hugging Face Qwen2-VL in a few lines (tiny random model, CPU).

    torchrun --nproc-per-node 2 examples/hf_qwen2vl.py [--steps 4] [--no-balance]

Each rank samples a skewed batch: rank 0 gets several large images, every other rank one small
image, so without balancing rank 0's vision encoder does almost all the work while the others
wait. With ``apply_encoder_balance`` every rank encodes an equal share of the images; the language
model is untouched, so the losses are the same with and without ``--no-balance``. Every step prints
its time (the slowest rank's), so the two runs can be compared; where the ranks share CPU cores the
times cannot show the saving (see the note it prints).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from mmbalance.collectives import shutdown
from mmbalance.integrations.hf import apply_encoder_balance

IMAGE, VSTART, VEND, TEXT = 100, 101, 102, 5


def tiny_qwen2vl() -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(0)  # the same random weights on every rank
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=IMAGE, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )  # fmt: skip
    return Qwen2VLForConditionalGeneration(cfg)


def skewed_batch(rank: int, step: int) -> dict:
    """Rank 0: six 12x12-patch images; other ranks: one 2x2. One sequence per image."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    grids = [(12, 12)] * 6 if rank == 0 else [(2, 2)]
    rows, types, pixels = [], [], []
    for h, w in grids:
        n = h * w // 4  # 2x2 patches merge into one LLM token
        rows.append(
            [TEXT] * 3 + [VSTART] + [IMAGE] * n + [VEND] + torch.randint(3, 99, (8,), generator=g).tolist()
        )
        types.append([0] * 4 + [1] * n + [0] * 9)
        pixels.append(torch.randn(h * w, 3 * 2 * 4 * 4, generator=g))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, tt = torch.zeros_like(ids), torch.zeros(len(rows), width, dtype=torch.int)
    for i, (r, t) in enumerate(zip(rows, types)):
        ids[i, : len(r)], mask[i, : len(r)], tt[i, : len(t)] = torch.tensor(r), 1, torch.tensor(t)
    labels = ids.masked_fill((mask == 0) | (tt != 0), -100)
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=tt, labels=labels,
                pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="training steps")
    p.add_argument("--no-balance", action="store_true", help="train without encoder balancing")
    args = p.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = DistributedDataParallel(tiny_qwen2vl())
    handle = None if args.no_balance else apply_encoder_balance(model)  # <- the one line
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(args.steps):
        batch = skewed_batch(rank, step)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        times.append(1e3 * float(elapsed))
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            vision = handle.stats["vision"] if handle else None
            where = (
                f"vision max/mean {vision['before']:.3f} -> {vision['after']:.3f}, {vision['moved']:.0%} of images moved"
                if vision
                else "vision max/mean: not balanced"
            )
            print(
                f"step {step}  loss {total.item() / dist.get_world_size():.6f}  {times[-1]:6.1f} ms  {where}",
                flush=True,
            )
    if rank == 0:
        later = times[1:] or times  # the first step warms up
        print(
            f"median step time: {statistics.median(later):.1f} ms ({'not ' if handle is None else ''}balanced)"
        )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if dist.get_world_size() > (cores or 1):
            print(f"note: {dist.get_world_size()} ranks share {cores} CPU cores here, so they take turns and the "
                  "step time is the sum of their work; balancing shows in the max/mean above")  # fmt: skip
    if handle:
        handle.remove()
    # instead of dist.destroy_process_group(): DDP's reducer still holds the group, and freeing it
    # right after the last collective above can hang in torch's gloo teardown
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
