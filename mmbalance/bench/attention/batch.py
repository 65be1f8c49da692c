"""One batch of the attention benchmarks: its shape (``BlockConfig``: lengths, heads, mask, the
FLOPs of its allowed pairs) and SDPA run on it as a user would (``sdpa_runner``); shared by the block
benchmark (``blocks.py``) and the tile sweep (``tiles/``)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    n_seqs: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    window: int = -1  # window_left in positions (-1: none); a window of W tokens is W - 1
    lengths: tuple[int, ...] | None = None  # varlen: the sequences' lengths (seqlen: the longest)

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window >= 0:
            mask += f"-w{self.window + 1}"
        batch = (
            f"shipped{len(self.lengths)}x<={self.seqlen}"
            if self.lengths
            else f"B{self.n_seqs}xL{self.seqlen}"
        )
        return f"{batch}xH{self.heads}/{self.kv_heads}xD{self.head_dim}-{mask}"

    @property
    def all_lengths(self) -> list[int]:
        return list(self.lengths) if self.lengths else [self.seqlen] * self.n_seqs

    def flops_fwd(self) -> float:
        """``4 * pairs * H * D``: the allowed (query, key) pairs only (padding is not work)."""
        pairs = 0.0
        for n in self.all_lengths:
            if not self.causal:
                pairs += n * n
            elif self.window < 0 or self.window >= n - 1:
                pairs += n * (n + 1) / 2
            else:  # the first window+1 queries see every earlier key, the rest window+1 keys each
                w = self.window + 1
                pairs += w * (w + 1) / 2 + (n - w) * w
        return 4.0 * pairs * self.heads * self.head_dim


def sdpa_runner(cfg: BlockConfig, device: str):
    """SDPA as a user runs it: a batch of equal lengths batched with its own causal flag; mixed
    lengths padded to the longest with a mask (causal and keys past each sequence's end); a window
    as a band mask."""
    lengths = cfg.all_lengths
    b, n = len(lengths), cfg.seqlen
    uniform = cfg.lengths is None
    mask = None
    if not uniform or cfg.window >= 0:
        pos = torch.arange(n, device=device)
        allowed = torch.ones(n, n, dtype=torch.bool, device=device)
        if cfg.causal:
            allowed &= pos[None, :] <= pos[:, None]
        if cfg.window >= 0:
            allowed &= pos[None, :] >= pos[:, None] - cfg.window
        keys = pos[None, :] < torch.tensor(lengths, device=device)[:, None]  # [B, n]
        mask = (allowed[None] & keys[:, None, :])[:, None]  # [B, 1, n, n]
    masking: dict = {"is_causal": cfg.causal} if mask is None else {"attn_mask": mask}
    index = torch.cat([torch.arange(length, device=device) + i * n for i, length in enumerate(lengths)])

    def run(q, k, v, cu):
        if uniform:  # equal lengths are a batch already: views, nothing copied
            qb, kb, vb = (t.view(b, n, t.shape[1], cfg.head_dim).transpose(1, 2) for t in (q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, **masking, enable_gqa=True)
            return out.transpose(1, 2).reshape(q.shape)
        padded = []
        for t in (q, k, v):
            x = t.new_zeros((b * n, *t.shape[1:]))
            x = x.index_copy(0, index, t)
            padded.append(x.view(b, n, t.shape[1], cfg.head_dim).transpose(1, 2))
        out = torch.nn.functional.scaled_dot_product_attention(*padded, **masking, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, cfg.heads, cfg.head_dim).index_select(0, index)

    return run
