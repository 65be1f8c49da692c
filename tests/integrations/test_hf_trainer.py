"""transformers' Trainer with ``apply_encoder_balance`` on 2 CPU ranks (as torchrun starts them):
default arguments (``remove_unused_columns=True``: the forward's signature must be the model's)
and gradient checkpointing (Trainer scales the loss in place); the losses and the trained weights
equal those of the same training without the handle, and every process exits with code 0."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.6")
pytest.importorskip("accelerate")

from tests.dist_utils import launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_trainer_trains_the_same_with_the_handle():
    with tempfile.TemporaryDirectory() as tmp:
        out = launch(
            Path(__file__).with_name("trainer_encoder_balance.py"), nproc=2, timeout=600, env={"MMB_TMP": tmp}
        )
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    runs = json.loads(line[len("RESULT ") :])
    for mode in ("plain", "ckpt"):
        balanced, stock = runs[f"{mode}-balanced"], runs[f"{mode}-stock"]
        assert len(balanced["losses"]) == 4
        assert balanced["losses"] == pytest.approx(stock["losses"], rel=1e-5), mode
        assert balanced["weights"] == pytest.approx(stock["weights"], rel=1e-6), mode
        assert balanced["stats"]["after"] <= balanced["stats"]["before"]
