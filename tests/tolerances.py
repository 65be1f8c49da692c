"""One tolerance table for every numerical test.

Float results are compared against float64 references computed on CPU. For low precision the rule
is the one flash-attention uses: our error vs the float64 reference may be at most ``LOWP_FACTOR``
times PyTorch's own error in the same dtype, plus a small atol.
"""

from __future__ import annotations

import torch

# (atol, rtol) for results that are a pure function of the inputs in that dtype
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1.3e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

LOWP_FACTOR = 2.0


def tol(dtype: torch.dtype, reduction: int = 1) -> dict[str, float]:
    """``atol``/``rtol`` for ``dtype``; atol grows with the square root of the reduction length."""
    atol, rtol = TOL[dtype]
    return {"atol": atol * max(1.0, reduction**0.5), "rtol": rtol}


def assert_close_lowp(out: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor, atol: float = 1e-5):
    """The "2x PyTorch's own error" rule: ``|out-ref| <= 2*|torch_out-ref| + atol`` in max norm."""
    ours = (out.double() - ref64).abs().max().item() if out.numel() else 0.0
    theirs = (torch_out.double() - ref64).abs().max().item() if out.numel() else 0.0
    assert ours <= LOWP_FACTOR * theirs + atol, (
        f"error {ours:.3e} > {LOWP_FACTOR} x torch error {theirs:.3e} + {atol}"
    )


def worst_rel(a: dict, b: dict, floor: float = 0.0) -> float:
    """The largest relative difference ``|a[k] - b[k]| / |b[k]|`` over the tensors of ``b`` (two
    state dicts, say). With ``floor``, a denominator is at least ``floor`` times the largest norm
    of ``b``: tensors that are zero up to rounding (attention key biases, which softmax ignores, so
    their gradients are rounding noise) do not count as relative errors of order one."""
    least = floor * max((float(t.norm()) for t in b.values()), default=0.0)
    return max(float((a[k] - b[k]).norm()) / max(float(b[k].norm()), least, 1e-30) for k in b)
