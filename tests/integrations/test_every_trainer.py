"""``balance_every_trainer`` and ``mmbalance launch``: trainers balanced without editing the program.

In one process: transformers' Trainer, TRL's SFTTrainer and a user's subclass built after the call
are balanced when they train (the balanced sampler, ``mmbalance/*`` keys in every log call), one
built before is not, and ``remove()`` restores plain behaviour. The command line: its help, a
missing PROGRAM (127, by name), a failing one (its status and traceback), the forms of PROGRAM.
On 2 ranks: a program that knows nothing of mmbalance, launched as ``mmbalance launch -- torchrun
--nproc-per-node 2 program.py`` (its workers balanced through the launch's ``sitecustomize``), ends
at the weights of the same program run plain under torchrun, its logs holding the balance; a
refused option (accelerate's ``split_batches``) fails on both ranks before the first step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.6")
pytest.importorskip("accelerate")

from mmbalance.integrations.hf import balance_every_trainer  # noqa: E402
from tests import procs  # noqa: E402
from tests.dist_utils import REPO  # noqa: E402

PROGRAM = Path(__file__).with_name("every_trainer_program.py")


def _tiny():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _rows(n=24):
    rng = np.random.default_rng(0)
    out = []
    for k in rng.integers(2, 30, size=n):
        ids = rng.integers(1, 64, size=int(k)).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    lab = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], lab[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": lab, "attention_mask": mask}


def _args(tmp, **extra):
    return transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=2, per_device_train_batch_size=2, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, **extra,
    )  # fmt: skip


def _keys(trainer) -> set[str]:
    return {k for row in trainer.state.log_history for k in row if k.startswith("mmbalance/")}


class UsersTrainer(transformers.Trainer):
    """A user's subclass with an ``__init__`` of its own."""

    def __init__(self, *args, note="mine", **kwargs):
        super().__init__(*args, **kwargs)
        self.note = note


def _tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(64)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2"
    )


def test_trainers_built_after_the_call_are_balanced_and_remove_restores(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    stock_init = transformers.Trainer.__init__
    before = transformers.Trainer(
        model=_tiny(), args=_args(tmp_path / "a"), train_dataset=_rows(), data_collator=_collate
    )
    handle = balance_every_trainer(encoders=False)
    try:
        with pytest.raises(ValueError, match="balance_every_trainer is on already"):
            balance_every_trainer()
        plain = transformers.Trainer(model=_tiny(), args=_args(tmp_path / "b"), train_dataset=_rows(),
                                     data_collator=_collate)  # fmt: skip
        users = UsersTrainer(
            model=_tiny(), args=_args(tmp_path / "c"), train_dataset=_rows(), data_collator=_collate
        )
        sft = SFTTrainer(
            model=_tiny(), processing_class=_tokenizer(),
            train_dataset=datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in _rows()]}),
            args=SFTConfig(output_dir=str(tmp_path / "d"), max_steps=2, per_device_train_batch_size=2,
                           logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                           disable_tqdm=True),
        )  # fmt: skip
        for trainer in (before, plain, users, sft):
            trainer.train()
        for trainer in (plain, users, sft):
            assert type(trainer.balanced_sampler).__name__ == "BalancedBatchSampler", type(trainer).__name__
            assert {"mmbalance/batches/cost_before", "mmbalance/batches/cost_after"} <= _keys(trainer)
            assert all(any(k.startswith("mmbalance/") for k in row) for row in trainer.state.log_history)
        assert users.note == "mine"
        assert not hasattr(before, "balanced_sampler") and not _keys(before)
        assert set(handle.trainers) == {plain, users, sft}
    finally:
        handle.remove()
    assert transformers.Trainer.__init__ is stock_init
    after = transformers.Trainer(
        model=_tiny(), args=_args(tmp_path / "e"), train_dataset=_rows(), data_collator=_collate
    )
    after.train()
    assert not hasattr(after, "balanced_sampler") and not _keys(after)
    handle.remove()  # idempotent


