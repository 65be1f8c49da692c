"""One long causal sequence on CPU: ``attention_block`` against SDPA, time and peak memory.

Long sequence on CPU (``attention_long_fwd_bwd``): one causal sequence (default 8192 tokens, 8
heads of 64, float32), forward + backward through autograd, ``attention_block`` (the blockwise CPU
path) against ``torch`` SDPA (its CPU flash kernel). Each variant runs in a fresh process (``python
-m mmbalance.bench.attention --long-worker``), the variants alternating, ``--long-rounds`` rounds;
reported are the medians of the time per forward + backward (the median of 2 timed calls after a
measured warm-up call, per process) and of the peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` once the inputs exist and a tiny warm-up call has paid the one-time costs
of a first call): ``peak_mib`` of the whole process and ``added_mib``, what the call added above
the inputs; ``time_vs_sdpa`` and ``added_vs_sdpa`` are ours over SDPA's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import torch

from ..harness import Row, device_name
from ..processes import child_dies_with_parent


def _rss_kib(field: str) -> int:
    """``VmRSS``/``VmHWM`` of this process in KiB (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def long_worker(provider: str, seqlen: int, heads: int, head_dim: int, timed: int) -> dict:
    """One variant in this (fresh) process: peak memory of the first forward + backward, then the
    median time of ``timed`` more."""
    from mmbalance.pyops.attention_ops import attention_block

    def inputs(length: int):
        g = torch.Generator().manual_seed(0)
        qkv = [torch.randn(length, heads, head_dim, generator=g).requires_grad_() for _ in range(3)]
        return (
            qkv,
            torch.randn(length, heads, head_dim, generator=g),
            torch.tensor([0, length], dtype=torch.int32),
        )

    def ours(q, k, v, cu):
        return attention_block(q, k, v, cu, cu, q.shape[0], q.shape[0], causal=True)[0]

    def sdpa(q, k, v, cu):
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return out[0].transpose(0, 1)

    fn = ours if provider == "mmbalance" else sdpa
    # one tiny call first: one-time costs (lazy imports and registrations on the first call of an
    # op, about 85 MiB for a custom op) are not the call's memory
    (q, k, v), dout, cu = inputs(16)
    torch.autograd.grad(fn(q, k, v, cu), (q, k, v), dout)
    (q, k, v), dout, cu = inputs(seqlen)

    def step():
        torch.autograd.grad(fn(q, k, v, cu), (q, k, v), dout)

    try:  # reset the peak to the current resident size (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        resettable = True
    except OSError:
        resettable = False
    base = _rss_kib("VmRSS")
    step()
    peak = _rss_kib("VmHWM")
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"time_ms": float(np.median(times)) * 1e3, "peak_mib": peak / 1024, "base_mib": base / 1024,
            "added_mib": (peak - base) / 1024, "peak_resettable": resettable}  # fmt: skip


def bench_long(seqlen: int, heads: int = 8, head_dim: int = 64, rounds: int = 3) -> list[Row]:
    """``attention_block`` vs SDPA on one long causal sequence on CPU: time and peak memory of
    forward + backward, each measurement in a fresh process (see the module docstring)."""
    providers = ("mmbalance", "torch_sdpa")
    results: dict[str, list[dict]] = {p: [] for p in providers}
    for _ in range(rounds):
        for provider in providers:
            cmd = [sys.executable, "-m", "mmbalance.bench.attention", "--long-worker", provider,
                   str(seqlen), str(heads), str(head_dim)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                  preexec_fn=child_dies_with_parent())  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"long-sequence worker {provider} failed:\n{done.stderr[-3000:]}")
            results[provider].append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {p: {key: float(np.median([r[key] for r in rs])) for key in ("time_ms", "peak_mib", "added_mib", "base_mib")}
           for p, rs in results.items()}  # fmt: skip
    shape = f"B1xL{seqlen}xH{heads}/{heads}xD{head_dim}-causal"
    dev = device_name("cpu")
    rows = []
    for provider in providers:
        m = med[provider]
        metrics = {"peak_mib": m["peak_mib"], "added_mib": m["added_mib"], "base_mib": m["base_mib"],
                   "rounds": rounds, "threads": torch.get_num_threads()}  # fmt: skip
        if provider == "mmbalance":
            ref = med["torch_sdpa"]
            metrics["time_vs_sdpa"] = m["time_ms"] / ref["time_ms"]
            metrics["peak_vs_sdpa"] = m["peak_mib"] / ref["peak_mib"]
            # nan when SDPA added nothing measurable (tiny sizes: freed memory reused)
            metrics["added_vs_sdpa"] = m["added_mib"] / ref["added_mib"] if ref["added_mib"] > 0 else math.nan
        rows.append(Row("attention_long_fwd_bwd", provider, shape, "float32", dev, m["time_ms"], metrics))
    return rows
