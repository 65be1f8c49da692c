"""``mmbalance bench hf --device``: one training step, ``mmbalance_varlen`` packed against ``sdpa``
padded (and ``flash_attention_2`` where installed), on the CPU's tiny model."""

from __future__ import annotations

import json

import pytest

from mmbalance import cli
from mmbalance.bench.harness import draw_lengths
from mmbalance.bench.hf import train_step

pytest.importorskip("transformers", minversion="5.6")


def test_lengths_come_from_the_shipped_mixture_within_the_step():
    lengths = draw_lengths(16384, 4096, seed=0)
    assert sum(lengths) <= 16384 and max(lengths) <= 4096 and min(lengths) >= 8 and len(lengths) > 2
    assert draw_lengths(16384, 4096, seed=0) == lengths  # the same examples for every provider
    assert draw_lengths(100, 4096, seed=3) and sum(draw_lengths(100, 4096, seed=3)) <= 100


@pytest.mark.slow
def test_the_step_through_the_command_line(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert cli.main(["bench", "hf", "--device", "cpu", "--quick", "--json", str(out)]) == 0
    rows = {
        r["provider"]: r for r in map(json.loads, out.read_text().splitlines()) if r["op"] == "hf_train_step"
    }
    assert set(rows) == set(train_step.PROVIDERS)
    ours, sdpa = rows["mmbalance_varlen"], rows["sdpa"]
    assert rows["flash_attention_2"]["skipped"] == "flash_attention_2 needs CUDA"
    for r in (ours, sdpa):
        assert r["time_ms"] > 0 and r["tokens_per_s"] > 0 and r["tokens"] <= 1024
    # the same examples from the same weights: the first step's loss agrees (float32)
    assert ours["loss"] == pytest.approx(sdpa["loss"], rel=1e-5)
    assert ours["vs_sdpa"] == pytest.approx(sdpa["time_ms"] / ours["time_ms"])
    assert ours["attention_backend"] == "reference" and sdpa["padded_tokens"] >= sdpa["tokens"]


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit, match="--tokens"):
        hf_step_main(["--device", "cpu", "--tokens", "0"])


def hf_step_main(argv):
    from mmbalance.bench import hf

    return hf.main(argv)
