"""ms-swift 4.6.0 (``swift sft``) balanced through ``mmbalance launch``, unedited.

The tiny Qwen2-VL and dataset of ``test_llamafactory.py``, SFT on 2 CPU ranks
(``NPROC_PER_NODE=2``: swift trains in a child process under torchrun, so the workers are
balanced through the launch's ``sitecustomize``), fp32, SGD, 4 steps of 2 examples x 2 ranks x 2
micro-batches, full and LoRA:

* the balanced run ends at the weights of the plain run normalized the same way
  (``--no-encoders --no-batches --token-mean-loss``), within 1e-5 of the change; ms-swift's own loss is already the
  step's token sum over its global count, so the plain run is ms-swift's as it is;
* its ``logging.jsonl`` holds the ``mmbalance/*`` keys of the batches, which show balancing
  acting; the encoders stay as ms-swift runs them (its template encodes the images in a forward
  pre-hook of its own), and the run says so in one warning;
* accelerate's ``split_batches`` is refused on both ranks before the first step, by name.
"""

from __future__ import annotations

import json

import pytest

from tests.frameworks import runs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env_dir = runs.venv("swift")
    where = tmp_path_factory.mktemp("swift")
    model, data = runs.make_model_and_data(env_dir, where)
    return env_dir, where, model, data


def _sft(setup, name: str, tuning: str, launch: list[str] | None, extra: list[str] = (), dpo: bool = False):
    """One run (``swift sft``, or ``swift rlhf --rlhf_type dpo``); ``launch=None``: ms-swift alone."""
    env_dir, where, model, data = setup
    out = where / name
    args = [
        "--model", str(model), "--model_type", "qwen2_vl", "--template", "qwen2_vl",
        "--dataset", str(data / "swift_vlm.jsonl"), "--split_dataset_ratio", "0", "--dataset_num_proc", "1",
        "--load_from_cache_file", "false", "--max_length", "512", "--tuner_type", tuning,
        "--torch_dtype", "float32", "--fp16", "false", "--bf16", "false", "--gradient_checkpointing", "false",
        "--vit_gradient_checkpointing", "false", "--output_dir", str(out), "--add_version", "false",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "4",
        "--learning_rate", "0.1", "--lr_scheduler_type", "constant", "--warmup_ratio", "0", "--optim", "sgd",
        "--weight_decay", "0", "--seed", "42", "--data_seed", "42", "--logging_steps", "1",
        "--save_strategy", "steps", "--save_steps", "1000", "--save_only_model", "true", "--report_to", "none",
        "--dataloader_num_workers", "0", "--use_cpu", "true", "--check_model", "false", "--ddp_backend", "gloo",
    ]  # fmt: skip
    if tuning == "lora":
        args += [
            "--lora_rank",
            "4",
            "--lora_alpha",
            "8",
            "--lora_dropout",
            "0",
            "--target_modules",
            "all-linear",
        ]
    if dpo:  # the preference pairs, 2 steps, gradient clipping off
        args[args.index(str(data / "swift_vlm.jsonl"))] = str(data / "swift_pref.jsonl")
        args[args.index("--max_steps") + 1] = "2"
        args += ["--rlhf_type", "dpo", "--beta", "0.1", "--max_grad_norm", "0"]
    env = runs.environment(env_dir, NPROC_PER_NODE="2", MIN_PIXELS="784", MAX_PIXELS="3136")
    cmd = ["swift", "rlhf" if dpo else "sft", *args, *extra]
    if launch is not None:
        cmd = [str(env_dir / "bin" / "mmbalance"), "launch", *launch, "--", *cmd]
    return runs.run(cmd, env, where, where / f"{name}.log"), out


def _checkpoint(out):
    found = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert found, f"no checkpoint in {out}"
    return found[-1]


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_launch_balances_and_ends_at_the_plain_runs_weights(setup, tuning):
    _, _, model, _ = setup
    plain, plain_out = _sft(
        setup, f"plain_{tuning}", tuning, ["--no-encoders", "--no-batches", "--token-mean-loss"]
    )
    assert plain.returncode == 0, plain.stderr[-4000:]
    bal, bal_out = _sft(setup, f"balanced_{tuning}", tuning, [])
    assert bal.returncode == 0, bal.stderr[-4000:]
    gap = runs.tuned_weights_gap(_checkpoint(plain_out), _checkpoint(bal_out), model, tuning)
    assert gap <= 1e-5, f"balanced weights {gap:.2e} of the change away from the plain run's"
    keys = runs.balance_keys(runs.log_rows(bal_out / "logging.jsonl"))
    runs.record(f"swift {tuning}", gap, keys)
    for key in ("mmbalance/batches/cost_before", "mmbalance/batches/cost_after"):
        assert key in keys, (key, sorted(keys))
    assert runs.balanced_batches(keys), keys
    assert "ms-swift's template encodes the images" in bal.stdout + bal.stderr


def test_split_batches_is_refused_on_every_rank_before_the_first_step(setup):
    extra = ["--accelerator_config", json.dumps({"split_batches": True})]
    done, _ = _sft(setup, "refused", "full", [], extra)
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert text.count("accelerate is set to split_batches=True") >= 2, text[-4000:]
    assert "'loss'" not in text, "a step ran"


def test_dpo_pairs_balanced_to_the_plain_runs_weights(setup):
    """ms-swift's DPO trainer averages over its own pairs: launched, its pairs are balanced whole
    in micro-batches of its own number of pairs, so it ends at the plain run's losses and weights
    (clipping off) with the balance keys logged; with ``--no-batches`` the warning says the
    batches are left as drawn and never that they are balanced."""
    _, _, model, _ = setup
    plain, plain_out = _sft(setup, "dpo_plain", "full", None, dpo=True)
    assert plain.returncode == 0, plain.stderr[-4000:]
    want = [r["loss"] for r in runs.log_rows(plain_out / "logging.jsonl") if "loss" in r]
    assert len(want) == 2, want
    for kind, flags in (("encoders", ["--no-batches"]), ("all", [])):
        done, out = _sft(setup, f"dpo_{kind}", "full", flags, dpo=True)
        assert done.returncode == 0, done.stderr[-4000:]
        rows = runs.log_rows(out / "logging.jsonl")
        got = [r["loss"] for r in rows if "loss" in r]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (kind, want, got)
        gap = runs.tuned_weights_gap(_checkpoint(plain_out), _checkpoint(out), model, "full")
        assert gap <= 1e-5, f"dpo launched {flags}: weights {gap:.2e} of the change from the plain run's"
        text = done.stdout + done.stderr
        line = next((ln for ln in text.splitlines() if "mmbalance:" in ln and "DPOTrainer" in ln), "")
        if kind == "encoders":  # the encoders note, and the batches left by the option, in one warning
            assert "batches are balanced" not in text and "(batches are)" not in text
            assert "batches are left as drawn (--no-batches)" in line, text[-4000:]
        else:
            assert "batches are left as drawn" not in line, line
            assert "mmbalance/batches/cost_after" in {k for r in rows for k in r}, rows[:2]
