"""LLaMA-Factory 0.9.5 (``llamafactory-cli train``) balanced through ``mmbalance launch``, unedited.

A tiny Qwen2-VL, 24 examples with 0 to 3 small images and answers of 1 to 80 words, SFT on 2 CPU
ranks (``FORCE_TORCHRUN=1``: LLaMA-Factory starts torchrun itself, so its workers are balanced
through the launch's ``sitecustomize``), fp32, SGD, 4 steps of 2 examples x 2 ranks x 2
micro-batches, full and LoRA:

* the balanced run (encoders, batches) ends at the weights of the plain run normalized the same
  way (``--no-encoders --no-batches --token-mean-loss``: the loss over the step's global token count; LLaMA-Factory
  itself divides each micro-batch's mean), within 1e-5 of the change;
* its ``trainer_state.json`` holds the ``mmbalance/*`` keys, and they show balancing acting;
* ``disable_shuffling: true`` is refused on both ranks before the first step, by name;
* a tiny Qwen3.5 (a Gated DeltaNet layer beside full attention, LLaMA-Factory's ``qwen3_5``
  template) launched balanced, and with context parallelism (its longest sequences split, the
  layer's state handed across the cut), ends at the plain run's weights.
"""

from __future__ import annotations

import pytest

from tests.frameworks import runs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = """\
model_name_or_path: {model}
image_max_pixels: 3136
image_min_pixels: 784
disable_gradient_checkpointing: true
stage: sft
do_train: true
finetuning_type: {tuning}
{lora}
dataset_dir: {data}
dataset: tiny_vlm
template: qwen2_vl
cutoff_len: 512
overwrite_cache: true
preprocessing_num_workers: 1
dataloader_num_workers: 0
output_dir: {out}
logging_steps: 1
save_strategy: "no"
plot_loss: false
overwrite_output_dir: true
report_to: none
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 4
learning_rate: 0.1
lr_scheduler_type: constant
warmup_steps: 0
optim: sgd
seed: 42
bf16: false
fp16: false
use_cpu: true
ddp_backend: gloo
{extra}
"""
LORA = "lora_rank: 4\nlora_alpha: 8\nlora_dropout: 0.0\nlora_target: all"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env_dir = runs.venv("llamafactory")
    where = tmp_path_factory.mktemp("llamafactory")
    model, data = runs.make_model_and_data(env_dir, where)
    return env_dir, where, model, data


def _train(setup, name: str, tuning: str, launch: list[str] | None, extra: str = "", stage: str = "sft"):
    """One run; ``launch=None``: LLaMA-Factory alone, without ``mmbalance launch``."""
    env_dir, where, model, data = setup
    out = where / name
    cfg = where / f"{name}.yaml"
    text = CONFIG.format(model=model, tuning=tuning, lora=LORA if tuning == "lora" else "", data=data, out=out,
                         extra="")  # fmt: skip
    for line in extra.splitlines():  # a key of the config is set again in its place, a new one added
        key = line.split(":", 1)[0] + ":"
        lines = text.splitlines()
        at = [i for i, ln in enumerate(lines) if ln.startswith(key)]
        lines[at[0] if at else len(lines) :] = [line] + (lines[at[0] + 1 :] if at else [])
        text = "\n".join(lines) + "\n"
    if "qwen3_5" in str(model):  # Qwen3.5: its own template (Qwen3-VL's image plugin)
        text = text.replace("template: qwen2_vl", "template: qwen3_5")
    if "text_model" in str(model):  # the language model alone: Qwen2's template, no images
        text = text.replace("template: qwen2_vl", "template: qwen").replace("image_max_pixels: 3136\n", "")
        text = text.replace("image_min_pixels: 784\n", "")
    if stage != "sft":  # 2 steps: what a changed loss would change shows in the first
        dataset = "tiny_kto" if stage == "kto" else "tiny_pref"
        text = text.replace("stage: sft", f"stage: {stage}").replace(
            "dataset: tiny_vlm", f"dataset: {dataset}"
        )
        text = text.replace("max_steps: 4", "max_steps: 2")
    cfg.write_text(text)
    env = runs.environment(env_dir, FORCE_TORCHRUN="1", NNODES="1", NPROC_PER_NODE="2")
    cmd = ["llamafactory-cli", "train", str(cfg)]
    if launch is not None:
        cmd = [str(env_dir / "bin" / "mmbalance"), "launch", *launch, "--", *cmd]
    return runs.run(cmd, env, where, where / f"{name}.log"), out


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_launch_balances_and_ends_at_the_plain_runs_weights(setup, tuning):
    _, where, model, _ = setup
    plain, plain_out = _train(
        setup, f"plain_{tuning}", tuning, ["--no-encoders", "--no-batches", "--token-mean-loss"]
    )
    assert plain.returncode == 0, plain.stderr[-4000:]
    bal, bal_out = _train(setup, f"balanced_{tuning}", tuning, [])
    assert bal.returncode == 0, bal.stderr[-4000:]
    gap = runs.tuned_weights_gap(plain_out, bal_out, model, tuning)
    assert gap <= 1e-5, f"balanced weights {gap:.2e} of the change away from the plain run's"
    keys = runs.balance_keys(runs.log_rows(bal_out / "trainer_state.json"))
    runs.record(f"llamafactory {tuning}", gap, keys)
    for key in ("mmbalance/batches/cost_before", "mmbalance/batches/cost_after", "mmbalance/vision/moved"):
        assert key in keys, (key, sorted(keys))
    acted = max(keys["mmbalance/vision/moved"]) > 0 or runs.balanced_batches(keys)
    assert acted, keys
    assert not runs.balance_keys(runs.log_rows(plain_out / "trainer_state.json")).get(
        "mmbalance/batches/cost_after"
    )


