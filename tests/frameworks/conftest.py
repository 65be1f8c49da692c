"""The framework runs' measurements (weights gaps, logged balance) at the end of the session, and
the runs ``.ci/run`` leaves to ``make test-frameworks``.

``make test-frameworks`` runs every test here. ``.ci/run`` runs them with ``-m "not extended"``
(CI has a time limit and these runs take a minute each on 2 CPU cores): it keeps, in both
frameworks, full SFT balanced against the plain run and DPO launched each way against the plain
run; the LoRA runs, LLaMA-Factory's KTO and reward-model trainers, which take the same paths
(peft's model inside, a trainer whose loss is left alone), and the options refused before the first
step (refused on every rank as in tests/integrations' launch tests) are marked ``extended``.
"""

from __future__ import annotations

import pytest

from tests.frameworks import runs

EXTENDED = (
    "[lora]",
    "[kto]",
    "[rm]",
    "::test_disable_shuffling_is_refused_on_every_rank_before_the_first_step",
    "::test_split_batches_is_refused_on_every_rank_before_the_first_step",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.endswith(EXTENDED):
            item.add_marker(pytest.mark.extended)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if runs.MEASURED:
        terminalreporter.section("mmbalance launch in the frameworks, measured")
        for line in runs.MEASURED:
            terminalreporter.write_line(line)
