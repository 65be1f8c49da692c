"""``mmbalance launch`` changes no loss it does not balance (``hf/loss.py``).

``loss_kept_program.py`` trains transformers' ``Trainer``, TRL's ``SFTTrainer``, ``DPOTrainer`` and
``GRPOTrainer`` on 2 CPU ranks with gradient clipping off, plain and through ``mmbalance launch``:

* ``--no-encoders --no-batches``: nothing is balanced, so every trainer's logged loss at every step
  and its final weights are the plain run's (1e-5 of the change);
* the defaults: GRPO (whose loss is a mean over its own micro-batches) keeps its batches and its
  loss, with a warning that names the trainer class and says the batches are left as drawn; DPO
  is balanced as whole pairs in micro-batches of its own number of pairs (its loss a mean over
  them); both end at the plain run's weights. The two SFT trainers are balanced (their loss over
  the step's global token count).

The LLaMA-Factory and ms-swift trainers are checked the same way in ``tests/frameworks``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests import procs

pytest.importorskip("trl")
pytest.importorskip("datasets")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "integrations" / "loss_kept_program.py"
NAMES = ("trainer", "sft", "dpo", "grpo")


def _run(tmp: Path, name: str, launch: list[str] | None):
    out = tmp / name
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMBALANCE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    run = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PROGRAM), str(out)]
    if launch is None:
        cmd = [sys.executable, *run]
    else:
        cmd = [sys.executable, "-m", "mmbalance.cli", "launch", *launch, "--", *run]
    done = procs.run(cmd, cwd=REPO, env=env, timeout=840)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return done, out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("plain"), "plain", None)[1]


def _losses(out: Path, name: str) -> list[float]:
    return [r["loss"] for r in json.loads((out / f"{name}.json").read_text()) if "loss" in r]


def _gap(want_dir: Path, got_dir: Path, name: str) -> float:
    """The weights' distance over the plain run's change from the start."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("loss_kept_program", PROGRAM)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    start = program.model().state_dict()
    want, got = torch.load(want_dir / f"{name}.pt"), torch.load(got_dir / f"{name}.pt")
    gap = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want) ** 0.5
    change = sum(float(((want[k] - start[k]).double() ** 2).sum()) for k in want) ** 0.5
    assert change > 0, f"{name}: the plain run did not change the weights"
    return gap / change


def test_nothing_balanced_is_the_plain_run(plain, tmp_path):
    done, out = _run(tmp_path, "unbalanced", ["--no-encoders", "--no-batches"])
    for name in NAMES:
        want, got = _losses(plain, name), _losses(out, name)
        assert len(want) == 3 and got == pytest.approx(want, rel=1e-6, abs=1e-7), (name, want, got)
        assert _gap(plain, out, name) <= 1e-5, name
    assert "batches are left as drawn" not in done.stderr  # nothing was asked of them


def test_balancing_keeps_preference_and_rl_losses(plain, tmp_path):
    done, out = _run(tmp_path, "balanced", [])
    for name in ("dpo", "grpo"):
        want, got = _losses(plain, name), _losses(out, name)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), (name, want, got)
        assert _gap(plain, out, name) <= 1e-5, name
    # GRPO's batches are left as drawn, said once; DPO's pairs are balanced (the same pairs per
    # step, in micro-batches of its own number of pairs), so it says nothing
    line = next((ln for ln in done.stderr.splitlines() if "mmbalance: GRPOTrainer:" in ln), "")
    assert "batches are left as drawn" in line and "GRPOTrainer's loss" in line, done.stderr[-4000:]
    assert "mmbalance: DPOTrainer:" not in done.stderr, done.stderr[-4000:]
    # the SFT trainers and DPO were balanced: the balance keys are in their logs
    for name in ("trainer", "sft", "dpo"):
        keys = {k for row in json.loads((out / f"{name}.json").read_text()) for k in row}
        assert "mmbalance/batches/cost_after" in keys, (name, sorted(keys))
    rows = [r for r in json.loads((out / "dpo.json").read_text()) if "mmbalance/batches/cost_after" in r]
    assert all(
        r["mmbalance/batches/cost_after"] <= r["mmbalance/batches/cost_before"] + 1e-12 for r in rows
    ), rows