def test_a_refused_set_up_leaves_the_trainer_and_its_model_as_they_were(tmp_path):
    """A refusal at ``train()`` takes back what was changed before it: the attention switched to
    ``mmbalance_varlen``, the loss keywords (Qwen3-VL's forward drops them before 5.17), the
    trainer's ``model_accepts_loss_kwargs`` and the balanced sampler; the trainer is not counted.
    Two refusals: accelerate's ``split_batches`` (found before ``balance_trainer`` changes
    anything) and, with 24 examples in micro-batches of 2 and accumulation 5, a partial last step
    under context parallelism (found after it made its sampler)."""
    from tests.integrations import hf_zoo

    model = hf_zoo.build("qwen3_vl", seed=1)
    attention = model.config._attn_implementation
    for name, extra, match in (
        ("split", {"accelerator_config": {"split_batches": True}}, "split_batches=True"),
        ("partial", {"gradient_accumulation_steps": 5}, "ends each epoch with a partial step"),
    ):
        with balance_every_trainer(encoders=False, context_parallel=True, max_tokens_per_rank=64) as handle:
            trainer = transformers.Trainer(model=model, args=_args(tmp_path / name, **extra), train_dataset=_rows(),
                                           data_collator=_collate)  # fmt: skip
            trainer.model_accepts_loss_kwargs = False  # as LLaMA-Factory sets it for multimodal models
            with pytest.raises(ValueError, match=match):
                trainer.train()
            assert model.config._attn_implementation == attention, name
            assert "_loss_function" not in model.__dict__, name
            assert not model._forward_pre_hooks and not model._forward_hooks, name
            assert trainer.model_accepts_loss_kwargs is False, name
            assert not hasattr(trainer, "balanced_sampler") and trainer not in handle.trainers, name


def test_the_switch_with_context_parallelism_trains_on_the_trainers_draw(tmp_path):
    """``balance_every_trainer(context_parallel=True)`` (``mmbalance launch --context-parallel``) on
    a draw of whole steps: the trainer trains with the CP sampler and logs the CP keys."""
    with balance_every_trainer(encoders=False, context_parallel=True, max_tokens_per_rank=64):
        trainer = transformers.Trainer(model=_tiny(), args=_args(tmp_path, gradient_accumulation_steps=2),
                                       train_dataset=_rows(), data_collator=_collate)  # fmt: skip
        trainer.train()
    assert trainer.balanced_sampler.tail == [] and trainer.cp_sampler is not None
    assert trainer.state.global_step == 2
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    slots = trainer.cp_sampler.slots()
    for row in rows:  # logging_steps=1: each row is its step's slots' schedule
        step = slots[(row["step"] - 1) * 2 : row["step"] * 2]
        assert row["mmbalance/cp/max_degree"] == max(g.degree for _, lay in step for g in lay.schedule), row
        assert row["mmbalance/cp/groups"] == sum(len(lay.schedule) for _, lay in step) / 2, row
        assert "mmbalance/batches/plan_ms" in row


def test_bad_options_are_refused_by_name():
    with pytest.raises(TypeError, match="encoders must be a bool"):
        balance_every_trainer(encoders="yes")
    with pytest.raises(ValueError, match="context_parallel=True needs max_tokens_per_rank"):
        balance_every_trainer(context_parallel=True)
    with pytest.raises(ValueError, match="context_parallel=True needs batches=True"):
        balance_every_trainer(context_parallel=True, batches=False, max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be an int >= 1"):
        balance_every_trainer(max_tokens_per_rank=0)


# ----------------------------------------------------------------------------- the command
def _mmbalance(*args: str, cwd=REPO, env=None, timeout=300) -> subprocess.CompletedProcess:
    code = "import sys; from mmbalance.cli import main; sys.exit(main(sys.argv[1:]))"
    return procs.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, timeout=timeout)


def test_launch_help_and_the_exit_status_of_what_it_runs(tmp_path):
    done = _mmbalance("launch", "--help")
    assert done.returncode == 0
    for flag in ("--no-encoders", "--no-batches", "--token-mean-loss", "--context-parallel", "--max-tokens-per-rank",
                 "PROGRAM"):  # fmt: skip
        assert flag in done.stdout
    done = _mmbalance("launch", "--", "no-such-program-anywhere")
    assert done.returncode == 127 and "no-such-program-anywhere: no console script" in done.stderr
    done = _mmbalance("launch")
    assert done.returncode == 2 and "no PROGRAM" in done.stderr
    done = _mmbalance("launch", "--context-parallel", "--", "x.py")
    assert done.returncode == 2 and "--max-tokens-per-rank" in done.stderr
    done = _mmbalance("launch", "--token-mean-loss", "--", "x.py")
    assert done.returncode == 2 and "--token-mean-loss is for --no-batches runs" in done.stderr
    script = tmp_path / "prog.py"
    script.write_text(
        "import sys, os\nprint('ARGV', sys.argv[1:], os.environ['MMBALANCE_LAUNCH'])\nsys.exit(7)\n"
    )
    done = _mmbalance("launch", "--no-encoders", "--", str(script), "a", "b")
    assert done.returncode == 7 and "ARGV ['a', 'b']" in done.stdout, done.stderr
    assert '"encoders": false' in done.stdout
    (tmp_path / "failing.py").write_text("raise RuntimeError('the program failed')\n")
    done = _mmbalance("launch", "--", str(tmp_path / "failing.py"))
    assert done.returncode == 1 and "RuntimeError: the program failed" in done.stderr
    # as Python runs them: a script's folder, and for -m the current folder, first on the path
    (tmp_path / "helper_module.py").write_text("VALUE = 42\n")
    (tmp_path / "uses_sibling.py").write_text("import helper_module\nprint('SIBLING', helper_module.VALUE)\n")
    done = _mmbalance("launch", "--", str(tmp_path / "uses_sibling.py"))
    assert done.returncode == 0 and "SIBLING 42" in done.stdout, done.stderr
    (tmp_path / "mod_here.py").write_text("import sys\nprint('MODULE', sys.argv[1:])\n")
    done = _mmbalance("launch", "--", "-m", "mod_here", "x", cwd=tmp_path)
    assert done.returncode == 0 and "MODULE ['x']" in done.stdout, done.stderr


