"""One process, ``handle.shard`` on a padded batch of several examples of each vision-language
family (real transformers classes, tiny configs): the shard's loss and every gradient equal each
example alone through the stock eager model (1e-5), its M-RoPE positions are the model's own on the
whole sequence, and every item is encoded once; the Omni thinkers' audio and vision rows; a stand-in
image under the mask is left out. The multi-rank steps and the refusals are in
``test_dynamic_cp_vlm.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import apply_dynamic_cp  # noqa: E402
from mmbalance.integrations.hf.encoders import core  # noqa: E402
from tests.integrations import hf_zoo  # noqa: E402

SPECS = {
    "qwen2_vl": [[(4, 4)], [], [("video", 2, 4, 4), (4, 8)]],
    "qwen2_5_vl": [[("video", 2, 4, 8)], [(4, 4), (4, 4)], []],
    "qwen3_vl": [[(4, 4)], [("video", 3, 4, 4), (8, 4)], []],
    "qwen3_vl_moe": [[("video", 2, 4, 4)], [(4, 4)]],
    "llava": [[1], [], [1, 1]],
    "qwen3_5": [[(4, 4)], [("video", 3, 4, 4), (8, 4)], []],
    # a video's placeholders are image tokens: videos and images in sequences of their own (as the
    # models take them), in one batch
    "glm4v": [[(4, 4)], [("video", 2, 4, 4)], [(8, 4), (2, 6)], []],
    "glm4v_moe": [[(4, 4), (6, 2)], [], [("video", 3, 4, 4)], [(8, 4)]],
    "glm46v": [[("video", 2, 4, 8)], [(4, 4), (6, 2)], []],
    "kimi_k25": [[(4, 4)], [("video", 3, 4, 4), (8, 4)] if hf_zoo.kimi_videos_run() else [(8, 4)], []],
    "mistral3": [[(16, 32)], [], [(8, 8), (24, 16)]],
    "gemma3": [[1, 1], [], [1]],  # each image a bidirectional block of its sequence
    "paligemma": [[1, 1], [], [1]],  # each sequence's prefix (images, prompt) a bidirectional block
    # images and frames at their own sizes, each a bidirectional block in the sliding layers
    "gemma4": [[(4, 4), (2, 6)], [], [("video", 2, 4, 4) if hf_zoo.gemma4_videos_run() else (6, 4), (4, 2)]],
    # slices at their own sizes (an image's thumbnail and a slice, a video's frames), Gated DeltaNet layers
    "minicpmv4_6": [[(4, 4), [(8, 8), (4, 8)]], [], [("video", 2, 4, 8), (8, 4)]],
    # and 4.7's M-RoPE canvas (a thumbnail and its crops laid out on one), OCR's 2 x 2 merges
    "minicpmv4_7": [[(4, 4), [(8, 8), (4, 8), (4, 8)]], [], [("video", 2, 4, 8), (8, 4)]],
    "minicpm_ocr": [[(4, 4), [(8, 8), (4, 8)]], [], [("video", 2, 4, 8), (8, 4)]],
    # anyres images at their own sizes (each packed with its tiles where it is encoded), a video's frames
    # where its forward takes the video's newline row with the rows (5.19 on; before, refused: below)
    "llava_onevision": [
        [(20, 40), ("video", 2)] if hf_zoo.onevision_videos_shard() else [(20, 40)],
        [],
        [(16, 16), (30, 30)],
    ],  # fmt: skip
    # a video's frames merged two by two, vision tokens with experts of their own
    "ernie4_5_vl_moe": [[(4, 4)], [("video", 4, 4, 4), (8, 4)], []],
}
# the families whose positions are M-RoPE rows from get_rope_index (and MiniCPM-V 4.7)
MROPE = ("qwen", "glm", "ernie")


def _grads(model) -> dict:
    return {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
    }


def _worst(got: dict, want: dict) -> tuple[float, str]:
    """Largest relative difference over the tensors, against 1e-5; gradients that are zero up to
    rounding (key biases: softmax ignores them) are compared against 1e-5 of the largest gradient
    norm."""
    floor = 1e-5 * max(float(g.norm()) for g in want.values())
    return max((float((got[n] - g).norm()) / max(float(g.norm()), floor), n) for n, g in want.items())


def _matches_each_example_alone(model, inputs: dict, ref, rows: list[dict]) -> None:
    """The sharded step's loss and gradients equal every example alone through the stock ``ref``
    (token-loss sums over the step's labelled count), within 1e-5."""
    n = inputs["num_items_in_batch"]
    assert n == sum(int((b["labels"][0, 1:] != -100).sum()) for b in rows)
    loss = model(**inputs).loss
    loss.backward()
    want = sum(hf_zoo.summed_loss(ref, b, n) for b in rows)
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    err, where = _worst(_grads(model), _grads(ref))
    assert err <= 1e-5, f"gradient of {where}: {err:.2e}"


def test_a_model_that_averages_its_own_loss_is_refused_labels_by_name():
    """Gemma 3 before transformers 5.17 shifts the labels inside its call and averages over it: a
    shard's loss would be wrong, so a batch with labels is refused by name (on every rank: the
    labels are a global fact); without labels the shard runs."""
    if not hf_zoo.own_mean_loss("gemma3"):
        pytest.skip("Gemma 3 takes the shard's shift_labels and token count on this release")
    model = hf_zoo.varlen_model("gemma3")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    batch = hf_zoo.batch("gemma3", model, [[1, 1]])
    with pytest.raises(
        ValueError,
        match=r"batch\['labels'\]: Gemma3ForConditionalGeneration on the installed transformers .* mean",
    ):
        handle.shard(batch)
    batch.pop("labels")
    assert "labels" not in handle.shard(batch)
    handle.remove()


# the families since Qwen3-VL: on every release through the 2-rank test's encoder run, here on the newest
NEWER = ("glm4v", "glm4v_moe", "glm46v", "kimi_k25", "mistral3", "gemma3", "paligemma", "gemma4", "minicpmv4_6", "minicpmv4_7",
         "minicpm_ocr", "ernie4_5_vl_moe", "llava_onevision")  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in NEWER else n for n in SPECS]
)  # fmt: skip
def test_one_process_shard_matches_the_stock_forward(name):
    """Every example alone through the stock eager model is the reference (a padded batch is not:
    the stock Qwen2-VL scores a left-padded text-only row differently from the same row alone)."""
    if hf_zoo.own_mean_loss(name):
        pytest.skip(f"{name} computes its loss as a mean over each call on this release: refused (below)")
    if hf_zoo.refused(name):
        pytest.skip(f"{name} is refused on this release (test_hf_balance.py)")
    model, ref = hf_zoo.varlen_model(name), hf_zoo.varlen_model(name, "eager")
    rows = [hf_zoo.batch(name, model, [spec], seed=3 + i) for i, spec in enumerate(SPECS[name])]
    if name == "qwen2_5_vl":
        rows[0]["second_per_grid_ts"] = torch.tensor([0.5])
    batch = hf_zoo.collate(rows, left=[i == 1 for i in range(len(rows))])
    handle = apply_dynamic_cp(model, max_tokens_per_rank=4096)
    if name.startswith(MROPE):
        # what LLaMA-Factory's collator precomputes: the M-RoPE rows of the padded batch [3, B, L]
        # (checked against shard's own, then left out; a differing row is refused by name) and
        # the deltas (left out)
        kw = {"second_per_grid_ts": batch["second_per_grid_ts"]} if "second_per_grid_ts" in batch else {}
        pos, deltas = core(ref).get_rope_index(
            batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
            image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
            attention_mask=batch["attention_mask"], **kw,
        )  # fmt: skip
        real = int(batch["attention_mask"][1].nonzero()[3])
        bad = pos.clone()
        bad[:, 1, real] += 5
        with pytest.raises(
            ValueError, match=r"position_ids'\]: the collator's M-RoPE positions of sequence 1"
        ):
            handle.shard({**batch, "position_ids": bad})
        batch["position_ids"], batch["rope_deltas"] = pos, deltas
    inputs = handle.shard(batch)
    assert "rope_deltas" not in inputs
    _matches_each_example_alone(model, inputs, ref, rows)
    total = sum(int(b["input_ids"].shape[1]) for b in rows)
    if name.startswith(MROPE) or name == "minicpmv4_7":
        # the positions are the model's own, computed on the whole sequence
        want_pos = []
        for b in rows:
            if name == "minicpmv4_7":  # its canvas, from the crops' sizes
                kw = {k: b.get(k) for k in ("target_sizes", "target_sizes_videos")}
            else:
                kw = {"second_per_grid_ts": b["second_per_grid_ts"]} if "second_per_grid_ts" in b else {}
                kw.update(image_grid_thw=b.get("image_grid_thw"), video_grid_thw=b.get("video_grid_thw"))
            pos, _ = core(ref).get_rope_index(
                b["input_ids"], mm_token_type_ids=b["mm_token_type_ids"], attention_mask=None, **kw
            )
            want_pos.append(pos[:, 0])
        assert inputs["position_ids"].shape == (4, 1, total)
        assert torch.equal(inputs["position_ids"][1:, 0], torch.cat(want_pos, dim=1))
        text = torch.cat([torch.arange(int(b["input_ids"].shape[1])) for b in rows])
        assert torch.equal(inputs["position_ids"][0, 0], text)
    else:
        assert inputs["position_ids"].shape == (1, total)
    if name == "llava_onevision":  # an image's real tiles, a video's frames
        encoded = hf_zoo.onevision_rows(model, batch)
    elif "image_sizes" in batch:  # Mistral 3: an image's own patches travel
        encoded = int(((batch["image_sizes"] // hf_zoo.P).prod(-1)).sum())
    elif name == "gemma4":  # and Gemma 4's: its patches that are not padding
        encoded = sum(int((~(batch[k] == -1).all(dim=-1)).sum()) for k in ("image_position_ids", "video_position_ids")
                      if k in batch)  # fmt: skip
    elif name.startswith("minicpm"):  # every slice's patches
        encoded = sum(
            int(batch[k].prod(-1).sum()) for k in ("target_sizes", "target_sizes_videos") if k in batch
        )
    else:
        encoded = sum(int(batch[k].shape[0]) for k in ("pixel_values", "pixel_values_videos") if k in batch)
    assert handle.stats["encoded_rows"] == encoded
    handle.remove()


# image and audio in one sequence, text alone, audio alone, audio then image, a video and a clip
OMNI = [
    [(4, 4), ("audio", 20)],
    [],
    [("audio", 13)],
    [("audio", 30), (4, 8)],
    [("video", 2, 4, 4), ("audio", 9)],
]


def test_one_process_shard_of_the_omni_thinker_matches_the_stock_forward():
    """The Qwen2.5-Omni thinker: its audio rows reach the input embeddings at their placeholders
    (the thinker takes audio only as input_features); positions, loss and gradients as the stock
    forward gives every example alone, and every clip and image encoded once."""
    model, ref = hf_zoo.varlen_model("qwen2_5_omni"), hf_zoo.varlen_model("qwen2_5_omni", "eager")
    rows = [hf_zoo.batch("qwen2_5_omni", model, [spec], seed=3 + i) for i, spec in enumerate(OMNI)]
    rows[4]["video_second_per_grid"] = torch.tensor([1.5])
    batch = hf_zoo.collate(rows, left=[i == 1 for i in range(len(rows))])
    handle = apply_dynamic_cp(model, max_tokens_per_rank=4096)
    frames = []
    core(model).audio_tower.register_forward_pre_hook(
        lambda m, a, kw: frames.append(int(kw["feature_lens"].sum())), with_kwargs=True
    )
    inputs = handle.shard(batch)
    assert set(inputs["mm_encoder_outputs"]) == {"image", "video", "audio"}
    _matches_each_example_alone(model, inputs, ref, rows)
    assert frames == [20 + 13 + 30 + 9]  # one audio tower call, every clip's valid frames
    assert handle.stats["encoders"]["audio"]["items"] == 4
    want_pos = []
    for b in rows:
        pos, _ = core(ref).get_rope_index(
            b["input_ids"], b.get("image_grid_thw"), b.get("video_grid_thw"), b["attention_mask"], False,
            b["feature_attention_mask"].sum(-1) if "feature_attention_mask" in b else None,
            b.get("video_second_per_grid"),
        )  # fmt: skip
        want_pos.append(pos[:, 0])
    assert torch.equal(inputs["position_ids"][1:, 0], torch.cat(want_pos, dim=1))
    handle.remove()
    assert not model._forward_pre_hooks  # the audio hook went with the handle


def test_one_process_shard_of_the_qwen3_omni_thinker_matches_the_stock_forward():
    """The Qwen3-Omni thinker with images and a video (its Qwen3-VL tower's deepstack rows
    carried): positions, loss and gradients as the stock forward gives every example alone."""
    model, ref = hf_zoo.varlen_model("qwen3_omni_moe"), hf_zoo.varlen_model("qwen3_omni_moe", "eager")
    specs = [[(4, 4)], [], [("video", 2, 4, 4), (4, 8)]]
    rows = [hf_zoo.batch("qwen3_omni_moe", model, [spec], seed=3 + i) for i, spec in enumerate(specs)]
    rows[2]["video_second_per_grid"] = torch.tensor([2.0])
    batch = hf_zoo.collate(rows, left=[i == 1 for i in range(len(rows))])
    handle = apply_dynamic_cp(model, max_tokens_per_rank=4096)
    inputs = handle.shard(batch)
    assert set(inputs["mm_encoder_outputs"]) == {"image", "video"}
    _matches_each_example_alone(model, inputs, ref, rows)
    want_pos = []
    for b in rows:
        pos, _ = core(ref).get_rope_index(
            b["input_ids"], b.get("image_grid_thw"), b.get("video_grid_thw"), b["attention_mask"], False, None,
            b.get("video_second_per_grid"),
        )  # fmt: skip
        want_pos.append(pos[:, 0])
    assert torch.equal(inputs["position_ids"][1:, 0], torch.cat(want_pos, dim=1).long())
    handle.remove()


def test_a_stand_in_image_under_the_mask_is_left_out():
    """LLaMA-Factory's collator gives a batch without media a stand-in image whose placeholder
    tokens it appends to the first row under ``attention_mask == 0`` (labels ignored): shard leaves
    it out, and the step equals every real example alone."""
    name = "qwen2_vl"
    model, ref = hf_zoo.varlen_model(name), hf_zoo.varlen_model(name, "eager")
    rows = [hf_zoo.batch(name, model, [[]], seed=3 + i) for i in range(3)]
    fake = hf_zoo.batch(name, model, [[(4, 4)]], seed=9)
    token = int(model.config.image_token_id)
    tokens = fake["input_ids"][0][fake["input_ids"][0] == token]
    batch = hf_zoo.collate(rows, left=[False] * 3)
    pad = torch.zeros(len(rows), tokens.numel(), dtype=torch.long)
    batch["input_ids"] = torch.cat([batch["input_ids"], pad], dim=1)
    batch["input_ids"][0, -tokens.numel() :] = tokens
    batch["attention_mask"] = torch.cat([batch["attention_mask"], pad], dim=1)
    batch["labels"] = torch.cat([batch["labels"], pad - 100], dim=1)
    mm = torch.zeros_like(batch["input_ids"])
    mm[0, -tokens.numel() :] = 1
    batch["mm_token_type_ids"] = mm
    batch["pixel_values"], batch["image_grid_thw"] = fake["pixel_values"], fake["image_grid_thw"]
    handle = apply_dynamic_cp(model, max_tokens_per_rank=4096)
    inputs = handle.shard(batch)
    assert inputs.get("pixel_values") is None or handle.stats["encoded_rows"] == 0
    _matches_each_example_alone(model, inputs, ref, rows)
    handle.remove()
