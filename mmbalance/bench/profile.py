"""Profiler: time a user's torch module over a sweep of sequence lengths (DHP section 5 (3)).

The measurements feed :meth:`mmbalance.balancing.CostModel.fit`, which fits the cost model the
planners use and reports its error::

    from mmbalance.balancing import CostModel
    from mmbalance.bench.profile import profile
    meas = profile(layer, lengths=(512, 1024, 2048, 4096, 8192), hidden_size=4096)
    model = CostModel.fit(meas)          # model.fit_report: mean / max relative error

It runs torch and measures, so it lives with the benchmarks' timing and not in the torch-free
``mmbalance.balancing``; it talks to no other rank. One process measures CP degree 1 only; the ring
terms (``CostModel.ring``, ``ring_latency``) come from timings of ring attention in a distributed
run (pass them as ``(lengths, degree, seconds)`` measurements too) or from the link bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from mmbalance.balancing.cost_model import Measurement


def _hidden_size(module) -> int | None:
    for name in ("hidden_size", "embed_dim", "d_model"):
        v = getattr(module, name, None) or getattr(getattr(module, "config", None), name, None)
        if isinstance(v, int):
            return v
    for m in getattr(module, "modules", lambda: [])():
        if isinstance(m, torch.nn.Linear):
            return m.in_features
    return None


def _device_dtype(module, device, dtype):
    p = next(iter(getattr(module, "parameters", lambda: iter(()))()), None)
    dev = torch.device(device) if device is not None else (p.device if p is not None else torch.device("cpu"))
    dt = (
        dtype
        if dtype is not None
        else (p.dtype if p is not None and p.is_floating_point() else torch.float32)
    )
    return dev, dt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(
    module: Callable,
    lengths: Iterable[int] = (128, 256, 512, 1024, 2048, 4096),
    *,
    groups: Iterable[Sequence[int]] = (),
    make_inputs: Callable[[tuple[int, ...]], object] | None = None,
    hidden_size: int | None = None,
    backward: bool = True,
    warmup: int = 2,
    repeats: int = 5,
    device=None,
    dtype: torch.dtype | None = None,
) -> list[Measurement]:
    """Median time of ``module`` (forward, and backward if ``backward``) for every length.

    Args:
        module: a ``torch.nn.Module`` or any callable on tensors.
        lengths: single-sequence lengths to time (a sweep; include long ones so the quadratic
            attention term is identifiable).
        groups: groups of sequences timed as one packed batch each (needs ``make_inputs`` that
            passes the sequence boundaries, e.g. ``cu_seqlens``, to the module).
        make_inputs: ``make_inputs(lengths) -> args`` (a tuple, or ``(args, kwargs)``). Default:
            one tensor ``[1, sum(lengths), hidden_size]`` on the module's device and dtype.
        hidden_size: for the default inputs; inferred from the module when possible.
        backward: time forward + backward (a sum of the output as the loss), as training runs.
        warmup, repeats: untimed and timed runs per entry; the median of the timed runs is kept.
        device, dtype: override the module's.

    Returns:
        ``Measurement(lengths, degree=1, seconds)`` for every entry, in sweep order.

    Raises:
        ValueError: no hidden size for the default inputs, or a non-positive length.
    """
    dev, dt = _device_dtype(module, device, dtype)
    entries = [(int(n),) for n in lengths] + [tuple(int(x) for x in g) for g in groups]
    if not entries:
        raise ValueError("lengths and groups are both empty: nothing to profile")
    if any(x <= 0 for e in entries for x in e):
        raise ValueError("lengths must be positive")
    if warmup < 0 or repeats < 1:
        raise ValueError("warmup must be >= 0 and repeats >= 1")
    if make_inputs is None:
        h = hidden_size or _hidden_size(module)
        if not h:
            raise ValueError("hidden_size is needed for the default inputs (or pass make_inputs)")

        def make_inputs(ls, h=h):
            return (torch.randn(1, sum(ls), h, device=dev, dtype=dt, requires_grad=backward),)

    out = []
    for entry in entries:
        made = make_inputs(entry)
        args, kwargs = (
            made if (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict)) else (made, {})
        )
        if not isinstance(args, tuple):
            args = (args,)
        times = []
        for r in range(warmup + repeats):
            _sync(dev)
            t0 = time.perf_counter()
            y = module(*args, **kwargs)
            if backward:
                y = y[0] if isinstance(y, (tuple, list)) else y
                y.float().sum().backward()
            _sync(dev)
            if r >= warmup:
                times.append(time.perf_counter() - t0)
        out.append(Measurement(entry, 1, float(statistics.median(times))))
    return out
