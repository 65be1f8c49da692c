"""The one backend-selection rule (kernels/dispatch.py): forced, automatic, from the environment."""

from __future__ import annotations

import pytest

from mmbalance.kernels.dispatch import Backend, select_backend

FAST = Backend("fast", lambda x: [] if x > 0 else ["fast needs x > 0"])
SAFE = Backend("safe", lambda x: [])
ORDER = (FAST, SAFE)


def test_auto_takes_the_first_backend_that_can_run(monkeypatch):
    monkeypatch.delenv("OP_BACKEND", raising=False)
    assert select_backend("op", ORDER, None, 1, env="OP_BACKEND") == "fast"
    assert select_backend("op", ORDER, "auto", 0, env="OP_BACKEND") == "safe"


def test_a_forced_backend_that_cannot_run_says_why():
    assert select_backend("op", ORDER, "safe", 1) == "safe"
    with pytest.raises(ValueError, match=r"op: backend='fast' cannot run this call: fast needs x > 0"):
        select_backend("op", ORDER, "fast", 0)


def test_the_environment_forces_a_backend_like_the_argument(monkeypatch):
    monkeypatch.setenv("OP_BACKEND", "safe")
    assert select_backend("op", ORDER, None, 1, env="OP_BACKEND") == "safe"
    assert select_backend("op", ORDER, "fast", 1, env="OP_BACKEND") == "fast"  # the argument wins
    monkeypatch.setenv("OP_BACKEND", "fast")
    with pytest.raises(ValueError, match="OP_BACKEND=fast cannot run"):
        select_backend("op", ORDER, "auto", 0, env="OP_BACKEND")
    monkeypatch.setenv("OP_BACKEND", "quick")
    with pytest.raises(ValueError, match=r"OP_BACKEND must be one of \('auto', 'fast', 'safe'\)"):
        select_backend("op", ORDER, None, 1, env="OP_BACKEND")


def test_unknown_names_and_no_runnable_backend_are_errors():
    with pytest.raises(ValueError, match="impl must be one of"):
        select_backend("op", ORDER, "quick", 1, argument="impl")
    with pytest.raises(ValueError, match="no backend can run this call"):
        select_backend("op", (FAST,), None, 0)
