"""The one backend-selection rule (kernels/dispatch.py): forced, automatic, from the environment."""

from __future__ import annotations

import pytest
import torch

from mmbalance.kernels.dispatch import Backend, describe_inputs, select_backend

FAST = Backend("fast", lambda x: [] if x > 0 else ["fast needs x > 0"])
SAFE = Backend("safe", lambda x: [])
ORDER = (FAST, SAFE)


def test_auto_takes_the_first_backend_that_can_run(monkeypatch):
    monkeypatch.delenv("OP_BACKEND", raising=False)
    assert select_backend("op", ORDER, None, 1, env="OP_BACKEND") == "fast"
    assert select_backend("op", ORDER, "auto", 0, env="OP_BACKEND") == "safe"


def test_a_preference_reorders_auto_only(monkeypatch):
    monkeypatch.delenv("OP_BACKEND", raising=False)
    prefer = lambda x: ("safe", "unknown")  # names it does not know are ignored
    assert select_backend("op", ORDER, None, 1, prefer=prefer) == "safe"
    assert select_backend("op", ORDER, "fast", 1, prefer=prefer) == "fast"  # a forced choice holds
    # a preferred backend that cannot run gives way to the next that can, in the op's order
    slow = Backend("slow", lambda x: [])
    assert select_backend("op", (SAFE, FAST, slow), None, 0, prefer=lambda x: ("fast",)) == "safe"
    assert select_backend("op", (slow, FAST, SAFE), None, 0, prefer=lambda x: ("fast", "safe")) == "safe"
    with pytest.raises(ValueError) as err:  # the refusal still lists every backend
        select_backend("op", (FAST,), None, 0, prefer=lambda x: ("fast",))
    assert "`fast` cannot run it because:" in str(err.value)


def test_a_forced_backend_that_cannot_run_says_why():
    assert select_backend("op", ORDER, "safe", 1) == "safe"
    with pytest.raises(ValueError) as err:
        select_backend("op", ORDER, "fast", 0)
    assert str(err.value).splitlines() == [
        "op: backend='fast' cannot run this call with inputs:",
        "    0",
        "`fast` cannot run it because:",
        "    fast needs x > 0",
    ]


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


def test_no_runnable_backend_lists_every_backend_with_its_reasons():
    picky = Backend("picky", lambda x: ["picky wants a string", f"picky got {type(x).__name__}"])
    with pytest.raises(ValueError) as err:
        select_backend("op", (FAST, picky), "auto", -2)
    assert str(err.value).splitlines() == [
        "op: no backend can run this call with inputs:",
        "    -2",
        "`fast` cannot run it because:",
        "    fast needs x > 0",
        "`picky` cannot run it because:",
        "    picky wants a string",
        "    picky got int",
    ]


def test_a_tensor_is_described_by_shape_dtype_and_device_not_values():
    t = torch.full((2, 3), 7.0)
    assert describe_inputs(t) == "a torch.float32 tensor of shape (2, 3) on cpu"
    never = Backend("never", lambda t: ["no"])
    with pytest.raises(ValueError, match=r"a torch.float32 tensor of shape \(2, 3\) on cpu") as err:
        select_backend("op", (never,), None, t)
    assert "7." not in str(err.value)


def test_kernels_launch_raw_eagerly_and_wrapped_only_while_compile_traces(monkeypatch):
    # the wrapper's eager path costs about 0.25 ms of host time per launch (measured on an H200), so
    # it is used only where torch.compile needs it
    from mmbalance.kernels import _launch

    if not hasattr(torch.library, "wrap_triton"):
        pytest.skip("this torch has no torch.library.wrap_triton")
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros((BLOCK,), dtype=tl.float32))

    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert _launch.launchable(kernel) is kernel
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _launch.launchable(kernel) is not kernel
    monkeypatch.setattr(_launch, "INTERPRET", True)
    assert _launch.launchable(kernel) is kernel  # the interpreter runs the raw function
