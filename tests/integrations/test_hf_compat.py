"""The compatibility layer of the Hugging Face integration (``integrations/hf/compat.py``) and the
floor it declares, on whichever transformers is installed (``make test`` runs this file on every
release of its matrix).

* the floor agrees everywhere it is written (pyproject's extras, the import check, the README's
  table, the Makefile's matrix), and an older transformers is refused at import, by name;
* no module but ``compat.py`` reads the transformers version;
* encoder outputs fed to a model's own forward (``feeding_encoder_outputs``) give the logits of
  the pixels they came from, for each form the releases have (per-item features, Qwen3-VL's
  deepstack layers, the Qwen2.5-Omni thinker's), and leave the model as it was;
* a loss that some releases compute without the forward's keywords gets them
  (``install_loss_keywords``);
* wrappers: the model inside a peft model, and how a refusal names the way in.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")

from mmbalance.integrations.hf import compat  # noqa: E402
from mmbalance.integrations.hf.encoders import core  # noqa: E402
from mmbalance.integrations.hf.wrappers import inner_model, wrapper_hint  # noqa: E402
from tests import procs  # noqa: E402
from tests.integrations import hf_zoo  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FLOOR = ".".join(map(str, compat.TRANSFORMERS_FLOOR))


# ------------------------------------------------------------------------------- the floor
def _matrix() -> list[str]:
    make = (REPO / "Makefile").read_text()
    found = re.search(r"^TF_MATRIX\s*:=\s*(.+)$", make, re.M)
    assert found, "the Makefile names no TF_MATRIX"
    return found.group(1).split()


def _readme_tested() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("### Hugging Face transformers versions", 1)
    assert len(section) == 2, "README has no 'Hugging Face transformers versions' section"
    return re.findall(r"^\| `?(5\.\d+\.\d+)`? \|", section[1].split("\n## ", 1)[0], re.M)


def test_the_floor_agrees_everywhere():
    """pyproject's hf and test extras, the import check, the lowest release of the Makefile's
    matrix and of the README's table of tested releases: one floor."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("hf", "test"):
        spec = [r for r in extras[extra] if r.startswith("transformers")]
        assert spec == [f"transformers>={FLOOR}"], (extra, spec)
    matrix = _matrix()
    tested = _readme_tested()
    assert min(matrix, key=lambda v: tuple(map(int, v.split(".")))).startswith(FLOOR + "."), matrix
    assert set(matrix) <= set(tested), (matrix, tested)
    assert min(tuple(map(int, v.split("."))) for v in tested)[:2] == compat.TRANSFORMERS_FLOOR, tested


def test_an_older_transformers_is_refused_at_import_by_name():
    code = "import transformers; transformers.__version__ = '5.5.4'\nimport mmbalance.integrations.hf\n"
    run = procs.run([sys.executable, "-c", code], cwd=REPO, timeout=480)
    assert run.returncode != 0
    assert "ImportError" in run.stderr and "found transformers 5.5.4" in run.stderr, run.stderr[-2000:]
    assert f"transformers >= {FLOOR}" in run.stderr, run.stderr[-2000:]


def test_only_the_compatibility_layer_reads_the_version():
    """Version differences live in ``compat.py``: no other module of the package looks at
    transformers' version number."""
    offenders = []
    for path in sorted((REPO / "mmbalance").rglob("*.py")):
        if path.name == "compat.py" and path.parent.name == "hf":
            continue
        text = path.read_text()
        for needle in ("transformers.__version__", "transformers_version(", "_since("):
            if needle in text:
                offenders.append(f"{path.relative_to(REPO)}: {needle}")
    assert not offenders, offenders


# ------------------------------------------------------------------------ encoder outputs
FEED_CASES = {
    "qwen2_vl": [[(4, 4), ("video", 2, 4, 4)]],
    "qwen3_vl": [[(4, 4), (2, 6)]],  # deepstack layers
    "qwen3_vl_video": [[("video", 2, 4, 4), (4, 4)]],  # deepstack, images and video together
    "qwen2_5_omni": [[(4, 4)]],  # the thinker's own form
    "llava": [[1, 1]],
}