def _torchrun(tmp: Path, name: str, launch: bool, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / name
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMBALANCE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run = ["torchrun", "--standalone", "--nproc-per-node", "2", str(PROGRAM), str(out), *flags]
    cmd = ["launch", "--", *run] if launch else None
    if cmd is None:
        done = procs.run(
            [sys.executable, "-m", "torch.distributed.run", *run[1:]], cwd=REPO, env=env, timeout=600
        )
    else:
        done = _mmbalance(*cmd, env=env, timeout=600)
    return done, out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("examples", [16, 10], ids=["whole_steps", "a_partial_last_step"])
def test_a_program_launched_under_torchrun_ends_at_the_plain_runs_weights(tmp_path, examples):
    """16 examples: 2 whole steps an epoch; 10: accelerate gives every rank 3 micro-batches an
    epoch (the last padded with examples from the start), so an epoch ends with a step of one
    micro-batch, which the launched run trains as drawn."""
    flags = ("--examples", str(examples))
    # the plain reference skips the interpreter's teardown (--hard-exit: torch's gloo teardown bug can
    # abort a plain program there); the launched run must end with code 0 on its own
    plain, plain_out = _torchrun(tmp_path, "plain", False, *flags, "--hard-exit")
    assert plain.returncode == 0, plain.stderr[-4000:]
    bal, bal_out = _torchrun(tmp_path, "balanced", True, *flags)
    assert bal.returncode == 0, bal.stderr[-4000:]
    want, got = torch.load(plain_out / "weights.pt"), torch.load(bal_out / "weights.pt")
    from tests.integrations import hf_zoo

    start = hf_zoo.build("qwen2_vl", seed=1).state_dict()
    gap = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want) ** 0.5
    change = sum(float(((want[k] - start[k]).double() ** 2).sum()) for k in want) ** 0.5
    assert change > 0 and gap <= 1e-5 * change, (gap, change)
    rows = json.loads((bal_out / "log.json").read_text())
    plain_rows = json.loads((plain_out / "log.json").read_text())
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [r["step"] for r in plain_rows if "loss" in r], (
        "the same steps, logged at the same points"
    )
    keys = {k for row in rows for k in row if k.startswith("mmbalance/")}
    assert {"mmbalance/batches/cost_after", "mmbalance/vision/before", "mmbalance/vision/after"} <= keys, keys
    # every logged interval averages the plans of its steps (the sampler's stats of each epoch)
    planned = [st for epoch in json.loads((bal_out / "planned.json").read_text()) for st in epoch]
    assert len(planned) == steps[-1], "one planned entry for every step trained, none for a step not there"
    logged = [r for r in rows if "loss" in r]
    last = 0
    for row in logged:
        mine = planned[last : row["step"]]
        last = row["step"]
        for key, stat in (
            ("cost_before", "cost_before"),
            ("cost_after", "cost"),
            ("micro_after", "micro_cost"),
        ):
            want_value = sum(st[stat] for st in mine) / len(mine)
            assert row[f"mmbalance/batches/{key}"] == pytest.approx(want_value, rel=1e-9), (key, row, mine)
    vision = [
        (r["mmbalance/vision/before"], r["mmbalance/vision/after"])
        for r in rows
        if "mmbalance/vision/before" in r
    ]
    assert all(a <= b + 1e-9 for b, a in vision) and any(a < b for b, a in vision), vision
    assert not any(k.startswith("mmbalance/") for r in plain_rows for k in r)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_refused_option_fails_on_every_rank_before_the_first_step(tmp_path):
    done, _ = _torchrun(tmp_path, "refused", True, "--split-batches")
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert text.count("accelerate is set to split_batches=True") >= 2, text[-4000:]
    assert "'loss'" not in text