def test_disable_shuffling_is_refused_on_every_rank_before_the_first_step(setup):
    done, out = _train(setup, "refused", "full", [], extra="disable_shuffling: true")
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert text.count("disable_shuffling: true trains in the dataset's order") >= 2, text[-4000:]
    assert "'loss'" not in text, "a step ran"


# ------------------------------------------------------------------ trainers the launch does not balance
# DPO, KTO and reward-model training average over their own micro-batches (pairs, examples): the
# launch balances DPO's pairs whole, in LLaMA-Factory's own number per micro-batch, and leaves
# KTO's and the reward model's batches as drawn; every loss stays as LLaMA-Factory has it. With clipping off
# (max_grad_norm: 0) a loss scaled differently shows in the weights as it is.
NO_CLIP = "max_grad_norm: 0.0\npref_beta: 0.1"


def _losses(out) -> list[float]:
    return [r["loss"] for r in runs.log_rows(out / "trainer_state.json") if "loss" in r]


def _weights_gap(want_out, got_out, model) -> float:
    return runs.tuned_weights_gap(want_out, got_out, model, "full")


@pytest.fixture(scope="module")
def text_setup(setup):
    """The same language model alone (KTO: LLaMA-Factory 0.9.5's KTO collator drops the
    mm_token_type_ids Qwen2-VL's M-RoPE needs, even for the fake image it adds to text batches)."""
    env_dir, where, _, data = setup
    model = where / "text_model"
    done = runs.run([str(env_dir / "bin" / "python"), str(runs.HERE / "tiny_qwen2vl.py"), str(model), "--text"],
                    runs.environment(env_dir), where, where / "tiny_text.log")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return env_dir, where, model, data


@pytest.mark.parametrize("stage", ["dpo", "kto", "rm"])
def test_preference_and_reward_trainers_keep_their_loss(setup, text_setup, stage):
    if stage == "kto":
        setup = text_setup
    _, _, model, _ = setup
    plain, plain_out = _train(setup, f"{stage}_plain", "full", None, NO_CLIP, stage)
    assert plain.returncode == 0, plain.stderr[-4000:]
    want = _losses(plain_out)
    assert len(want) == 2, want
    launches = {"none": ["--no-encoders", "--no-batches"], "all": []}  # all: encoders and pairs balanced
    for kind, flags in launches.items():
        if stage != "dpo" and kind != "none":  # DPO: both ways; KTO and reward models: nothing balanced
            continue
        done, out = _train(setup, f"{stage}_{kind}", "full", flags, NO_CLIP, stage)
        assert done.returncode == 0, done.stderr[-4000:]
        got = _losses(out)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (stage, kind, want, got)
        gap = _weights_gap(plain_out, out, model)
        assert gap <= 1e-5, f"{stage} launched {flags}: weights {gap:.2e} of the change from the plain run's"
        assert "batches are left as drawn" not in done.stdout + done.stderr
        if kind == "all":  # DPO's pairs balanced whole, in LLaMA-Factory's own number per micro-batch
            keys = {k for r in runs.log_rows(out / "trainer_state.json") for k in r}
            assert "mmbalance/batches/cost_after" in keys, sorted(keys)