@pytest.mark.parametrize("case", list(FEED_CASES))
def test_encoder_outputs_fed_to_the_forward_give_the_logits_of_their_pixels(case):
    name = case.removesuffix("_video")
    model = hf_zoo.build(name, seed=4).eval()
    batch = hf_zoo.batch(name, model, FEED_CASES[case], seed=5)
    batch.pop("labels")
    with torch.no_grad():
        want = model(**batch).logits
        owner = core(model)
        call = dict(batch)
        mm = {}
        for stream, (pixels, method) in (("image", ("pixel_values", "get_image_features")),
                                         ("video", ("pixel_values_videos", "get_video_features"))):  # fmt: skip
            if call.get(pixels) is None:
                continue
            extra = {"image_grid_thw": call.get("image_grid_thw")} if stream == "image" else {}
            if stream == "video":
                extra = {"video_grid_thw": call.get("video_grid_thw")}
            if name == "llava":
                extra = {}
            out = getattr(owner, method)(call.pop(pixels), **{k: v for k, v in extra.items() if v is not None},
                                         return_dict=True)  # fmt: skip
            mm[stream] = _per_item(out)
        call["mm_encoder_outputs"] = mm
        before = dict(owner.__dict__)
        with compat.feeding_encoder_outputs(model, call) as fed:
            got = model(**fed).logits
            fed_natively = "mm_encoder_outputs" in fed
        assert owner.__dict__.keys() == before.keys(), "the model keeps a method of the feeding"
    assert fed_natively == compat.takes_encoder_outputs(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _per_item(out):
    """An encoder output in the form ``mm_encoder_outputs`` takes (per-item ``pooler_output`` and
    deepstack layers), whatever form the installed release returned."""
    from mmbalance.integrations.hf.encoders import pooled

    pool = out.pooler_output
    items = tuple(pool) if isinstance(pool, (tuple, list)) else (pool,)
    deep = getattr(out, "deepstack_features", None)
    if deep is None:
        return pooled(items)
    return pooled(items, [tuple(layer) if isinstance(layer, (tuple, list)) else (layer,) for layer in deep])


def test_feeding_refuses_pixels_beside_their_features_and_unknown_streams():
    model = hf_zoo.build("qwen2_vl", seed=4)
    if compat.takes_encoder_outputs(model):
        pytest.skip("this transformers takes mm_encoder_outputs itself")
    batch = hf_zoo.batch("qwen2_vl", model, [[(4, 4)]], seed=5)
    feats = _per_item(
        core(model).get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True)
    )
    with pytest.raises(ValueError, match="pixel_values and mm_encoder_outputs"):
        with compat.feeding_encoder_outputs(model, {**batch, "mm_encoder_outputs": {"image": feats}}):
            pass
    with pytest.raises(ValueError, match=r"mm_encoder_outputs\['audio'\]"):
        with compat.feeding_encoder_outputs(
            model, {"input_ids": batch["input_ids"], "mm_encoder_outputs": {"audio": feats}}
        ):
            pass


# ------------------------------------------------------------------------------- the loss
def test_the_loss_gets_the_forwards_keywords():
    """Qwen3-VL's forward drops ``num_items_in_batch`` in some releases; with the keywords installed
    the loss is the token-loss sum over the given count on every release, and the last
    ``remove()`` of its users restores the model's loss function."""
    model = hf_zoo.build("qwen3_vl", seed=4)
    batch = hf_zoo.batch("qwen3_vl", model, [[(4, 4)]], seed=5)
    count = 3 * int((batch["labels"][0, 1:] != -100).sum())
    want = hf_zoo.summed_loss(model, batch, count)
    hook = compat.install_loss_keywords(model)
    assert compat.install_loss_keywords(model) is hook  # one per model (None where nothing is needed)
    got = model(**batch, num_items_in_batch=count).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if hook is not None:
        hook.remove()  # one of its two users is done: it stays on, and the count still reaches the loss
        assert "_loss_function" in model.__dict__ and model._forward_pre_hooks
        torch.testing.assert_close(model(**batch, num_items_in_batch=count).loss, want, rtol=1e-6, atol=1e-6)
        hook.remove()  # the last: the model's own loss function is back
    assert (
        "_loss_function" not in model.__dict__ and not model._forward_pre_hooks and not model._forward_hooks
    )
    llama = hf_zoo.build("llava", seed=4)  # its forward passes the keywords on every release
    assert compat.install_loss_keywords(llama) is None


