"""Dynamic context parallelism in multimodal models (``apply_dynamic_cp`` on Qwen-VL, LLaVA and the
Qwen2.5-Omni thinker).

The multi-rank runs (``cp_vlm_loop.py``, 4 ranks as torchrun starts them) check loss, gradients,
the encoder calls and the budget against a one-process reference, with and without encoder
balancing, and a bad batch on one rank. The rest runs in one process: refusals by name and the
placeholder counting the feature move is cut by; every supported family's one-process shard against
its stock forward (positions from ``get_rope_index`` included) is in ``test_cp_vlm_shard.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mmbalance.balancing import CostModel  # noqa: E402
from mmbalance.integrations.hf import apply_dynamic_cp, register_attention  # noqa: E402
from mmbalance.integrations.hf.cp import SUPPORTED  # noqa: E402
from mmbalance.integrations.hf.cp.vlm_plan import GatheredStep, PlaceholderRuns  # noqa: E402
from mmbalance.integrations.hf.encoders import core  # noqa: E402
from tests.dist_utils import REPO, launch, run_distributed  # noqa: E402
from tests.integrations import hf_zoo  # noqa: E402

SCRIPT = REPO / "tests" / "integrations" / "cp_vlm_loop.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_vlm_step_matches_one_process_reference_on_4_ranks():
    runs = ["qwen2_vl:plain", "qwen2_vl:encoder", "qwen2_5_vl:plain", "qwen2_5_vl:encoder", "qwen2_vl:fault"]
    runs.append("qwen2_vl:stream")  # handle.batches over loaders of different lengths
    out = launch(SCRIPT, *runs, nproc=4, timeout=840)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    for x in lines[:4]:
        assert sorted(x["degrees"]) == [1, 3] and x["largest_shard"] <= 64
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5
        assert x["split_items"]["image"] >= 1 and x["split_items"]["video"] >= 1
        assert x["after"] < x["before"]
    assert lines[4]["refused"]
    stream = lines[5]
    assert stream["steps"] == 3 and stream["degrees"][0] == 3, stream  # the video split over 3 ranks
    assert stream["loss_rel"] <= 1e-5 and stream["grad_rel"] <= 1e-5, stream


@pytest.mark.slow
@pytest.mark.distributed
def test_qwen3_vl_llava_and_omni_steps_match_one_process_reference_on_4_ranks():
    """Qwen3-VL (a timestamp per temporal patch, deepstack features), LLaVA (a document of eight
    images in place of the video) and the Qwen2.5-Omni thinker (a long audio clip in its place, an
    image and a clip in one sequence): the same checks, with and without encoder balancing."""
    runs = ["qwen3_vl:plain", "qwen3_vl:encoder", "llava:plain", "llava:encoder"]
    runs += ["qwen2_5_omni:plain", "qwen2_5_omni:encoder"]
    out = launch(SCRIPT, *runs, nproc=4, timeout=840)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    for x in lines:
        assert sorted(x["degrees"]) == [1, 3] and x["largest_shard"] <= 64
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5
        assert x["split_items"]["image"] >= 1
        assert x["after"] < x["before"]
    assert all(x["split_items"]["video"] >= 1 for x in lines[:2])
    assert all(x["split_items"]["audio"] >= 1 for x in lines[4:])  # the long clip's rows on 3 ranks


@pytest.mark.slow
@pytest.mark.distributed
def test_qwen3_5_steps_with_media_in_split_sequences_match_the_reference_on_4_ranks():
    """Qwen3.5 (Gated DeltaNet beside full attention, Qwen3-VL's tower): a video over twice the
    budget split over 3 ranks, images straddling shard boundaries, with and without encoder
    balancing: the same checks (its Gated DeltaNet states handed along each CP group)."""
    runs = ["qwen3_5:plain", "qwen3_5:encoder"]
    out = launch(SCRIPT, *runs, nproc=4, timeout=840)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    for x in lines:
        assert sorted(x["degrees"]) == [1, 3] and x["largest_shard"] <= 64
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x
        assert x["split_items"]["image"] >= 1 and x["split_items"]["video"] >= 1


@pytest.mark.slow
@pytest.mark.distributed
def test_families_since_qwen3_vl_split_their_media_over_2_ranks_exactly():
    """GLM-4.1V, GLM-4.5V, GLM-4.6V, Kimi-K2.5 (a video clip too), Mistral 3 (images at their own sizes)
    Gemma 3 and Gemma 4 (each image a bidirectional block, the blocks cut by the zigzag
    boundaries), PaliGemma (each prefix of images and prompt a bidirectional block over both
    ranks), the Qwen3-Omni thinker (deepstack rows, a video split) and MiniCPM-V 4.6, 4.7 and
    MiniCPM-OCR (slices at their own sizes, 4.7's M-RoPE canvas, their Gated DeltaNet layers'
    state handed across the cut): media
    in a sequence over the budget, split over 2 ranks and cut at the boundary, with and without
    encoder balancing: loss and every gradient within 1e-5 of each example alone, every item
    encoded once in the world."""
    runs = [f"{name}:{balance}" for name in ("glm4v", "glm4v_moe", "glm46v", "kimi_k25", "mistral3", "gemma3", "paligemma", "gemma4",
                                             "qwen3_omni_moe", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr",
                                             "ernie4_5_vl_moe", "llava_onevision")
            if hf_zoo.available(name) and not hf_zoo.own_mean_loss(name) and not hf_zoo.refused(name)
            for balance in ("plain", "encoder")]  # fmt: skip
    out = launch(SCRIPT, *runs, nproc=2, timeout=840)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    for x in lines:
        assert x["degrees"] == [2] and x["largest_shard"] <= 64, x
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5, x
        assert x["split_items"]["image"] >= 1, x


@pytest.mark.slow
@pytest.mark.distributed
def test_vlm_steps_under_fsdp2_match_one_process_reference_on_4_ranks():
    """FSDP2 (every decoder layer, the towers but LLaVA's, the root): ``shard`` moves the encoder
    inputs and leaves encoding and the feature move to the forward, where FSDP2 gathers the
    towers; loss and summed gradients against the stock model as without FSDP2, with and without
    encoder balancing, and a stream."""
    runs = ["qwen2_vl:fsdp2", "qwen3_vl:fsdp2", "llava:fsdp2", "qwen2_5_omni:fsdp2"]
    runs += ["qwen2_vl:encoder_fsdp2", "llava:encoder_fsdp2", "qwen2_5_omni:encoder_fsdp2"]
    runs.append("qwen2_vl:fsdp2_ckpt")  # with gradient checkpointing
    runs.append("qwen2_vl:stream_fsdp2")  # steps with ranks that have nothing to encode, or nothing
    runs.insert(-1, "qwen2_vl:fsdp2_bf16")  # FSDP2's mixed precision: loss 1e-3, gradients 0.15
    out = launch(SCRIPT, *runs, nproc=4, timeout=840)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [x["run"] for x in lines] == runs, out[-3000:]
    stream = lines.pop()
    assert stream["steps"] == 3 and stream["degrees"][0] == 3, stream
    assert stream["loss_rel"] <= 1e-5 and stream["grad_rel"] <= 1e-5, stream
    bf16 = lines.pop()
    assert bf16["loss_rel"] <= 1e-3 and bf16["grad_rel"] <= 0.15, bf16
    for x in lines:
        assert sorted(x["degrees"]) == [1, 3] and x["largest_shard"] <= 64
        assert x["loss_rel"] <= 1e-5 and x["grad_rel"] <= 1e-5
        assert x["split_items"]["image"] >= 1 and x["after"] < x["before"]
    assert lines[0]["split_items"]["video"] >= 1 and lines[4]["split_items"]["video"] >= 1
    assert lines[3]["split_items"]["audio"] >= 1 and lines[6]["split_items"]["audio"] >= 1


def _fsdp2_family(rank: int, world: int) -> dict:
    """FSDP2 on a multimodal model (the tower a unit of its own, then the root): the family is
    found through FSDP2's ``FSDP<Name>`` class, and ``shard`` leaves the media to the forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mmbalance.integrations.hf.cp.shard import MEDIA_KEYWORD

    model = hf_zoo.varlen_model("qwen2_vl")
    batch = hf_zoo.batch("qwen2_vl", model, [[(4, 4)]], seed=rank)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(core(model).visual, mesh=mesh)
    fully_shard(model, mesh=mesh)
    hooks = len(model._forward_pre_hooks)  # FSDP2's own
    handle = apply_dynamic_cp(model, max_tokens_per_rank=96)  # FSDP<Name> keeps its family
    kw = handle.shard(batch)
    out = {"class": type(model).__name__, "pending": MEDIA_KEYWORD in kw, "mm": "mm_encoder_outputs" in kw}
    model(**kw).loss.backward()
    handle.remove()  # and the media hook its shard installed
    out["hooks left"] = len(model._forward_pre_hooks) - hooks
    return out


def _fsdp2_on_one_rank(rank: int, world: int) -> str:
    """Rank 0's vision tower under FSDP2, rank 1's not (the model's class is the same on both):
    ``shard`` raises on both before anything moves. (A root wrapped on one rank only differs in
    class, which ``apply_dynamic_cp`` refuses.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = hf_zoo.varlen_model("qwen2_vl")
    batch = hf_zoo.batch("qwen2_vl", model, [[(4, 4)]], seed=rank)
    mesh = init_device_mesh("cpu", (world,))  # collective: every rank
    if rank == 0:
        fully_shard(core(model).visual, mesh=mesh)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=96)
    with pytest.raises(ValueError) as exc:
        handle.shard(batch)
    handle.remove()
    return str(exc.value)


@pytest.mark.distributed
def test_fsdp2_on_some_ranks_only_is_refused_on_every_rank():
    for msg in run_distributed(_fsdp2_on_one_rank, 2, timeout=300, pg_timeout=60):
        assert "encoders in the forward (FSDP2)" in msg, msg


@pytest.mark.distributed
def test_fsdp2_keeps_the_family_and_leaves_the_media_to_the_forward():
    for res in run_distributed(_fsdp2_family, 2, timeout=300, pg_timeout=60):
        want = {"class": "FSDPQwen2VLForConditionalGeneration", "pending": True, "mm": False, "hooks left": 0}
        assert res == want, res


def test_unresolved_media_are_refused_by_the_attention():
    """Pending media that reach an attention call (the model's pre-hook did not run: a call of
    ``model.forward`` or of an inner module) raise instead of losing the features."""
    from mmbalance.integrations.hf.cp.attention import cp_attention
    from mmbalance.integrations.hf.cp.shard import MEDIA_KEYWORD, idle_shard

    q = torch.zeros(1, 2, 1, 8)
    with pytest.raises(RuntimeError, match=f"{MEDIA_KEYWORD}.*call the model itself"):
        cp_attention(None, q, q, q, None, 1.0, idle_shard(), {MEDIA_KEYWORD: object()})


def test_omni_audio_rows_must_match_the_placeholders():
    """The thinker's pre-hook places the shard's audio rows; a count that does not match the
    placeholders of input_ids is refused by name, not scattered short."""
    model = hf_zoo.varlen_model("qwen2_5_omni")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    inputs = handle.shard(hf_zoo.batch("qwen2_5_omni", model, [[("audio", 20)]]))
    audio = inputs["mm_encoder_outputs"]["audio"]
    inputs["mm_encoder_outputs"] = {"audio": type(audio)(pooler_output=(audio.pooler_output[0][1:],))}
    with pytest.raises(ValueError, match=r"mm_encoder_outputs\['audio'\]: 4 rows for the 5 audio"):
        model(**inputs)
    handle.remove()


def test_the_budget_counts_vision_tokens():
    model = hf_zoo.varlen_model("qwen2_vl")
    batch = hf_zoo.batch("qwen2_vl", model, [[(8, 8), (8, 8)]])  # 45 tokens, 32 of them vision
    handle = apply_dynamic_cp(model, max_tokens_per_rank=40)
    with pytest.raises(ValueError, match="max_tokens_per_rank=40"):
        handle.shard(batch)
    handle.remove()


@pytest.mark.parametrize("name", ["llava_next", "internvl", "idefics3", "qwen2_audio"])
def test_other_multimodal_models_are_refused_by_name(name):
    register_attention()
    model = hf_zoo.build(name)
    with pytest.raises(ValueError) as info:
        apply_dynamic_cp(model, max_tokens_per_rank=64)
    text = str(info.value)
    assert type(model).__name__ in text and all(c in text for c in SUPPORTED), text


@pytest.mark.parametrize(
    ("name", "reason"),
    [("molmo2", "one bidirectional block")],
)  # fmt: skip
def test_families_whose_media_cannot_be_split_yet_are_refused_with_the_reason(name, reason):
    register_attention()
    model = hf_zoo.build(name)
    with pytest.raises(ValueError, match=rf"does not shard {type(model).__name__}: .*{reason}"):
        apply_dynamic_cp(model, max_tokens_per_rank=64)


def test_glm_videos_need_their_token_types():
    """A GLM video's placeholders are image tokens: without ``mm_token_type_ids`` (or with a type
    that is neither an image's nor a video's) the shard cannot tell them apart, and says so."""
    model = hf_zoo.varlen_model("glm4v")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    batch = hf_zoo.batch("glm4v", model, [[("video", 2, 4, 4)]])
    with pytest.raises(ValueError, match=r"mm_token_type_ids'\] is missing: GLM-4.1V's video placeholders"):
        handle.shard({k: v for k, v in batch.items() if k != "mm_token_type_ids"})
    bad = batch["mm_token_type_ids"].clone()
    bad[bad == 2] = 3
    with pytest.raises(ValueError, match=r"mm_token_type_ids'\] of sequence 0: an image placeholder token"):
        handle.shard({**batch, "mm_token_type_ids": bad})
    handle.shard(batch)
    handle.remove()


def test_llava_onevision_videos_are_refused_by_name_where_the_forward_adds_their_newline():
    if hf_zoo.onevision_videos_shard():
        pytest.skip("this release's LLaVA-OneVision forward takes mm_encoder_outputs: its videos split")
    model = hf_zoo.varlen_model("llava_onevision")
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    with pytest.raises(ValueError, match=r"pixel_values_videos.*appends a newline row to each video's rows"):
        handle.shard(hf_zoo.batch("llava_onevision", model, [[("video", 2)]]))
    handle.shard(hf_zoo.batch("llava_onevision", model, [[(20, 40)]]))  # images split on every release
    handle.remove()


QWEN_BATCH = ("qwen2_vl", [[(4, 4)], []])
OMNI_BATCH = ("qwen2_5_omni", [[("audio", 20), (4, 4)]])
# case: (model and batch spec, change to the batch, the error, words its message must hold)
BAD_BATCHES = {
    "grid": (QWEN_BATCH, lambda b: b.update(image_grid_thw=torch.tensor([[1, 4, 8]])), ValueError,
             ["image_grid_thw"]),
    "no-pixels": (QWEN_BATCH, lambda b: (b.pop("pixel_values"), b.pop("image_grid_thw")), ValueError,
                  ["image placeholder", "pixel_values"]),
    "mrope-positions": (QWEN_BATCH,
                        lambda b: b.update(position_ids=torch.zeros(3, 1, b["input_ids"].shape[1], dtype=torch.long)),
                        ValueError, ["position_ids", "M-RoPE"]),
    "unknown-key": (QWEN_BATCH, lambda b: b.update(cache_position=torch.arange(3)), ValueError,
                    ["cache_position", "Qwen2-VL"]),
    "omni-audio-in-video": (OMNI_BATCH, lambda b: b.update(use_audio_in_video=True), NotImplementedError,
                            ["use_audio_in_video"]),
    "omni-no-features": (OMNI_BATCH, lambda b: (b.pop("input_features"), b.pop("feature_attention_mask")),
                         ValueError, ["audio placeholder", "input_features"]),
    "omni-too-few-frames": (OMNI_BATCH, lambda b: b["feature_attention_mask"][0, :8].zero_(), ValueError,
                            ["input_features", "audio"]),
    "omni-video-without-seconds": (("qwen2_5_omni", [[("video", 2, 4, 4)]]), lambda b: None, ValueError,
                                   ["video_second_per_grid"]),
    # Gemma 3's image blocks come from token_type_ids: without them, or with other ones, refused
    "gemma3-no-token-types": (("gemma3", [[1, 1]]), lambda b: b.pop("token_type_ids"), ValueError,
                              ["token_type_ids", "missing"]),
    "gemma3-other-token-types": (("gemma3", [[1, 1]]), lambda b: b["token_type_ids"][0, :2].fill_(1), ValueError,
                                 ["token_type_ids", "sequence 0"]),
    # the Qwen3-Omni thinker: audio stays with the thinker, and positions must be integers
    "omni3-audio": (("qwen3_omni_moe", [[("audio", 30), (4, 4)]]), lambda b: None, ValueError,
                    ["input_features", "Qwen3-Omni-MoE thinker"]),
    "omni3-audio-placeholders": (("qwen3_omni_moe", [[("audio", 30)]]),
                                 lambda b: (b.pop("input_features"), b.pop("feature_attention_mask")), ValueError,
                                 ["audio placeholders", "Qwen3-Omni"]),
    "omni3-fractional-seconds": (("qwen3_omni_moe", [[("video", 2, 4, 4)]]),
                                 lambda b: b.update(video_second_per_grid=torch.tensor([0.5])), ValueError,
                                 ["video_second_per_grid", "fractional"]),
    "gemma4-no-token-types": (("gemma4", [[(4, 4)]]), lambda b: b.pop("mm_token_type_ids"), ValueError,
                              ["mm_token_type_ids", "missing"]),
    "gemma4-bad-token-types": (("gemma4", [[(4, 4)]]), lambda b: b["mm_token_type_ids"].fill_(0), ValueError,
                               ["mm_token_type_ids", "sequence 0"]),
    "paligemma-no-token-types": (("paligemma", [[1]]), lambda b: b.pop("token_type_ids"), ValueError,
                                 ["token_type_ids", "missing"]),
    "paligemma-prefix-after-suffix": (("paligemma", [[1]]), lambda b: b["token_type_ids"][0, -1].fill_(0),
                                      ValueError, ["token_type_ids", "sequence 0", "suffix"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_vlm_batches_are_refused_by_name(case):
    (name, spec), change, error, words = BAD_BATCHES[case]
    model = hf_zoo.varlen_model(name)
    batch = hf_zoo.batch(name, model, spec)
    change(batch)
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    with pytest.raises(error) as info:
        handle.shard(batch)
    for w in words:
        assert w in str(info.value), str(info.value)
    handle.remove()


def test_llava_variable_resolution_images_are_refused():
    model = hf_zoo.varlen_model("llava")
    batch = hf_zoo.batch("llava", model, [[1]])
    batch["image_sizes"] = torch.tensor([[16, 16]])
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256)
    with pytest.raises(ValueError, match="image_sizes"):
        handle.shard(batch)
    handle.remove()


def test_a_callable_cost_needs_encoder_cost_none_for_a_vlm():
    model = hf_zoo.varlen_model("qwen2_vl")

    def cost(lengths, degree):
        return lengths / degree

    with pytest.raises(ValueError, match="encoder_cost=None"):
        apply_dynamic_cp(model, max_tokens_per_rank=256, cost=cost)
    with pytest.raises(ValueError, match="encoder_cost"):
        apply_dynamic_cp(model, max_tokens_per_rank=256, encoder_cost="flops")
    apply_dynamic_cp(model, max_tokens_per_rank=256, cost=cost, encoder_cost=None).remove()
    handle = apply_dynamic_cp(model, max_tokens_per_rank=256, cost=CostModel(linear=1.0),
                              encoder_cost=lambda enc, meta, rows: rows * 1e-3)  # fmt: skip
    batch = hf_zoo.batch("qwen2_vl", model, [[(4, 4)], []])
    model(**handle.shard(batch)).loss.backward()
    handle.remove()


@settings(max_examples=80, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6)), min_size=0, max_size=8), data=st.data())
def test_placeholder_counts_before_any_offset(runs, data):
    kind = np.concatenate([np.full(n, k) for k, n in runs]) if runs else np.zeros(0, dtype=np.int64)
    step = GatheredStep(
        lengths=np.array([kind.size]), labelled=np.zeros(1), seq_src=np.zeros(1, dtype=np.int64),
        run_seq=np.zeros(len(runs), dtype=np.int64), run_kind=np.array([k for k, _ in runs], dtype=np.int64),
        run_len=np.array([n for _, n in runs], dtype=np.int64), src=[], seq=[], stream=[], rows=[], out_rows=[],
        meta=[],
    )  # fmt: skip
    x = np.array(data.draw(st.lists(st.integers(0, kind.size), min_size=1, max_size=6)), dtype=np.int64)
    counted = PlaceholderRuns(step, 1)
    for k in (1, 2):
        want = np.array([int((kind[:v] == k).sum()) for v in x])
        assert counted.before(0, k, x).tolist() == want.tolist()


def test_balance_trainer_refuses_an_unsupported_vlm_by_name(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from mmbalance.integrations.hf import balance_trainer

    register_attention()
    model = hf_zoo.build("llava_next")
    model.set_attn_implementation("mmbalance_varlen")
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=1
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": torch.ones(4, dtype=torch.long)}] * 4
    )
    with pytest.raises(ValueError) as info:
        balance_trainer(trainer, context_parallel=True, max_tokens_per_rank=64)
    assert "LlavaNextForConditionalGeneration" in str(
        info.value
    ) and "Qwen2VLForConditionalGeneration" in str(info.value)
