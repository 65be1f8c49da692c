"""A plain training step of a tiny vision-language model with dynamic context parallelism on every
rank (run by test_dynamic_cp_vlm.py through tests.dist_utils.launch, as torchrun would start it).

Every rank draws its own examples, as a processor gives them (padded rows, ``pixel_values`` with
``image_grid_thw``, ``pixel_values_videos`` with ``video_grid_thw``, ``mm_token_type_ids``):

* rank 0: one 8-frame video whose tokens exceed twice the budget, and a short text;
* rank 1: two images in one sequence (their tokens straddle shard boundaries);
* ranks 2, 3: short text-only and one-image examples.

The schedule is one group of 3 ranks and one of 1 (see ``SPECS``).

``handle.shard`` post-balances them into CP groups; the loss and every parameter gradient, summed
over ranks, must equal a one-process reference (each example alone through the stock eager model,
token-loss sum over the global count); every image and frame is encoded exactly once in the world
(the rows of the vision tower's calls); no rank's language model embeds more than the budget.

argv: one or more ``family:balance`` runs: family qwen2_vl | qwen2_5_vl | qwen3_vl | glm4v | glm4v_moe | glm46v |
kimi_k25 | mistral3 | gemma3 | paligemma | gemma4 | qwen3_omni_moe | minicpmv4_6 | minicpmv4_7 | minicpm_ocr
| ernie4_5_vl_moe | llava_onevision (these fourteen on 2 ranks: ``PAIR``; Gemma 3's and
Gemma 4's images and PaliGemma's prefixes are bidirectional blocks cut by the shard boundaries) | llava (LLaVA
has no video: a document of eight images stands in for it) | qwen2_5_omni (the thinker: a long
audio clip stands in for the video, an image and a clip share a sequence), balance plain | encoder
(``apply_encoder_balance`` on the same model) | fsdp2 (the model under FSDP2: every decoder layer,
the towers as units of their own but LLaVA's, whose CLIP tower stays in the root, then the root;
``shard`` leaves the encoders to the forward) | encoder_fsdp2 (both) | fsdp2_bf16 (FSDP2's mixed
precision: bfloat16 compute, float32 reduction; tolerances of bfloat16) | fsdp2_ckpt (and
transformers' gradient checkpointing) | fault (one rank's batch is bad: refused on every
rank) | stream (``handle.batches`` over each rank's own loader of a different length, as a stream's
slices give them: a rank whose loader has ended takes part with empty batches; loss and gradients,
summed over the steps and ranks, against each step's examples alone over that step's count; every
drawn sequence counted once) | stream_fsdp2 (the stream under FSDP2, as fsdp2 wraps it: steps where
a rank has nothing to encode, or no sequence at all). Rank 0 prints one JSON line per run.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FAMILY = BALANCE = ""


def hf_zoo_kimi_videos_run() -> bool:
    from tests.integrations import hf_zoo

    return hf_zoo.kimi_videos_run()


def hf_zoo_onevision_videos_shard() -> bool:
    from tests.integrations import hf_zoo

    return hf_zoo.onevision_videos_shard()


def hf_zoo_gemma4_videos_run() -> bool:
    from tests.integrations import hf_zoo

    return hf_zoo.available("gemma4") and hf_zoo.gemma4_videos_run()


BUDGET = 64
# per rank, its examples: hf_zoo specs (image sizes in patches, ("video", t, h, w)) or ("text", n).
# The sizes force the schedule: the video (138 tokens) needs 3 ranks; the one-image examples of 34
# and 26 tokens cannot both join it, so they fill the fourth rank, and the two-image example (45
# tokens) has to join the video's group of 3, whose zigzag shards cut through its images.
QWEN = [
    [[("video", 8, 8, 8)], ("text", 3)],
    [[(8, 8), (8, 8)]],
    [[(8, 12)], ("text", 2)],
    [[(8, 8)], ("text", 2)],
]
SPECS = {
    "qwen2_vl": QWEN,
    "qwen2_5_vl": QWEN,
    # Qwen3-VL puts a timestamp and its own start/end tokens around every temporal patch: 7 of
    # them make 140 tokens, over twice the budget as well
    "qwen3_vl": [[[("video", 7, 8, 8)], ("text", 3)], *QWEN[1:]],
    # Qwen3.5: Qwen3-VL's video tokens, a Gated DeltaNet layer beside a full-attention one
    "qwen3_5": [[[("video", 7, 8, 8)], ("text", 3)], *QWEN[1:]],
    # LLaVA: 16 tokens an image; eight in one sequence make 143 tokens
    "llava": [[[1] * 8, ("text", 3)], [[1, 1]], [[1], ("text", 2)], [[1], ("text", 2)]],
    # the Qwen2.5-Omni thinker: a clip of 480 mel frames is 120 audio tokens (130 with its text),
    # over twice the budget; an image and a clip share the 39-token sequence of rank 1
    "qwen2_5_omni": [
        [[("audio", 480)], ("text", 3)],
        [[(8, 8), ("audio", 40)]],
        [[(8, 12)], ("text", 2)],
        [[(8, 8)], ("text", 2)],
    ],
}
# the families since Qwen3-VL, on 2 ranks: rank 0's four media of 16 tokens each make an 83-token
# sequence (over the budget: split over both ranks, media cut at the boundary), rank 1's short
# examples join that group of 2
PAIR = {
    # GLM-4.1V: a 4-frame video (its placeholders image tokens, 16 a frame) split over both ranks,
    # beside rank 1's image: one stream of image tokens carries frames and images in their order
    "glm4v": [[[("video", 4, 8, 8)]], [[(4, 4)], ("text", 3)]],
    "glm4v_moe": [[[(8, 8), (8, 8), (8, 8), (8, 8)]], [[("video", 2, 4, 4)], ("text", 3)]],
    "glm46v": [[[(8, 8), (8, 8), (8, 8), (8, 8)]], [[(4, 4)], ("text", 3)]],
    "kimi_k25": [[[(8, 8), (8, 8), ("video", 3, 8, 8), (8, 8)]], [[(4, 4)], ("text", 3)]],
    "mistral3": [[[(32, 32), (32, 32), (32, 32), (32, 32)]], [[(16, 16)], ("text", 3)]],
    # Gemma 3: 4 tokens an image, each image a bidirectional block; eleven make 84 tokens, and the
    # zigzag boundaries at 21 and 63 cut the third and the ninth image
    "gemma3": [[[1] * 11], [[1], ("text", 3)]],
    # PaliGemma: 16 tokens an image, the prefix (images and prompt) one bidirectional block: four
    # images make an 83-token sequence whose 80-token prefix spans both ranks
    "paligemma": [[[1] * 4], [[1], ("text", 3)]],
    # Gemma 4: images and frames at their own sizes (patches pooled 2 x 2), each a bidirectional
    # block in its sliding layers: a 93-token sequence over both ranks, whose zigzag boundaries cut
    # the video's second frame and the second image
    "gemma4": [[[(8, 8), ("video", 2, 8, 8), (8, 8), (4, 8)]], [[(4, 4)], ("text", 3)]],
    # LLaVA-OneVision: anyres images (a 16 x 32 image is its base tile and 2 grid tiles, 52 rows with
    # its newlines) and, where its forward takes them so, a 4-frame video's 17 rows (pooled frames and
    # the newline) cut by the boundary
    "llava_onevision": [[[(16, 32), ("video", 4)]], [[(16, 16)], ("text", 3)]],
    # the Qwen3-Omni thinker: Qwen3-VL's tower with its deepstack rows, a video's frames as items
    "qwen3_omni_moe": [[[("video", 2, 8, 8), (8, 8), (8, 8), (8, 8)]], [[(4, 4)], ("text", 3)]],
    # MiniCPM-V 4.6: a small image, an image of a thumbnail and two slices, a video's two frames and
    # an image (slices at their own sizes, a placeholder per 4 x 4 patches) make a 91-token sequence
    # over both ranks, its Gated DeltaNet layer's state handed across the cuts
    "minicpmv4_6": [
        [[(8, 8), [(16, 16), (8, 16), (8, 16)], ("video", 2, 8, 16), (16, 12)]],
        [[(4, 4)], ("text", 3)],
    ],
}
# MiniCPM-V 4.7 (its M-RoPE canvas from the whole sequence) and MiniCPM-OCR (four times the tokens a
# slice: a 2 x 2 merge only) take the same media
# Ernie-4.5-VL: images and a 4-frame video (its frames merged two by two) make an 80-token sequence,
# its vision tokens routed to their own experts on every shard
PAIR["ernie4_5_vl_moe"] = [[[(8, 8), ("video", 4, 8, 8), (8, 8)]], [[(4, 4)], ("text", 3)]]
PAIR["minicpmv4_7"] = PAIR["minicpmv4_6"]
PAIR["minicpm_ocr"] = [
    [[(8, 4), [(8, 8), (4, 8), (4, 8)], ("video", 2, 4, 8), (4, 8)]],
    [[(4, 4)], ("text", 3)],
]
if (
    not hf_zoo_onevision_videos_shard()
):  # before mm_encoder_outputs its videos are refused (test_dynamic_cp_vlm.py)
    PAIR["llava_onevision"] = [[[(16, 32), (8, 8)]], [("text", 3)]]
if not hf_zoo_kimi_videos_run():  # transformers' own video path of Kimi-K2.5 fails before 5.24
    PAIR["kimi_k25"] = [[[(8, 8), (8, 8), (8, 8), (8, 8)]], [[(4, 4)], ("text", 3)]]
if not hf_zoo_gemma4_videos_run():  # and Gemma 4's in 5.19.0
    PAIR["gemma4"] = [[[(8, 8), (8, 4), (8, 8), (8, 8), (4, 8)]], [[(4, 4)], ("text", 3)]]
SPECS.update(PAIR)
# the families whose processors give no mm_token_type_ids
UNTYPED = ("llava", "qwen2_5_omni", "qwen3_omni_moe", "kimi_k25", "mistral3", "minicpmv4_6", "minicpm_ocr",
           "llava_onevision")  # fmt: skip
# the degrees of the step's CP groups
DEGREES = {name: [2] for name in PAIR}


def towers(model) -> list:
    """``(tower, its input rows of one call, the rows of one stand-in item)`` of every encoder
    (a rank with nothing to encode runs a stand-in item)."""
    from mmbalance.integrations.hf.encoders import core

    if FAMILY in ("llava", "llava_onevision"):  # tiles (OneVision: every tile of an image, every frame)
        return [
            (core(model).vision_tower, lambda a, kw: int((a[0] if a else kw["pixel_values"]).shape[0]), 1)
        ]
    if FAMILY == "mistral3":  # Pixtral's rows: the images' own patches
        p = int(core(model).vision_tower.config.patch_size)
        return [(core(model).vision_tower, lambda a, kw: int((kw["image_sizes"] // p).prod(-1).sum()), 8)]
    if FAMILY == "gemma4":  # only an image's own patches travel: the rows of real patches
        tower = core(model).vision_tower

        def patches(a, kw):
            pos = kw.get("pixel_position_ids", a[1] if len(a) > 1 else None)
            return int((~(pos == -1).all(dim=-1)).sum())

        return [(tower, patches, 4)]
    if FAMILY == "ernie4_5_vl_moe":  # its tower is the model's vision_tower, called with the patch rows
        rows = lambda a, kw: int((a[0] if a else kw["hidden_states"]).shape[0])  # noqa: E731
        return [(core(model).vision_tower, rows, 4)]
    if FAMILY.startswith("minicpm"):  # a call's rows: its slices' patches
        rows = lambda a, kw: int(kw["target_sizes"].prod(-1).sum())  # noqa: E731
        return [(core(model).vision_tower, rows, 16)]
    if FAMILY in ("kimi_k25", "gemma3", "paligemma"):
        stand_in = 4 if FAMILY == "kimi_k25" else 1
        rows = lambda a, kw: int((a[0] if a else kw["pixel_values"]).shape[0])  # noqa: E731
        return [(core(model).vision_tower, rows, stand_in)]
    visual = core(model).visual
    out = [(visual, lambda a, kw: int((a[0] if a else next(iter(kw.values()))).shape[0]),
            int(visual.spatial_merge_size) ** 2)]  # fmt: skip
    if FAMILY == "qwen2_5_omni":  # the audio tower's rows: the clips' valid frames
        out.append((core(model).audio_tower, lambda a, kw: int(kw["feature_lens"].sum()), 3))
    return out


def tiny(attn: str):
    from tests.integrations import hf_zoo

    model = hf_zoo.build(FAMILY, seed=0)
    model.set_attn_implementation(attn)
    return model


def examples(model) -> list[list[dict]]:
    """Per rank, its examples: each a one-row processor batch."""
    from tests.integrations import hf_zoo

    out, k = [], 0
    for rank_specs in SPECS[FAMILY]:
        mine = []
        for spec in rank_specs:
            if spec and spec[0] == "text":
                g = torch.Generator().manual_seed(100 + k)
                ids = torch.randint(1, 90, (1, spec[1]), generator=g)
                text = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
                if FAMILY == "gemma3":
                    text["token_type_ids"] = torch.zeros_like(ids)
                elif FAMILY == "paligemma":  # a prompt, then a one-token answer
                    text["token_type_ids"] = torch.zeros_like(ids)
                    text["token_type_ids"][:, -1] = 1
                elif FAMILY not in UNTYPED:
                    text["mm_token_type_ids"] = torch.zeros_like(ids, dtype=torch.int32)
                if FAMILY == "ernie4_5_vl_moe":  # no vision token, no vision expert
                    text["moe_mm_token_type_ids"] = torch.zeros_like(ids)
                mine.append(text)
            else:
                mine.append(hf_zoo.batch(FAMILY, model, [spec], seed=100 + k))
            k += 1
        out.append(mine)
    return out


def summed_grads(model) -> dict:
    """Every parameter's gradient summed over the ranks (zeros where a rank has none)."""
    if "fsdp2" in BALANCE:  # each rank holds a shard of the ranks' mean
        world = dist.get_world_size()
        return {
            n: p.grad.full_tensor() * world if p.grad is not None else torch.zeros_like(p.full_tensor())
            for n, p in model.named_parameters()
        }
    grads = {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    for g in grads.values():
        dist.all_reduce(g)
    return grads


def worst_grad(grads: dict, ref) -> tuple[float, str]:
    """The largest relative error of ``grads`` against the reference model's gradients, and where.
    Tensors whose gradient is zero up to rounding (key biases: softmax ignores them) are compared
    against a floor of 1e-5 of the largest gradient norm."""
    norms = {n: float(p.grad.norm()) for n, p in ref.named_parameters() if p.grad is not None}
    floor = 1e-5 * max(norms.values())
    worst, where = 0.0, ""
    for n, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        diff = float((grads[n] - want).norm()) / max(float(want.norm()), floor)
        if diff > worst:
            worst, where = diff, n
    return worst, where


def fsdp2(model, bf16: bool = False) -> None:
    """``fully_shard`` on every decoder layer and tower (LLaVA's CLIP tower stays in the root:
    transformers' hidden-state capture does not see an FSDP2-wrapped CLIP model), then the root;
    with ``bf16``, FSDP2's mixed precision (bfloat16 compute, float32 gradient reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mmbalance.integrations.hf.compat import language_model

    kw = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if bf16
        else {}
    )
    for layer in language_model(model).layers:
        fully_shard(layer, **kw)
    if FAMILY != "llava":
        for tower, _, _ in towers(model):
            fully_shard(tower, **kw)
    fully_shard(model, **kw)


def run_one() -> None:
    from mmbalance.integrations.hf import apply_dynamic_cp, apply_encoder_balance
    from tests.integrations import hf_zoo

    rank = dist.get_rank()
    model = tiny("mmbalance_varlen")
    from mmbalance.integrations.hf.compat import language_model

    attn_calls = []
    lm = language_model(model)
    next(layer for layer in lm.layers if hasattr(layer, "self_attn")).self_attn.register_forward_hook(
        lambda m, i, o: attn_calls.append(1)
    )
    if BALANCE.endswith("ckpt"):  # transformers' gradient checkpointing: towers and decoder layers
        model.gradient_checkpointing_enable()
        model.train()
    if "fsdp2" in BALANCE:
        fsdp2(model, bf16=BALANCE.endswith("bf16"))
    enc_handle = apply_encoder_balance(model) if BALANCE.startswith("encoder") else None
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET)
    data = examples(model)
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: embedded.append(int(i[0].numel())))
    calls: list[list[int]] = [[] for _ in towers(model)]
    for k, (module, rows_of, _) in enumerate(towers(model)):
        module.register_forward_pre_hook(
            lambda m, a, kw, k=k, rows_of=rows_of: calls[k].append(rows_of(a, kw)), with_kwargs=True
        )
    inputs = handle.shard(hf_zoo.collate(data[rank], left=rank % 2 == 1))
    loss = model(**inputs).loss
    loss.backward()
    stats = handle.stats
    want = 2 if BALANCE.endswith("ckpt") else 1  # the forward, and the recompute in backward
    assert len(attn_calls) == want, (
        f"rank {rank}: layer 0's attention ran {len(attn_calls)} times, not {want}"
    )
    assert max(embedded) <= BUDGET, f"rank {rank} embedded {max(embedded)} tokens, budget {BUDGET}"
    assert stats["largest_shard"] <= BUDGET, stats
    assert sorted(stats["degrees"]) == DEGREES.get(FAMILY, [1, 3]), stats
    assert stats["split_items"]["image"] >= 1, stats
    if FAMILY == "qwen2_5_omni":  # the long clip's rows reach three ranks
        assert stats["split_items"]["audio"] >= 1, stats
    elif FAMILY not in ("llava", *PAIR):  # LLaVA has no video stream
        assert stats["split_items"]["video"] >= 1, stats
    # every image, frame and clip encoded once in the world: one call per tower and rank, real rows
    # or a stand-in
    assert [len(c) for c in calls] == [1] * len(calls), f"rank {rank}: tower calls {calls}"
    real = sum(c[0] for c, (_, _, stand_in) in zip(calls, towers(model)) if c[0] != stand_in)
    if stats["encoded_rows"]:
        assert real == stats["encoded_rows"], (calls, stats["encoded_rows"])
    else:
        assert real == 0, f"rank {rank}: towers ran {calls} rows with nothing to encode"
    total = loss.detach().clone()
    dist.all_reduce(total)
    encoded = torch.tensor([stats["encoded_rows"]], dtype=torch.int64)
    dist.all_reduce(encoded)
    grads = summed_grads(model)
    if rank == 0:
        flat = [b for mine in data for b in mine]
        rows = sum(
            int(b[k].shape[0]) for b in flat for k in ("pixel_values", "pixel_values_videos") if k in b
        ) if FAMILY != "mistral3" else sum(int((b["image_sizes"] // hf_zoo.P).prod(-1).sum()) for b in flat
                                            if "image_sizes" in b)  # fmt: skip
        if FAMILY == "llava_onevision":  # every image's real tiles, every frame
            rows = sum(hf_zoo.onevision_rows(model, b) for b in flat)
        if FAMILY.startswith("minicpm"):  # every slice's patches
            rows = sum(int(b[k].prod(-1).sum()) for b in flat for k in ("target_sizes", "target_sizes_videos")
                       if k in b)  # fmt: skip
        if FAMILY == "gemma4":  # an image's own patches
            rows = sum(int((~(b[k] == -1).all(dim=-1)).sum()) for b in flat
                       for k in ("image_position_ids", "video_position_ids") if k in b)  # fmt: skip
        rows += sum(int(b["feature_attention_mask"].sum()) for b in flat if "feature_attention_mask" in b)
        assert int(encoded) == rows, f"{int(encoded)} rows encoded in the world, the media have {rows}"
        ref = tiny("eager")
        count = sum(int((b["labels"][0, 1:] != -100).sum()) for b in flat)
        assert inputs["num_items_in_batch"] == count, (inputs["num_items_in_batch"], count)
        ref_total = torch.zeros(())
        for b in flat:
            loss = hf_zoo.summed_loss(ref, b, count)
            loss.backward()
            ref_total += loss.detach()
        rel = abs(float(total) - float(ref_total)) / abs(float(ref_total))
        # bfloat16 compute against the float32 reference: its rounding (2^-8 per operation; the
        # worst tensors are the towers' small layer-norm biases, a few percent off); a feature
        # row lost or misplaced is off by its whole size
        tol_loss, tol_grad = (1e-3, 0.15) if BALANCE.endswith("bf16") else (1e-5, 1e-5)
        assert rel <= tol_loss, f"loss {float(total)} vs reference {float(ref_total)} (rel {rel:.2e})"
        worst, where = worst_grad(grads, ref)
        assert worst <= tol_grad, f"gradient of {where}: relative error {worst:.2e}"
        print(json.dumps({"run": f"{FAMILY}:{BALANCE}", "degrees": stats["degrees"], "largest_shard": stats["largest_shard"],
                          "loss_rel": rel, "grad_rel": worst, "split_items": stats["split_items"],
                          "before": stats["before"], "after": stats["after"], "encoded_rows": int(encoded)}))  # fmt: skip
    handle.remove()
    if enc_handle is not None:
        enc_handle.remove()
    dist.barrier()


def run_fault() -> None:
    """One rank's batch is bad (its image grid does not match its placeholders): every rank raises
    before anything moves, naming the rank and the batch key, and the next step works."""
    from mmbalance.collectives import RankMismatchError
    from mmbalance.integrations.hf import apply_dynamic_cp
    from tests.integrations import hf_zoo

    rank = dist.get_rank()
    model = tiny("mmbalance_varlen")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET)
    data = examples(model)
    batch = hf_zoo.collate(data[rank])
    bad = dict(batch)
    if rank == 2:
        bad["image_grid_thw"] = batch["image_grid_thw"].clone()
        bad["image_grid_thw"][0, 2] = 4  # 8 x 12 patches -> 8 x 4: fewer rows than pixel_values has
    try:
        handle.shard(bad)
    except (ValueError, RankMismatchError) as exc:
        text = str(exc)
        assert "rank 2" in text and "image_grid_thw" in text, text
        assert isinstance(exc, ValueError) if rank == 2 else isinstance(exc, RankMismatchError), type(exc)
    else:
        raise AssertionError(f"rank {rank}: a bad batch on rank 2 was not refused")
    inputs = handle.shard(batch)  # the group is still usable
    model(**inputs).loss.backward()
    if rank == 0:
        print(json.dumps({"run": f"{FAMILY}:fault", "refused": True}))
    handle.remove()
    dist.barrier()


# stream: per rank, its loader's batches, each a list of examples (hf_zoo specs); step 0 holds the
# video over twice the budget, ranks 1 and 3 run out of data early
STREAM = [
    [[[("video", 8, 8, 8)]], [[(4, 4)], []], [[(8, 8)]]],
    [[[(8, 8), (8, 8)]]],
    [[[(8, 12)], []], [[(4, 8)]], [[]]],
    [],
]


def run_stream() -> None:
    from mmbalance.integrations.hf import apply_dynamic_cp
    from tests.integrations import hf_zoo

    rank = dist.get_rank()
    model = tiny("mmbalance_varlen")
    if BALANCE == "stream_fsdp2":
        fsdp2(model)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=BUDGET)
    mine = [
        [hf_zoo.batch(FAMILY, model, [spec], seed=1000 + 100 * rank + 10 * j + i) for i, spec in enumerate(b)]
        for j, b in enumerate(STREAM[rank])
    ]
    total, degrees = torch.zeros(()), []
    for kw in handle.batches([hf_zoo.collate(b, left=rank % 2 == 1) for b in mine]):
        loss = model(**kw).loss
        loss.backward()
        total += loss.detach()
        degrees.append(max(handle.stats["degrees"]))
        assert handle.stats["largest_shard"] <= BUDGET, handle.stats
    drawn = handle.stats["drawn"]
    assert drawn == sum(len(b) for b in STREAM[rank]), (rank, drawn)
    dist.all_reduce(total)
    grads = summed_grads(model)
    if rank == 0:
        ref = tiny("eager")
        ref_total = torch.zeros(())
        for step in range(max(map(len, STREAM))):
            flat = [
                hf_zoo.batch(FAMILY, ref, [spec], seed=1000 + 100 * r + 10 * step + i)
                for r in range(len(STREAM))
                if step < len(STREAM[r])
                for i, spec in enumerate(STREAM[r][step])
            ]
            count = sum(int((b["labels"][0, 1:] != -100).sum()) for b in flat)
            for b in flat:
                loss = hf_zoo.summed_loss(ref, b, count)
                loss.backward()
                ref_total += loss.detach()
        rel = abs(float(total) - float(ref_total)) / abs(float(ref_total))
        worst, _ = worst_grad(grads, ref)
        print(json.dumps({"run": f"{FAMILY}:{BALANCE}", "steps": len(degrees), "degrees": degrees, "loss_rel": rel,
                          "grad_rel": worst}))  # fmt: skip
    handle.remove()
    dist.barrier()


def main() -> None:
    global FAMILY, BALANCE
    from mmbalance.integrations.hf import register_attention

    dist.init_process_group("gloo")
    register_attention()
    for spec in sys.argv[1:]:
        FAMILY, BALANCE = spec.split(":")
        {"fault": run_fault, "stream": run_stream, "stream_fsdp2": run_stream}.get(BALANCE, run_one)()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
