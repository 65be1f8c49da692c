"""DPO balanced as whole pairs (``hf/loss.py``'s ``PAIR_MEAN_LOSSES``): TRL's ``DPOTrainer`` on 2
gloo ranks with ``balance_trainer(trainer)`` and no ``lengths``, 3 SGD steps of 8 pairs (2 per
micro-batch, 2 micro-batches), fp32, gradient clipping off (``preference_program.py``):

* every micro-batch holds the trainer's own 2 pairs, each pair's chosen row beside its rejected
  row (the rows the loss saw, matched to the pairs the collator makes alone), every pair once in
  the epoch;
* with the trainer's own draw (``order="trainer"``) the final weights are the plain run's (1e-5 of
  the change) and so is the logged loss; the ``mmbalance/batches/*`` keys are logged, no step's
  cost max/mean above the draw's and some below;
* on a tiny text model, and on a tiny Qwen2-VL whose pairs carry 0 to 3 images (lengths measured
  by the trainer's own collator, image tokens included);
* the DPO options that couple a micro-batch's pairs are refused by name.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mmbalance.integrations.hf import balance_trainer
from tests import procs

pytest.importorskip("trl")
pytest.importorskip("datasets")

pytestmark = [pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "integrations" / "preference_program.py"


def _run(out: Path, kind: str, mode: str) -> Path:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MMBALANCE_", "PREF_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PROGRAM),
           str(out), kind, mode]  # fmt: skip
    done = procs.run(cmd, cwd=REPO, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return out


def _gap(want: Path, got: Path, start: dict) -> float:
    a, b = torch.load(want / "weights.pt"), torch.load(got / "weights.pt")
    gap = sum(float(((b[k] - a[k]).double() ** 2).sum()) for k in a) ** 0.5
    change = sum(float(((a[k] - start[k]).double() ** 2).sum()) for k in a) ** 0.5
    assert change > 0
    return gap / change


def _check_pairs(out: Path, per_micro: int = 2, total: int = 24) -> None:
    """Every micro-batch: ``per_micro`` pairs, row i and row i + per_micro one pair; every pair once."""
    pairs = json.loads((out / "pairs.json").read_text())
    index = {(tuple(c), tuple(r)): i for i, (c, r) in enumerate(pairs)}
    assert len(index) == len(pairs) == total  # (the pairs are told apart by their rows)
    seen = []
    for rank in (0, 1):
        for rows in json.loads((out / f"rows.{rank}.json").read_text()):
            assert len(rows) == 2 * per_micro, [len(r) for r in rows]
            for i in range(per_micro):
                key = (tuple(rows[i]), tuple(rows[i + per_micro]))
                assert key in index, "a chosen row beside a rejected row of another pair"
                seen.append(index[key])
    assert sorted(seen) == list(range(total)), sorted(seen)


def _balance_keys(out: Path) -> list[tuple[float, float]]:
    rows = [r for r in json.loads((out / "log.json").read_text()) if "loss" in r]
    assert len(rows) == 3
    got = [(r["mmbalance/batches/cost_before"], r["mmbalance/batches/cost_after"]) for r in rows]
    assert all(after <= before + 1e-12 for before, after in got), got
    assert any(after < before - 1e-3 for before, after in got), got
    return got


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads((out / "log.json").read_text()) if "loss" in r]


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo_text")
    return {mode: _run(tmp / mode, "text", mode) for mode in ("plain", "trainer", "sampler")}


@pytest.mark.slow
def test_dpo_pairs_balanced_whole_to_the_plain_runs_weights(text_runs):
    sys.path.insert(0, str(PROGRAM.parent))
    import preference_program

    start = preference_program.text_parts()[0]().state_dict()
    assert _gap(text_runs["plain"], text_runs["trainer"], start) <= 1e-5
    assert _losses(text_runs["trainer"]) == pytest.approx(_losses(text_runs["plain"]), rel=1e-5)
    for mode in ("plain", "trainer", "sampler"):
        _check_pairs(text_runs[mode])
    _balance_keys(text_runs["trainer"])
    _balance_keys(text_runs["sampler"])  # the balanced sampler's own draw: every pair once too


@pytest.mark.slow
def test_dpo_of_a_vision_language_model_with_images(tmp_path):
    plain = _run(tmp_path / "plain", "vlm", "plain")
    balanced = _run(tmp_path / "trainer", "vlm", "trainer")
    sys.path.insert(0, str(PROGRAM.parent))
    import preference_program

    start = preference_program.vlm_parts()[0]().state_dict()
    assert _gap(plain, balanced, start) <= 1e-5
    assert _losses(balanced) == pytest.approx(_losses(plain), rel=1e-5)
    _check_pairs(balanced)
    _balance_keys(balanced)


@pytest.mark.parametrize("loss_type", ["aot", "sft"])
def test_options_that_couple_the_pairs_are_refused_by_name(tmp_path, loss_type):
    sys.path.insert(0, str(PROGRAM.parent))
    import preference_program
    from trl import DPOConfig, DPOTrainer

    model, tok, data = preference_program.text_parts()
    args = DPOConfig(output_dir=str(tmp_path), loss_type=[loss_type], **preference_program.COMMON)
    trainer = DPOTrainer(
        model=model(), ref_model=model(), args=args, train_dataset=data, processing_class=tok
    )
    loader = trainer.get_train_dataloader
    with pytest.raises(ValueError, match=rf"DPOTrainer's loss_type '{loss_type}'"):
        balance_trainer(trainer)
    assert trainer.get_train_dataloader == loader and not hasattr(trainer, "balanced_sampler")


def test_dpo_keeps_its_normalization_and_refuses_what_splits_pairs(tmp_path):
    sys.path.insert(0, str(PROGRAM.parent))
    import preference_program

    from mmbalance.integrations.hf import balance_every_trainer
    from mmbalance.integrations.hf import loss as L

    trainer = preference_program.build("text", str(tmp_path / "a"))
    assert L.loss_unit(trainer) == "pairs" and L.regrouping_changes_loss(trainer, trainer.model) is None
    accepts = trainer.model_accepts_loss_kwargs
    with pytest.raises(
        ValueError, match="DPOTrainer trains preference pairs.*context_parallel does not split"
    ):
        balance_trainer(trainer, context_parallel=True, max_tokens_per_rank=64)
    balance_trainer(trainer)
    assert trainer.model_accepts_loss_kwargs == accepts  # a pair mean: no token-count switch
    assert trainer.balanced_sampler.equal_counts and trainer.balanced_sampler.padding
    # the reference of a balanced run (--no-batches --token-mean-loss) switches nothing for it either
    with balance_every_trainer(encoders=False, batches=False, token_mean_loss=True):
        ref = preference_program.build("text", str(tmp_path / "b"))
        ref.args.max_steps = 1
        ref.train()
        assert ref.model_accepts_loss_kwargs == accepts and not hasattr(ref, "balanced_sampler")


def test_grpo_is_refused_by_name(tmp_path):
    sys.path.insert(0, str(PROGRAM.parent))
    import loss_kept_program

    trainer = loss_kept_program.run("grpo", str(tmp_path))
    loader = trainer.get_train_dataloader
    with pytest.raises(
        ValueError, match=r"balance_trainer: GRPOTrainer's loss \(.*GRPOTrainer.compute_loss\)"
    ):
        balance_trainer(trainer, lengths=[4] * len(trainer.train_dataset))
    assert trainer.get_train_dataloader == loader and not hasattr(trainer, "balanced_sampler")
