"""The framework runs' measurements (weights gaps, logged balance) at the end of the session."""

from __future__ import annotations

from tests.frameworks import runs


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if runs.MEASURED:
        terminalreporter.section("mmbalance launch in the frameworks, measured")
        for line in runs.MEASURED:
            terminalreporter.write_line(line)
