"""The varlen ops and the attention block on CUDA: no device-to-host synchronization, and a CUDA
graph that captures ``pack``, ``unpack``, ``segment_gather`` and ``attention_block`` (Triton and
torch's FlashAttention) replays equal to eager calls on new inputs (``pytest -m gpu``).
"""

from __future__ import annotations

import pytest
import torch

import mmbalance.pyops as P
from mmbalance.pyops.attention_ops import attention_block

pytestmark = pytest.mark.gpu


def _cuda(backend: str = "triton"):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "torch_flash":
        from mmbalance.pyops.attention_backends import AttentionInputs, torch_flash_unsupported_reasons

        why = torch_flash_unsupported_reasons(AttentionInputs(q_shape=(69, 8, 64), k_shape=(69, 2, 64),
                                                              dtype=torch.bfloat16, device=torch.device("cuda"),
                                                              causal=True))  # fmt: skip
        if why:
            pytest.skip(f"torch_flash cannot run here: {why}")


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([3, 17, 0, 40, 9], dtype=torch.int32)
    total, longest = int(seqlens.sum()), int(seqlens.max())
    packed = torch.randn(total, 256, generator=g)
    q = torch.randn(total, 8, 64, generator=g)
    kv = torch.randn(2, total, 2, 64, generator=g)
    order = torch.tensor([3, 0, 4, 1, 2])
    cu = torch.tensor([0, *seqlens.cumsum(0).tolist()], dtype=torch.int32)
    tensors = {"seqlens": seqlens, "cu": cu, "order": order, "packed": packed.bfloat16(), "q": q.bfloat16(),
               "k": kv[0].bfloat16(), "v": kv[1].bfloat16()}  # fmt: skip
    return {k: v.cuda() for k, v in tensors.items()}, total, longest


def _run(x: dict, total: int, longest: int, backend: str) -> list[torch.Tensor]:
    padded = P.unpack(x["packed"], x["cu"], longest)
    repacked = P.pack(padded, x["seqlens"], total)
    gathered = P.segment_gather(x["packed"], x["cu"], x["order"], total)
    out, lse = attention_block(x["q"], x["k"], x["v"], x["cu"], x["cu"], longest, longest, causal=True,
                               backend=backend)  # fmt: skip
    return [padded, repacked, gathered, out, lse]


@pytest.mark.parametrize("backend", ["triton", "torch_flash"])
def test_no_call_synchronizes_with_the_host(backend, monkeypatch):
    _cuda(backend)
    monkeypatch.delenv("MMBALANCE_DEBUG", raising=False)
    x, total, longest = _inputs(0)
    _run(x, total, longest, backend)  # compile and cache first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronization raises
    try:
        _run(x, total, longest, backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["triton", "torch_flash"])
def test_capture_and_replay_equal_eager(backend, monkeypatch):
    _cuda(backend)
    monkeypatch.delenv("MMBALANCE_DEBUG", raising=False)
    static, total, longest = _inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph wants
        for _ in range(2):
            _run(static, total, longest, backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(static, total, longest, backend)
    for seed in (1, 2):  # new values in the captured inputs, then replay
        fresh, _, _ = _inputs(seed)
        for key in ("packed", "q", "k", "v"):
            static[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, _run(static, total, longest, backend)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
