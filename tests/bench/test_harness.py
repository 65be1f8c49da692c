"""``bench.harness``: the exit-code wording every multi-process runner (the package's and the tests') uses."""

from __future__ import annotations

import pytest

from mmbalance.bench.processes import describe_exit


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (-6, "was killed by SIGABRT"),
        (-9, "was killed by SIGKILL"),
        (-200, "was killed by signal 200"),
        (None, "did not exit"),
    ],
)
def test_describe_exit(code, words):
    assert describe_exit(code) == words