# ------------------------------------------------------------------ context parallelism in its VLM SFT
CP_BATCHES = "per_device_train_batch_size: 1\ngradient_accumulation_steps: 4"
CP_BUDGET = 250  # tokens a rank may hold: the longest examples (up to about 300 tokens) are split


def test_context_parallel_sft_of_qwen2_vl_ends_at_the_plain_runs_weights(setup):
    """LLaMA-Factory's collator precomputes Qwen2-VL's M-RoPE deltas (``rope_deltas``): launched
    with ``--context-parallel``, the sequences longer than the budget are split over CP groups of
    2 (their images encoded by the group, the positions computed whole) and the run ends at the
    plain run's weights, the ``mmbalance/cp/*`` keys logged."""
    _, _, model, _ = setup
    plain, plain_out = _train(setup, "cp_plain", "full", ["--no-encoders", "--no-batches", "--token-mean-loss"],
                              CP_BATCHES)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-4000:]
    done, out = _train(setup, "cp", "full", ["--context-parallel", "--max-tokens-per-rank", str(CP_BUDGET)],
                       CP_BATCHES)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    gap = runs.tuned_weights_gap(plain_out, out, model, "full")
    assert gap <= 1e-5, f"context-parallel weights {gap:.2e} of the change away from the plain run's"
    keys = runs.balance_keys(runs.log_rows(out / "trainer_state.json"))
    runs.record("llamafactory context parallel", gap, keys)
    assert max(keys["mmbalance/cp/max_degree"]) >= 2, keys  # a sequence was split
    assert max(keys["mmbalance/cp/largest_shard"]) <= CP_BUDGET, keys


# ------------------------------------------------------------------ Qwen3.5: Gated DeltaNet layers
@pytest.fixture(scope="module")
def qwen3_5_setup(setup):
    """A tiny Qwen3.5 (``tiny_qwen3_5.py``) in the same environment, on the same dataset."""
    env_dir, where, _, data = setup
    model = where / "qwen3_5_model"
    done = runs.run([str(env_dir / "bin" / "python"), str(runs.HERE / "tiny_qwen3_5.py"), str(model)],
                    runs.environment(env_dir), where, where / "tiny_qwen3_5.log")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return env_dir, where, model, data


def test_qwen3_5_balanced_and_context_parallel_end_at_the_plain_runs_weights(qwen3_5_setup):
    """Qwen3.5 opts out of the step's token count (``accepts_loss_kwargs = False``): the launch
    hands it the loss keywords. Balanced (encoders and batches), and with ``--context-parallel``
    (sequences over the budget split over groups of 2, each Gated DeltaNet layer's conv window and
    state handed from one shard to the next), both end at the plain run's weights (1e-5 of the
    change)."""
    _, _, model, _ = qwen3_5_setup
    plain, plain_out = _train(qwen3_5_setup, "q35_plain", "full",
                              ["--no-encoders", "--no-batches", "--token-mean-loss"], CP_BATCHES)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-4000:]
    for name, flags in (
        ("balanced", []),
        ("cp", ["--context-parallel", "--max-tokens-per-rank", str(CP_BUDGET)]),
    ):
        done, out = _train(qwen3_5_setup, f"q35_{name}", "full", flags, CP_BATCHES)
        assert done.returncode == 0, done.stderr[-4000:]
        gap = runs.tuned_weights_gap(plain_out, out, model, "full")
        assert gap <= 1e-5, f"Qwen3.5 {name}: weights {gap:.2e} of the change away from the plain run's"
        keys = runs.balance_keys(runs.log_rows(out / "trainer_state.json"))
        runs.record(f"llamafactory qwen3.5 {name}", gap, keys)
        if name == "cp":
            assert max(keys["mmbalance/cp/max_degree"]) >= 2, keys  # a sequence was split
            assert max(keys["mmbalance/cp/largest_shard"]) <= CP_BUDGET, keys
        else:
            assert max(keys["mmbalance/vision/moved"]) > 0 or runs.balanced_batches(keys), keys
