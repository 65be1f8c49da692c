"""Long videos and image documents in Qwen2-VL with dynamic context parallelism (tiny random model, CPU).

    torchrun --nproc-per-node 4 examples/hf_qwen2vl_long.py [--steps 4] [--budget 128] [--encoder-balance] [--fsdp2]

Every step each rank draws its own examples, as a processor gives them: one rank a long video
(more tokens than two ranks may hold), another a document of page images, the others short
chats with or without an image. ``handle.shard`` gathers the lengths, groups the ranks into CP
groups of any degree for this step, computes the M-RoPE positions of every sequence whole, encodes every image and frame once
(spread over the group's members, or over the world with ``--encoder-balance``), sends the
feature rows straight to the ranks that hold their placeholder tokens and returns this rank's
model keywords. No rank's language model holds more than ``--budget`` tokens, vision tokens
included. Each step prints the groups' degrees, the largest shard and the modelled max/mean time
over the ranks as drawn and as planned (encoding included). Where the group's members encode its
media, encoding the video is most of the step, so the planner spreads it over all 4 ranks; with
``--encoder-balance`` the encoding is balanced over the world whatever the groups, and the video
takes 3 ranks while the fourth runs the rest whole. The loss of every rank is its tokens' loss over
the global count, so the gradients summed over the ranks are those of the whole step. With
``--fsdp2`` the model is sharded with ``fully_shard`` (every decoder layer, the vision tower, the
root): the shard then leaves the encoding to the model's forward, where FSDP2 gathers the tower.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

from mmbalance.balancing import CostModel
from mmbalance.collectives import shutdown
from mmbalance.integrations.hf import apply_dynamic_cp, apply_encoder_balance, register_attention

IMAGE, VIDEO, VSTART, VEND, TEXT = 100, 101, 102, 103, 5
ROW = 3 * 2 * 4 * 4  # values per patch: channels x temporal patch x 4 x 4 pixels


def tiny_qwen2vl() -> Qwen2VLForConditionalGeneration:
    torch.manual_seed(0)  # the same random weights on every rank
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )  # fmt: skip
    model = Qwen2VLForConditionalGeneration(cfg)
    model.set_attn_implementation("mmbalance_varlen")
    return model


def example(media: list, g: torch.Generator) -> dict:
    """One sequence: a prompt, its media (``(h, w)`` images, ``("video", t, h, w)`` videos, in
    patches), an answer; as one row of a processor batch."""
    ids, types, pix, grids, vpix, vgrids = [TEXT] * 3, [0] * 3, [], [], [], []
    for m in media:
        video = m[0] == "video"
        t, h, w = m[1:] if video else (1, *m)
        n = t * h * w // 4  # 2 x 2 patches merge into one LLM token
        ids += [VSTART] + [VIDEO if video else IMAGE] * n + [VEND]
        types += [0] + [2 if video else 1] * n + [0]
        (vpix if video else pix).append(torch.randn(t * h * w, ROW, generator=g))
        (vgrids if video else grids).append([t, h, w])
    answer = torch.randint(3, 99, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
    ids += answer
    types += [0] * len(answer)
    out = {"ids": ids, "types": types, "labels": [-100] * (len(ids) - len(answer)) + answer}
    out.update(pix=pix, grids=grids, vpix=vpix, vgrids=vgrids)
    return out


def draw(rank: int, step: int, world: int) -> dict:
    """This rank's batch of the step, padded as a processor pads it."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    role = (rank - step) % world
    if role == 0:  # a long video: 20 frames of 8 x 8 patches, 320 vision tokens
        media = [[("video", 20, 8, 8)]]
    elif role == 1:  # a document of three page images
        media = [[(8, 8), (8, 8), (8, 4)]]
    else:  # short chats, with or without an image
        media = [[], [(4, 4)], []]
    rows = [example(m, g) for m in media]
    width = max(len(r["ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), width, dtype=torch.long) for k in ("input_ids", "attention_mask")}
    batch["labels"] = torch.full((len(rows), width), -100, dtype=torch.long)
    batch["mm_token_type_ids"] = torch.zeros(len(rows), width, dtype=torch.int)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["ids"])
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :n] = torch.tensor(r["labels"])
        batch["mm_token_type_ids"][i, :n] = torch.tensor(r["types"])
    pix = [p for r in rows for p in r["pix"]]
    vpix = [p for r in rows for p in r["vpix"]]
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.tensor([gr for r in rows for gr in r["grids"]])
    if vpix:
        batch["pixel_values_videos"] = torch.cat(vpix)
        batch["video_grid_thw"] = torch.tensor([gr for r in rows for gr in r["vgrids"]])
    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="training steps")
    p.add_argument("--budget", type=int, default=128, help="max_tokens_per_rank (vision tokens included)")
    p.add_argument("--encoder-balance", action="store_true", help="balance the encoder over the world too")
    p.add_argument("--fsdp2", action="store_true", help="shard the model with FSDP2 (fully_shard)")
    args = p.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    register_attention()
    model = tiny_qwen2vl()
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.language_model.layers:
            fully_shard(layer)
        fully_shard(model.model.visual)
        fully_shard(model)
    encoders = apply_encoder_balance(model) if args.encoder_balance else None
    # The planner prices a token 1 and a token a ring exchanges 0.25 (the encoder's FLOPs count as
    # tokens' worth). A model this tiny is all overhead, so the default cost of its own shape
    # ("quadratic") would say little here.
    cost = CostModel(linear=1.0, ring=0.25)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=args.budget, cost=cost)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        inputs = handle.shard(draw(rank, step, world))  # <- this rank's shard of the step
        loss = model(**inputs).loss  # this rank's tokens' loss over the global count of labelled tokens
        opt.zero_grad()
        if args.fsdp2:  # FSDP2 averages the gradients over the ranks: their sum is wanted
            (loss * world).backward()
        else:
            loss.backward()
            for param in model.parameters():  # the sum over ranks is the gradient of the global mean
                if param.grad is not None:
                    dist.all_reduce(param.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            s = handle.stats
            print(
                f"step {step}  degrees {s['degrees']}  largest shard {s['largest_shard']} of {args.budget} tokens  "
                f"max/mean {s['before']:.2f} -> {s['after']:.2f}  loss {float(total):.4f}  "
                f"images and frames split over ranks {sum(s['split_items'].values())}",
                flush=True,
            )
    handle.remove()
    if encoders is not None:
        encoders.remove()
    # instead of dist.destroy_process_group(): freeing a group right after the last collective above
    # can hang in torch's gloo teardown
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
