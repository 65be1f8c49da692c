"""Launched by test_trainer_cp_vlm.py on 4 CPU ranks (the environment torchrun gives its workers):
transformers' Trainer on a tiny Qwen2-VL (``$MMB_FAMILY=qwen2_5_omni``: the Qwen2.5-Omni thinker,
a long audio clip in place of the video; ``gemma3``: Gemma 3, a document of twenty images, each a
bidirectional block; ``paligemma``: PaliGemma, a prefix of seven images, one bidirectional block) with ``balance_trainer``, first without context
parallelism, then with ``context_parallel=True`` and a budget that splits the long video (clip)
over 3 ranks. Every rank logs what its loader fetched, the largest number of tokens its embedding
saw in one forward and the rows of every vision (and audio) tower call to ``$MMB_TMP``; rank 0
saves the final weights of both runs there.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.integrations.trainer_balanced_batches import Logged  # noqa: E402 - after the path

BATCH, ACCUM, LR, BUDGET = 1, 2, 0.5, 64
# one example each: a video of 8 frames (135 tokens > 2 * BUDGET), images (also two in one
# sequence), text only; 16 examples = 2 optimizer steps of 4 ranks x 2 micro-batches
SPECS = (
    [[("video", 8, 8, 8)], [(8, 8), (8, 8)], [(4, 4)], [], [(4, 8)], [(8, 8)], [], [(4, 4), (4, 8)]]
    + [[(8, 4)], [], [(4, 4)], [(8, 8)], [], [(4, 8)], [], [(4, 4)]]
)  # fmt: skip
FAMILY = os.environ.get("MMB_FAMILY", "qwen2_vl")
if FAMILY == "qwen2_5_omni":
    # a clip of 480 mel frames: 130 tokens with its text; clips beside images elsewhere
    SPECS = (
        [[("audio", 480)], [(8, 8), ("audio", 40)], [(4, 4)], [], [("audio", 24)], [(8, 8)], [], [(4, 4), (4, 8)]]
        + [[(8, 4)], [], [("audio", 32), (4, 4)], [(8, 8)], [], [(4, 8)], [], [(4, 4)]]
    )  # fmt: skip
if FAMILY == "gemma3":
    # 4 tokens an image, each a bidirectional block: twenty images make 147 tokens
    SPECS = (
        [[1] * 20, [1, 1], [1], [], [1], [1], [], [1, 1]] + [[1], [], [1], [1, 1, 1], [], [1], [], [1]]
    )  # fmt: skip
if FAMILY == "paligemma":
    # 16 tokens an image, every prefix (images and prompt) a bidirectional block: seven images make
    # 140 tokens, a prefix of 137 over three ranks
    SPECS = (
        [[1] * 7, [1, 1], [1], [], [1], [1], [], [1, 1]] + [[1], [], [1], [1, 1], [], [1], [], [1]]
    )  # fmt: skip
N = len(SPECS)
ROW_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")
#: the rows a tower call logs for a rank's stand-in item (Gemma 3's: a zero tile, logged as 0)
STAND_IN = {"qwen2_vl": 4, "qwen2_5_omni": 4, "gemma3": 0, "paligemma": 0}
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features",
              "feature_attention_mask")  # fmt: skip


def build_model():
    from mmbalance.integrations.hf import register_attention
    from tests.integrations import hf_zoo

    register_attention()
    model = hf_zoo.build(FAMILY, seed=0)
    model.set_attn_implementation("mmbalance_varlen")
    return model


def example(i: int, model) -> dict:
    from tests.integrations import hf_zoo

    b = hf_zoo.batch(FAMILY, model, [SPECS[i]], seed=500 + i)
    out = {k: v[0] for k, v in b.items() if k in ROW_KEYS}
    for k in MEDIA_KEYS:
        if k in b:
            out[k] = b[k]
    out["idx"] = i
    return out


def media_rows(i: int, model) -> int:
    """The input rows of example ``i``'s media: patches, and the valid frames of its clips."""
    e = example(i, model)
    rows = sum(int(e[k].shape[0]) for k in ("pixel_values", "pixel_values_videos") if k in e)
    return rows + (int(e["feature_attention_mask"].sum()) if "feature_attention_mask" in e else 0)


def collate(rows: list[dict]) -> dict:
    """A processor batch: rows padded on the right, the media of every row in order."""
    from tests.integrations import hf_zoo

    one = [{k: (v[None] if k in ROW_KEYS else v) for k, v in r.items() if k != "idx"} for r in rows]
    return hf_zoo.collate(one)


def train(name: str, cp: bool):
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer
    from mmbalance.integrations.hf.compat import language_model
    from mmbalance.integrations.hf.encoders import core

    tmp = os.environ["MMB_TMP"]
    # Qwen2-VL's CP run recomputes in backward (gradient checkpointing). Not the Omni thinker's:
    # Trainer then builds DDP with find_unused_parameters=False, and the thinker's audio tower has a
    # parameter its forward never uses (audio_bos_eos_token), with or without context parallelism
    ckpt = cp and FAMILY != "qwen2_5_omni"
    args = TrainingArguments(
        output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
        num_train_epochs=1, save_strategy="no", gradient_checkpointing=ckpt,
    )  # fmt: skip
    model = build_model()
    seen: list[int] = []
    tower: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(int(i[0].numel())))
    if FAMILY in ("gemma3", "paligemma"):  # SigLIP, called with pixel_values=: a stand-in tile is all zeros

        def tiles(m, a, kw):
            pix = a[0] if a else kw["pixel_values"]
            tower.append(0 if not bool(pix.any()) else int(pix.shape[0]))

        core(model).vision_tower.register_forward_pre_hook(tiles, with_kwargs=True)
    else:
        core(model).visual.register_forward_pre_hook(lambda m, a: tower.append(int(a[0].shape[0])))
    attn: list[int] = []  # layer 0's attention calls: twice a forward under gradient checkpointing
    language_model(model).layers[0].self_attn.register_forward_hook(lambda m, i, o: attn.append(1))
    audio: list[int] = []
    if FAMILY == "qwen2_5_omni":
        core(model).audio_tower.register_forward_pre_hook(
            lambda m, a, kw: audio.append(int(kw["feature_lens"].sum())), with_kwargs=True
        )
    data = Logged([example(i, model) for i in range(N)])
    lengths = [int(r["input_ids"].shape[0]) for r in data.rows]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    kw = {"context_parallel": True, "max_tokens_per_rank": BUDGET} if cp else {}
    balance_trainer(trainer, lengths, **kw)
    trainer.train()
    rank = int(os.environ["RANK"])
    degrees = trainer.cp_sampler.stats.get("degrees") if cp else None
    with open(os.path.join(tmp, f"{name}-rank{rank}.json"), "w") as f:
        json.dump({"batches": data.log, "max_tokens": max(seen), "tower_rows": tower, "audio_rows": audio,
                   "degrees": degrees, "attention": len(attn), "forwards": len(seen),
                   "media_rows": [media_rows(i, model) for i in range(N)]}, f)  # fmt: skip
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(tmp, f"{name}.pt")
        )


def main() -> None:
    train("plain", cp=False)
    train("cp", cp=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
