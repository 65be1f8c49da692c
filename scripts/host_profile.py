"""Where an eager call's host time goes: the varlen ops and an attention block on tiny inputs.

    python scripts/host_profile.py [--device cuda|cpu] [--calls N] [--top K]

Each call runs ``--calls`` times back to back on a tiny input (the device synchronized before and
after, not counted), beside two floors measured in the same run: one torch op (``add_``) and a raw
launch of a trivial Triton kernel. Then cProfile shows the ``--top`` functions by own time for the
varlen ops and the forced Triton attention block, so a host cost over the target (25 us a call) can
be traced to the line that pays it. On CPU it runs the reference paths (a dry run of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _nothing(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr))


def _per_call_us(fn, device: str, calls: int) -> float:
    for _ in range(20):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args()
    dev = args.device

    import mmbalance.pyops as P
    from mmbalance.pyops.attention_ops import attention_block

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    seqlens = torch.tensor([3, 8, 0, 5], device=dev)
    cu = P.cu_seqlens_from_lengths(seqlens)
    packed = torch.randn(16, 64, device=dev).to(dtype)
    padded = P.unpack(packed, cu, 8)
    order = torch.tensor([2, 0, 3, 1], device=dev)
    q, k, v = (torch.randn(16, h, 64, device=dev).to(dtype) for h in (4, 2, 2))
    cu32 = torch.tensor([0, 7, 16], dtype=torch.int32, device=dev)

    def block(backend):
        return lambda: attention_block(q, k, v, cu32, cu32, 9, 9, causal=True, backend=backend)[0]

    calls = {
        "floor: torch add_": lambda: packed.add_(0),
        "pack": lambda: P.pack(padded, seqlens, 16),
        "unpack": lambda: P.unpack(packed, cu, 8),
        "segment_gather": lambda: P.segment_gather(packed, cu, order, 16),
        "attention_block auto": block("auto"),
    }
    if dev == "cuda":
        one = torch.zeros(1, device=dev)
        calls["floor: raw triton launch"] = lambda: _nothing[(1,)](one)
        calls["attention_block triton"] = block("triton")
    with torch.no_grad():
        for name, fn in calls.items():
            print(f"{name:28s} {_per_call_us(fn, dev, args.calls):8.1f} us a call", flush=True)
        profiles = ["pack", "segment_gather", "attention_block triton"]
        for name in profiles:
            if name not in calls:
                continue
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                calls[name]()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
            print(f"\n== {name}: {args.calls} calls, by own time")
            print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
    if dev == "cuda":
        _forward_backward(args)


def _forward_backward(args) -> None:
    """Forward + backward through autograd at a real size (32 x 512 tokens, 16/4 heads of 64):
    the time per step with a sync after each, the host time per step without, and where the host
    time goes; a step whose host time exceeds its GPU time is host-bound."""
    import warnings

    from mmbalance.pyops.attention_ops import attention_block

    dev, dtype = "cuda", torch.bfloat16
    b, n = 32, 512
    cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=dev)
    leaves = [torch.randn(b * n, h, 64, device=dev, dtype=dtype, requires_grad=True) for h in (16, 4, 4)]
    grad = torch.randn(b * n, 16, 64, device=dev, dtype=dtype)
    for backend in ("triton", "torch_flash"):

        def step(backend=backend):
            out = attention_block(*leaves, cu, cu, n, n, causal=True, backend=backend)[0]
            torch.autograd.grad(out, leaves, grad)

        try:
            step()
        except ValueError as e:
            print(f"\n== fwd+bwd {backend}: cannot run ({e})")
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
            torch.cuda.synchronize()
        synced = (time.perf_counter() - t0) / 20 * 1e3
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught})
        print(
            f"\n== fwd+bwd {backend} B{b}xL{n}xH16/4xD64 causal: {synced:.3f} ms a step synced, "
            f"{host:.3f} ms of host time a step; host syncs: {syncs or 'none'}"
        )
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
