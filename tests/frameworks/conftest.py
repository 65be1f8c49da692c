"""The framework runs' measurements (weights gaps, logged balance) at the end of the session, and
the runs ``.ci/run`` leaves to ``make test-frameworks``.

``make test-frameworks`` runs every test here. ``.ci/run`` runs them with ``-m "not extended"``
(CI has a time limit and these runs take a minute each on 2 CPU cores): it keeps, in both
frameworks, full SFT balanced against the plain run, the refused option, and DPO launched each way
against the plain run; the LoRA runs and LLaMA-Factory's KTO and reward-model trainers, which take
the same paths (peft's model inside, a trainer whose loss is left alone), are marked ``extended``.
"""

from __future__ import annotations

import pytest

from tests.frameworks import runs

EXTENDED = ("[lora]", "[kto]", "[rm]")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.endswith(EXTENDED):
            item.add_marker(pytest.mark.extended)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if runs.MEASURED:
        terminalreporter.section("mmbalance launch in the frameworks, measured")
        for line in runs.MEASURED:
            terminalreporter.write_line(line)
