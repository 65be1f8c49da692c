"""A small three-modality model for the end-to-end demo (a few million parameters, plain torch).

Vision encoder: patch embedding, one varlen self-attention layer over each image/video's packed
patches (``attention_block``), an MLP, and a connector that merges 4 patches into one LLM token.
Audio encoder: frame embedding, a padded temporal convolution (``unpack`` -> conv1d -> ``pack``),
and a connector that merges 2 frames. Text: token embeddings. LLM: one pre-norm transformer block
run by a group of ranks with sequence parallelism: causal ring attention over the group
(``ring_attention``, zigzag) and a tensor-parallel MLP (``ColumnParallelLinear`` ->
``RowParallelLinear``, all-gather/GEMM overlap), then an LM head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmbalance.collectives import ColumnParallelLinear, RowParallelLinear, ring_attention
from mmbalance.pyops import pack, unpack
from mmbalance.pyops.attention_ops import attention_block

PATCH_DIM, FRAME_DIM, VOCAB = 24, 16, 256
VISION_DOWNSAMPLE, AUDIO_DOWNSAMPLE = 4, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class VisionEncoder(nn.Module):
    def __init__(self, hidden: int, llm_hidden: int, heads: int = 2, dtype=None):
        super().__init__()
        self.heads = heads
        self.embed = nn.Linear(PATCH_DIM, hidden, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 2 * hidden, dtype=dtype), nn.GELU(), nn.Linear(2 * hidden, hidden, dtype=dtype)
        )
        self.connector = nn.Linear(VISION_DOWNSAMPLE * hidden, llm_hidden, dtype=dtype)

    def forward(self, patches, cu_seqlens, max_seqlen: int):
        x = self.embed(patches)
        t, h = x.shape[0], self.heads
        q, k, v = self.qkv(x).view(t, 3, h, -1).unbind(1)
        att, _ = attention_block(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            backend="reference" if x.dtype == torch.float64 else "auto",
        )
        x = x + self.proj(att.reshape(t, -1))
        x = x + self.mlp(x)
        # every image/video has a multiple of 4 patches, so groups never straddle two examples
        return self.connector(x.reshape(-1, VISION_DOWNSAMPLE * x.shape[-1]))


class AudioEncoder(nn.Module):
    def __init__(self, hidden: int, llm_hidden: int, dtype=None):
        super().__init__()
        self.embed = nn.Linear(FRAME_DIM, hidden, dtype=dtype)
        self.conv = nn.Conv1d(hidden, hidden, kernel_size=3, padding=1, dtype=dtype)
        self.connector = nn.Linear(AUDIO_DOWNSAMPLE * hidden, llm_hidden, dtype=dtype)

    def forward(self, frames, cu_seqlens, max_seqlen: int):
        x = self.embed(frames)
        if max_seqlen == 0:  # no speech in this batch
            return self.connector(x.reshape(-1, AUDIO_DOWNSAMPLE * x.shape[-1]))
        padded = unpack(x, cu_seqlens, max_seqlen)  # [B, L, H], zeros past each example's end
        y = self.conv(padded.transpose(1, 2)).transpose(1, 2)
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        x = x + F.gelu(pack(y.contiguous(), seqlens, x.shape[0]))
        return self.connector(x.reshape(-1, AUDIO_DOWNSAMPLE * x.shape[-1]))


class LLMBlock(nn.Module):
    """One transformer block over a sequence-parallel group: ring attention + TP MLP."""

    def __init__(self, hidden: int, heads: int, group, dtype=None, seed: int = 0):
        super().__init__()
        self.heads, self.group = heads, group
        self.embed = nn.Embedding(VOCAB, hidden, dtype=dtype)
        self.norm1, self.norm2 = RMSNorm(hidden, dtype), RMSNorm(hidden, dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        full_up = nn.Linear(hidden, 4 * hidden, dtype=dtype)
        full_down = nn.Linear(4 * hidden, hidden, dtype=dtype)
        init_(full_up, seed + 1)  # the full matrices are identical everywhere; each rank keeps its shard
        init_(full_down, seed + 2)
        self.up = ColumnParallelLinear.from_linear(full_up, group)
        self.down = RowParallelLinear.from_linear(full_down, group)
        self.head = nn.Linear(hidden, VOCAB, dtype=dtype)

    def tp_parameters(self):
        """Parameters sharded over the group (their gradients are reduced over data parallelism only)."""
        return [*self.up.parameters(), *self.down.parameters()]

    def forward(self, x_local, cu_seqlens_global, shard_sizes):
        t, h = x_local.shape[0], self.heads
        q, k, v = self.qkv(self.norm1(x_local)).view(t, 3, h, -1).unbind(1)
        att = ring_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu_seqlens_global,
            causal=True,
            group=self.group,
            backend="reference" if x_local.dtype == torch.float64 else "auto",
        )
        x = x_local + self.proj(att.reshape(t, -1))
        y = self.down(F.gelu(self.up(self.norm2(x), shard_sizes=shard_sizes)), shard_sizes=shard_sizes)
        return self.head(x + y)


def param_count(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def init_(module: nn.Module, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Deterministic initialization (identical on every rank and in every run)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.startswith(skip):
                continue
            bound = 1.0 / math.sqrt(max(1, p.shape[-1]))
            p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1).to(p.dtype) * bound)
            if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.fill_(1.0)
