"""``apply_encoder_balance`` on real transformers model classes (tiny configs, random weights).

On 2 and 3 gloo ranks, every supported model class, each rank with its own batch (different
image/video/tile/clip counts and sizes; one rank text-only): each rank's loss must equal the
unpatched model's on the same inputs (fp32, relative 1e-5) and the gradients summed over ranks
the unpatched ones (relative 1e-4 of the largest gradient of the tensor). The same under DDP and
FSDP2 (``fully_shard``, on CPU), for a peft LoRA model (adapters in the towers and the language
model; the model inside is balanced and left as it was), for a step where no rank has any image,
and with the handle's bookkeeping (stats, remove, context manager, errors).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf.compat import transformers_version  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.integrations import hf_zoo as Z  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# per rank: a list of sequences, each a list of items (see hf_zoo.batch); rank 2 is text-only
SPECS = {
    "qwen2_vl": [[[(4, 4), (2, 6)], [("video", 2, 4, 4)]], [[(6, 4)]], []],
    "qwen2_5_vl": [[[(4, 4), (2, 6)], [("video", 2, 4, 4)]], [[(6, 4)]], []],
    "qwen3_vl": [[[(4, 4), (2, 6)], [("video", 2, 4, 4)]], [[(6, 4)]], []],
    "llava": [[[1, 1], [1]], [[1]], []],
    "llava_next": [[[(20, 40), (30, 30)], [(40, 18)]], [[(16, 16)]], []],
    "internvl": [[[3, 1], [5]], [[1]], []],
    "qwen2_audio": [[[32, 20], [11]], [[7]], []],
    "qwen2_5_omni": [[[("audio", 30), (4, 4)], [("audio", 13)]], [[("audio", 21), (2, 4)]], []],
    "qwen3_vl_moe": [[[(4, 4)], [("video", 3, 4, 4)]], [[(6, 4)]], []],
    "idefics3": [[[3, 1], [2]], [[1]], []],
    "qwen3_5": [[[(4, 4), (2, 6)], [("video", 2, 4, 4)]], [[(6, 4)]], []],
    "qwen3_5_moe": [[[(4, 4)], [("video", 3, 4, 4)]], [[(6, 4)]], []],
    # GLM-4.xV: a batch holds images or videos (their placeholders are the same token)
    "glm4v": [[[(4, 4), (2, 6)], [(6, 4), (4, 2)]], [[("video", 2, 4, 4)]], []],
    "glm4v_moe": [[[(4, 4), (2, 6)], [(6, 4)]], [[(2, 2)]], []],
    "glm46v": [[[(4, 4), (2, 6)], [(6, 4)]], [[(2, 2)]], []],
    "kimi_k25": [[[(4, 4), (2, 6)], [(6, 4), ("video", 3, 4, 4)]], [[(2, 2)]], []],
    "gemma3": [[[1, 1], [1, 1]], [[1]], []],
    "paligemma": [[[1, 1], [1, 1]], [[1]], []],
    "mistral3": [[[(16, 32), (8, 8)], [(24, 16)]], [[(8, 16)]], []],
    "qwen3_omni_moe": [
        [[("audio", 30), (4, 4)], [("audio", 130), ("audio", 110), (2, 6)]],
        [[("audio", 60), (2, 4)]],
        [],
    ],  # fmt: skip
    "llava_onevision": [[[(20, 40), (30, 30)], [("video", 2)]], [[(16, 16)]], []],
    # Gemma 4: images at their own sizes (patches, pooled 2 x 2), a video's frames as items
    "gemma4": [[[(4, 4), (2, 6)], [(6, 4), ("video", 2, 4, 4)]], [[(2, 2)]], []],
    # MiniCPM-V 4.6: slices at their own sizes (patches), an image with a thumbnail and two slices
    "minicpmv4_6": [[[(8, 8), [(8, 12), (4, 8), (4, 8)]], [(4, 4), ("video", 2, 8, 4)]], [[(4, 4)]], []],
}
# MiniCPM-V 4.7 (its M-RoPE canvas) and MiniCPM-OCR (2 x 2 merges only) take the same media
SPECS["minicpmv4_7"] = SPECS["minicpm_ocr"] = SPECS["minicpmv4_6"]
# Molmo2: images (tiles, h2, w2): a resized view and its tiles; ("video", frames); a batch holds one or the other
SPECS["molmo2"] = [[[(2, 2, 2), (1, 2, 1)], [(3, 2, 3)]], [[("video", 3)]], []]
# Ernie-4.5-VL: images and videos whose frames its resampler merges two by two (items: frame pairs)
SPECS["ernie4_5_vl_moe"] = [[[(4, 4), (2, 6)], [("video", 4, 4, 4)]], [[(6, 4), ("video", 2, 4, 2)]], []]
# families added with transformers' newer vision-language models: their balance must improve
IMPROVED = ("glm4v", "glm4v_moe", "glm46v", "kimi_k25", "gemma3", "paligemma", "mistral3", "qwen3_omni_moe",
            "llava_onevision", "gemma4", "minicpmv4_6", "minicpmv4_7", "minicpm_ocr", "molmo2", "ernie4_5_vl_moe")  # fmt: skip
# (the Qwen3-Omni thinker's audio is encoded by the thinker on each rank: qwen_omni.py says why)
ENCODERS = {"qwen2_audio": {"audio"}, "qwen2_5_omni": {"audio", "vision"}}


def _spec(name: str, rank: int, world: int):
    specs = SPECS[name]
    if (name == "kimi_k25" and not Z.kimi_videos_run()) or (name == "gemma4" and not Z.gemma4_videos_run()):
        # transformers' own video path fails there
        specs = [[[x for x in seq if x[0] != "video"] for seq in r] for r in specs]
    return specs[rank] if world == 3 else specs[rank] + (specs[2] if rank == 1 else [])


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n] = torch.zeros(p.shape) if g is None else g.detach().clone().reshape(p.shape)
    return out


def _summed(grads: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    import torch.distributed as dist

    out = {}
    for n, g in grads.items():
        g = g.clone()
        dist.all_reduce(g)
        out[n] = g.numpy()
    return out


def _same_results(rank: int, world: int, names: tuple[str, ...], mode: str) -> dict:
    """Reference: the unpatched model on this rank's batch; then the balanced one (plain, DDP, FSDP2)."""
    import torch.distributed as dist

    from mmbalance.integrations.hf import apply_encoder_balance

    results = {}
    for name in names:
        model = Z.build(name, seed=1)
        batch = Z.batch(name, model, _spec(name, rank, world), seed=10 + rank)
        inner = model
        if mode == "lora":  # the loop trains a peft LoRA model around it, towers included
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(3)
            targets = ["q_proj", "v_proj", "qkv", "fc1"]  # the language model's and the towers'
            model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        ref = model(**batch)
        ref.loss.backward()
        ref_grads = _summed(_grads(model))
        model.zero_grad(set_to_none=True)
        target = model
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            target = DistributedDataParallel(model, find_unused_parameters=name in ("llava", "llava_next"))
        elif mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            fully_shard(model, mesh=mesh)
        handle = apply_encoder_balance(target)
        out = target(**batch)
        out.loss.backward()
        grads = _grads(model)
        if mode in ("plain", "lora"):
            got = _summed(grads)
        else:  # DDP's all-reduce and FSDP2's reduce-scatter average over the ranks
            got = {n: g.numpy() * world for n, g in grads.items()}
        handle.remove()
        # the handle balanced the model inside the wrapper and left it as it was
        assert handle.model is inner and "forward" not in inner.__dict__, name
        results[name] = {
            "loss": (float(ref.loss), float(out.loss)),
            "grads": (ref_grads, got),
            "stats": dict(handle.stats),
        }
        dist.barrier()
    return {
        k: {"loss": v["loss"], "stats": v["stats"], "grad_err": _grad_err(*v["grads"])}
        for k, v in results.items()
    }