def test_mask_pieces_name_every_kind_the_parser_reads():
    kinds = {kind for kind, _ in compat.mask_pieces().values()}
    assert {"causal", "bidirectional", "and", "or", "sliding", "chunked", "padding", "packed", "offsets",
            "blockwise"} <= kinds  # fmt: skip


def test_loader_options_are_the_fields_this_release_has():
    args = transformers.TrainingArguments(output_dir="unused", report_to=[])
    options = compat.loader_options(args)
    release = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert set(options) == ({"multiprocessing_context", "in_order"} if release >= (5, 15) else set()), options
    for key, value in options.items():
        assert value == getattr(args, f"dataloader_{key}")


def test_which_losses_take_the_steps_token_count():
    """A loss over a given count (Qwen2-VL, LLaVA, Qwen3-VL whose older forwards drop it but get it
    back through install_loss_keywords), or a mean over each call that ignores it (Qwen2-Audio;
    Gemma 3 before 5.17, which the source of the installed release shows)."""
    import inspect

    assert compat.loss_takes_token_count(hf_zoo.build("qwen2_vl", seed=4))
    assert compat.loss_takes_token_count(hf_zoo.build("qwen3_vl", seed=4))
    assert compat.loss_takes_token_count(hf_zoo.build("llava", seed=4))
    assert not compat.loss_takes_token_count(hf_zoo.build("qwen2_audio", seed=4))
    gemma3 = transformers.Gemma3ForConditionalGeneration
    averages = "nn.CrossEntropyLoss()" in inspect.getsource(gemma3.forward)
    assert compat.loss_takes_token_count(gemma3.__new__(gemma3)) is not averages


def _loss_calls(source: str) -> list[str]:
    """The argument lists of every ``self.loss_function(...)`` call in ``source``."""
    out, at = [], source.find("self.loss_function(")
    while at >= 0:
        i = at + len("self.loss_function")
        depth = 0
        for j in range(i, len(source)):
            depth += {"(": 1, ")": -1}.get(source[j], 0)
            if depth == 0:
                out.append(source[i + 1 : j])
                break
        at = source.find("self.loss_function(", at + 1)
    return out


@pytest.mark.parametrize("name", hf_zoo.MODELS)
def test_a_forward_that_drops_the_loss_keywords_gets_them_back(name):
    """Every family of the zoo whose installed forward calls its loss without the call's keywords
    (``num_items_in_batch``, ``shift_labels``) has them handed on by install_loss_keywords, or says
    that its loss is a mean over each call: read from the installed source, so a family or a
    release that drops them cannot slip through."""
    import inspect

    if not hf_zoo.available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    model = hf_zoo.build(name, seed=4)
    calls = _loss_calls(inspect.getsource(type(model).forward))
    drops = any("**kwargs" not in call for call in calls)
    hook = compat.install_loss_keywords(model)
    try:
        if drops:
            assert hook is not None or not compat.loss_takes_token_count(model), (name, calls)
        else:
            assert hook is None, name
    finally:
        if hook is not None:
            hook.remove()


# ------------------------------------------------------------------------------- wrappers
def test_the_model_inside_a_peft_model_and_the_hint_for_other_wrappers():
    peft = pytest.importorskip("peft")
    model = hf_zoo.build("qwen2_vl", seed=4)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert inner_model(lora) is model and inner_model(model) is model
    compiled = torch.compile(model)
    assert "model._orig_mod" in wrapper_hint(compiled)

    class Holder(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert "pass model.module" in wrapper_hint(Holder(model))
    assert wrapper_hint(model) == ""