def _grad_err(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> tuple[float, str]:
    """Largest difference relative to the tensor's largest reference gradient (and where)."""
    worst, where = 0.0, ""
    for n, r in ref.items():
        scale = max(float(np.abs(r).max()), 1e-6)
        err = float(np.abs(got[n] - r).max()) / scale
        if err > worst:
            worst, where = err, n
    return worst, where


WRAPPED = ("qwen2_vl", "qwen3_vl", "llava_next", "internvl", "qwen2_audio")
LORA = ("qwen2_vl", "llava")


@functools.cache
def _run(world: int, mode: str) -> list[dict]:
    names = {"plain": Z.MODELS if world == 2 else THREE_RANKS, "lora": LORA}.get(mode, WRAPPED)
    names = tuple(n for n in names if Z.available(n) and not Z.refused(n))
    return run_distributed(_same_results, world, names, mode, timeout=840, pg_timeout=300)


# on 3 ranks too: the families before Qwen3.5, and of the newer ones those whose items differ most
# (Pixtral's, Gemma 4's and MiniCPM-V's own sizes, OneVision's tiles and frames, the Omni thinker's two towers); the
# rest on 2
THREE_RANKS = tuple(n for n in Z.MODELS if n not in ("qwen3_5", "qwen3_5_moe", *IMPROVED)) + (
    "mistral3", "llava_onevision", "qwen3_omni_moe", "gemma4", "minicpmv4_6", "molmo2", "ernie4_5_vl_moe",
)  # fmt: skip
CASES = (
    [(name, 2, "plain") for name in Z.MODELS]
    + [(name, 3, "plain") for name in Z.MODELS if name in THREE_RANKS]
    + [(name, 2, mode) for mode in ("ddp", "fsdp2") for name in WRAPPED]
    + [(name, 2, "lora") for name in LORA]
)


@pytest.mark.parametrize(("name", "world", "mode"), CASES, ids=[f"{n}-{w}ranks-{m}" for n, w, m in CASES])
def test_balanced_model_gives_the_unbalanced_loss_and_gradients(name, world, mode):
    if not Z.available(name):
        pytest.skip(f"transformers {transformers_version()} has no {name}")
    if Z.refused(name):
        pytest.skip(
            f"refused on transformers {transformers_version()} (test_a_release_that_cannot_balance_...)"
        )
    for rank, res in enumerate(_run(world, mode)):
        ref_loss, loss = res[name]["loss"]
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"rank {rank}: loss {loss} vs unbalanced {ref_loss}"
        err, where = res[name]["grad_err"]
        assert err < 1e-4, f"rank {rank}: summed gradient of {where} off by {err:.2e} (relative)"
        stats = res[name]["stats"]
        assert set(stats) == ENCODERS.get(name, {"vision"})
        for enc in stats.values():
            assert set(enc) == {"before", "after", "moved"}
            assert 1.0 <= enc["after"] <= enc["before"] + 1e-12 and 0.0 <= enc["moved"] <= 1.0
            if name in IMPROVED:
                assert enc["after"] < enc["before"], f"rank {rank}: {name}'s {enc} not improved"


# ---------------------------------------------------------------------------------- balance, edge steps
def _skewed(rank: int, world: int) -> dict:
    """One rank with several large images, the others with one small one each; then a step where
    no rank has any image; then a step with wildly different counts."""
    from mmbalance.integrations.hf import apply_encoder_balance

    model = Z.build("qwen2_vl", seed=2)
    handle = apply_encoder_balance(model)
    out = {}
    spec = [[(8, 8)] * 3, [(8, 8)] * 3] if rank == 0 else [[(2, 2)]]
    model(**Z.batch("qwen2_vl", model, spec, seed=rank)).loss.backward()
    out["skewed"] = dict(handle.stats["vision"])
    ref_model = Z.build("qwen2_vl", seed=2)
    text = Z.batch("qwen2_vl", model, [], seed=rank)
    loss = model(**text).loss
    loss.backward()
    out["text_only"] = (float(loss), float(ref_model(**text).loss), "vision" in handle.stats)
    spec = [[(2, 2)] * (7 if rank == 0 else 1)] + ([[(10, 6)]] if rank == world - 1 else [])
    model(**Z.batch("qwen2_vl", model, spec, seed=rank + 5)).loss.backward()
    out["uneven"] = dict(handle.stats["vision"])
    handle.remove()
    return out


@functools.cache
def _skewed_results(world: int):
    return run_distributed(_skewed, world, timeout=600)


@pytest.mark.parametrize("world", [2, 3])
def test_a_skewed_step_is_balanced(world):
    for res in _skewed_results(world):
        assert res["skewed"]["before"] > 1.5
        assert res["skewed"]["after"] <= 1.10, res["skewed"]
        assert res["uneven"]["after"] <= res["uneven"]["before"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_without_images_anywhere_runs_the_stock_path(world):
    for res in _skewed_results(world):
        loss, ref, has_vision_stats = res["text_only"]
        assert loss == pytest.approx(ref, rel=1e-6) and not has_vision_stats


# ---------------------------------------------------------------------------------- the handle
def _handle_behaviour(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mmbalance.collectives import teardown
    from mmbalance.integrations.hf import EncoderBalanceHandle, apply_encoder_balance

    out = {}
    model = Z.build("internvl", seed=3)
    cls_forward = type(model).forward
    with apply_encoder_balance(model) as handle:
        assert isinstance(handle, EncoderBalanceHandle)
        assert model.forward is handle
        # the world is kept until exit (freeing a DDP model then cannot destroy it: no teardown
        # hang); the balancing's own group is not, remove() releases it
        own = handle.group
        out["world held"] = any(g is dist.group.WORLD for g in teardown._HELD)
        out["own held"] = any(g is own for g in teardown._HELD)
        try:
            apply_encoder_balance(model)
            out["second"] = None
        except ValueError as exc:
            out["second"] = str(exc)
    out["restored"] = "forward" not in model.__dict__ and model.forward.__func__ is cls_forward
    out["own destroyed"] = own not in dist.distributed_c10d._world.pg_map
    del own
    try:
        apply_encoder_balance(torch.nn.Linear(2, 2))
        out["unknown"] = None
    except ValueError as exc:
        out["unknown"] = str(exc)
    # a second application after remove() works, and eval mode runs the stock forward
    handle = apply_encoder_balance(model)
    model.eval()
    b = Z.batch("internvl", model, [[2]], seed=rank)
    with torch.no_grad():
        model(**b)
    out["eval_stats"] = dict(handle.stats)
    handle.remove()
    return out


def test_handle_remove_context_manager_and_errors():
    for res in run_distributed(_handle_behaviour, 2, timeout=600):
        assert res["second"] and "already has encoder balancing" in res["second"]
        assert res["restored"]
        assert (
            res["unknown"]
            and "Qwen2VLForConditionalGeneration" in res["unknown"]
            and "Linear" in res["unknown"]
        )
        assert res["eval_stats"] == {}
        assert res["world held"] and not res["own held"] and res["own destroyed"]


# ---------------------------------------------------------------------------------- a user's adapter
class ToyModel(torch.nn.Module):
    """Not a transformers model: an encoder over variable-length items and a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.encoder = torch.nn.Linear(3, 5)
        self.head = torch.nn.Linear(5, 1)

    def forward(self, items=None, lengths=None, features=None):
        if features is None:
            features = torch.tanh(self.encoder(items))
        loss = self.head(features).square().sum()
        return type("Out", (), {"loss": loss, "logits": features})()


def _toy_adapter():
    from mmbalance.integrations.hf import EncoderAdapter, Items

    class ToyAdapter(EncoderAdapter):
        encoder = "toy"
        meta_columns = ("length",)

        def extract(self, model, kwargs):
            items, lengths = kwargs.pop("items"), kwargs.pop("lengths")
            return Items([items], lengths, lengths[:, None])

        def empty_payload(self, model):
            return [torch.empty(0, 3)]

        def encode(self, model, payload, meta):
            return [torch.tanh(model.encoder(payload[0]))]

        def out_rows(self, model, meta):
            return meta[:, 0]

        def dummy(self, model):
            return [torch.zeros(1, 3)], np.ones((1, 1), dtype=np.int64)

        def restore(self, model, kwargs, items, outputs):
            kwargs["features"] = outputs[0]
            return kwargs

        def cost(self, model, meta, rows):
            return meta[:, 0].astype(float) ** 2

    return ToyAdapter()


def _toy(rank: int, world: int) -> dict:
    from mmbalance.integrations.hf import apply_encoder_balance

    g = torch.Generator().manual_seed(rank)
    lengths = np.array([5, 1, 7, 2] if rank == 0 else [1], dtype=np.int64)
    items = torch.randn(int(lengths.sum()), 3, generator=g)
    model = ToyModel()
    ref = model(items=items, lengths=lengths)
    ref.loss.backward()
    ref_grad = model.encoder.weight.grad.clone()
    model.zero_grad()
    handle = apply_encoder_balance(model, adapters=[_toy_adapter()])
    out = model(items=items, lengths=lengths)
    out.loss.backward()
    handle.remove()
    return {
        "loss": (float(ref.loss), float(out.loss)),
        "grads": (_summed({"w": ref_grad})["w"], _summed({"w": model.encoder.weight.grad})["w"]),
        "stats": handle.stats["toy"],
    }


def test_a_user_adapter_balances_a_model_mmbalance_does_not_know():
    for res in run_distributed(_toy, 2, timeout=300):
        assert res["loss"][1] == pytest.approx(res["loss"][0], rel=1e-6)
        np.testing.assert_allclose(res["grads"][1], res["grads"][0], rtol=1e-5, atol=1e-7)
        assert res["stats"]["after"] < res["stats"]["before"]


def test_a_family_not_balanced_yet_is_refused_with_the_reason():
    """Before any process group is needed: the class and the reason, not a generic 'no adapter'."""
    import transformers as tf

    from mmbalance.integrations.hf import apply_encoder_balance

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)  # fmt: skip
    model = tf.Llama4ForConditionalGeneration(tf.Llama4Config(text_config=text, vision_config=vision))
    with pytest.raises(
        ValueError,
        match=r"Llama4ForConditionalGeneration: its encoders are not balanced: transformers' own forward",
    ):
        apply_encoder_balance(model)


def test_a_release_that_cannot_balance_a_family_refuses_it_by_name():
    """MiniCPM-V 4.6 on a release whose window merger takes every slice of a call at the first
    slice's size (5.16): a call of several ranks' slices would be merged wrongly, so
    ``apply_encoder_balance`` and ``apply_dynamic_cp`` refuse it, with the reason."""
    from mmbalance.integrations.hf import apply_dynamic_cp, apply_encoder_balance, register_attention

    if not Z.refused("minicpmv4_6"):
        pytest.skip(
            f"transformers {transformers_version()} merges MiniCPM-V's slices one by one (or has none)"
        )
    model = Z.build("minicpmv4_6")
    with pytest.raises(
        ValueError,
        match=r"MiniCPMV4_6ForConditionalGeneration: its vision encoder is not balanced: .*first slice",
    ):
        apply_encoder_balance(model)
    register_attention()
    model.set_attn_implementation("mmbalance_varlen")
    with pytest.raises(
        ValueError, match=r"does not shard MiniCPMV4_6ForConditionalGeneration: .*first slice"
    ):
        apply_dynamic_cp(model, max_tokens_per_rank=64)
