"""Gated DeltaNet layers of a dynamic context-parallel shard (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo
hybrid).

A Gated DeltaNet layer mixes tokens with a causal depthwise convolution (kernel ``w``, 4) and a
gated delta-rule recurrence, not attention, so the ring never sees it. Under a shard
(:class:`~.shard.CPShard`, which reaches the decoder layer as the ``mmbalance_cp`` keyword; a
forward pre-hook on the decoder layer hands it to the layer) the layer runs here instead of its
own forward, on the rank's pieces of every sequence (degree 1: whole sequences, packed; degree
``d``: the zigzag runs of :func:`~mmbalance.collectives.ring.ring_plan`):

1. its projections on the local tokens (the layer's own modules: ``in_proj_qkv`` / ``in_proj_z`` /
   ``in_proj_b`` / ``in_proj_a``, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` through its
   ``fix_query_key_value_ordering``, or OLMo hybrid's ``q_proj`` ... ``g_proj``, its beta doubled where
   ``allow_neg_eigval`` says so);
2. the convolution of every piece continues from the ``w - 1`` inputs before it in its sequence,
   wherever they are: each rank's last ``w - 1`` inputs of every piece are gathered over the group;
3. the recurrence of every piece starts from the state all earlier pieces of its sequence leave:
   each rank computes the affine map of its pieces (``torch.ops.mmbalance.delta_rule_chunk_state``:
   ``S_out = M S_in + U``, ``K (K + V)`` values a head), the group gathers them, every rank composes
   the states its pieces start from (:func:`~mmbalance.pyops.delta_rule.compose_chunk_states`) and
   runs its pieces from them with the layer's own chunked delta rule (flash-linear-attention's
   kernel where transformers uses it);
4. the gated norm and the output projection (``norm`` / ``out_proj``, OLMo hybrid's ``o_norm`` / ``o_proj``).

Both gathers carry gradients back (an all-reduce of the gathered gradients, each rank keeping its
own), so the backward is the sequence's whole: a piece's conv window and starting state receive the
gradients of the pieces after it. Degree 1 needs no exchange: every sequence starts from a zero
window and a zero state, as alone.

The other hybrids (Mamba mixers, short convolutions, lightning attention, Kimi Delta Attention) are
refused by name at ``apply_dynamic_cp`` (:func:`~.attention.model_refusal`).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mmbalance.collectives.ring.plan import ring_plan
from mmbalance.pyops.delta_rule import compose_chunk_states, delta_rule_chunk_state

from ..attention import CP_KEYWORD
from ..mixers import unwrap_forward, wrap_forward

__all__ = ["CP_LINEAR", "install_linear_cp", "remove_linear_cp", "linear_cp_forward"]

#: Gated DeltaNet classes that run under a shard (checked against the layer's own forward on whole
#: sequences and against one process on split ones: tests/integrations/test_linear_cp.py)
CP_LINEAR = frozenset(
    {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet", "OlmoHybridGatedDeltaNet"}
)

_SHARD = "_mmbalance_cp_shard"


class _GroupGather(torch.autograd.Function):
    """``[d, *x.shape]``: every group member's ``x``; backward: the gathered gradients summed over
    the group (an all-reduce), this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group, rank: int, degree: int) -> Tensor:
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def _projections(layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mixed_qkv [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])`` of the local tokens (``z``:
    the output gate)."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: grouped projections, reordered by the layer
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(x[None]), layer.in_proj_ba(x[None])
        )
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (q, k, v)], dim=-1)[0]
        return mixed, z[0], b[0], a[0]
    if hasattr(layer, "g_proj"):  # OLMo hybrid: a projection each, the output gate its own
        mixed = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)
        z = layer.g_proj(x).reshape(x.shape[0], -1, layer.head_v_dim)
        return mixed, z, layer.b_proj(x), layer.a_proj(x)
    mixed = layer.in_proj_qkv(x)
    z = layer.in_proj_z(x).reshape(x.shape[0], -1, layer.head_v_dim)
    return mixed, z, layer.in_proj_b(x), layer.in_proj_a(x)


def _conv(layer) -> tuple[Tensor, Tensor | None]:
    """The depthwise convolution's ``(weight [C, 1, w], bias)`` over the mixed q, k, v channels: the
    layer's one ``conv1d``, or OLMo hybrid's three (``q_conv1d``, ``k_conv1d``, ``v_conv1d``, before
    transformers 5.16), their channels in that order."""
    if hasattr(layer, "conv1d"):
        return layer.conv1d.weight, layer.conv1d.bias
    convs = [layer.q_conv1d, layer.k_conv1d, layer.v_conv1d]
    biases = [c.bias for c in convs]
    bias = None if all(b is None for b in biases) else torch.cat([b for b in biases if b is not None])
    return torch.cat([c.weight for c in convs]), bias


def _chunk_rule(layer):
    """The layer's chunked delta rule (flash-linear-attention's where transformers uses it)."""
    own = getattr(layer, "chunk_gated_delta_rule", None)
    if own is not None:
        return own
    return sys.modules[type(layer).__module__].torch_chunk_gated_delta_rule


def _l2norm(layer):
    return sys.modules[type(layer).__module__].l2norm


class _Layout:
    """Where this rank's pieces sit: per local piece its sequence, its slot (run 0 or 1), its
    start in the sequence and its local offset; for every piece of the group its owner."""

    def __init__(self, shard, tokens: int):
        cu = np.asarray(shard.cu_seqlens, dtype=np.int64)
        self.degree, self.rank = int(shard.degree), int(shard.group_rank)
        lengths = np.diff(cu)
        self.sequences = int(lengths.size)
        if self.degree == 1:  # whole sequences, packed
            self.runs = np.stack([np.zeros_like(lengths), lengths, lengths], axis=-1)[None]
            self.local = lengths[None]
        else:
            plan = ring_plan(cu, self.degree, "zigzag")
            self.runs, self.local = plan.runs.astype(np.int64), plan.local_lengths.astype(np.int64)
        # pieces: (rank, sequence, slot) -> (start in sequence, length)
        start0, len0, start1 = self.runs[..., 0], self.runs[..., 1], self.runs[..., 2]
        len1 = self.local - len0
        self.starts = np.stack([start0, start1], axis=-1)  # [d, S, 2]
        self.lens = np.stack([len0, len1], axis=-1)
        mine = self.lens[self.rank if self.degree > 1 else 0]
        self.offsets = np.concatenate([[0], np.cumsum(mine.reshape(-1))])  # local order: (s, slot)
        if int(self.offsets[-1]) != tokens:
            raise ValueError(
                f"a Gated DeltaNet layer under context parallelism got {tokens} tokens, its shard holds "
                f"{int(self.offsets[-1])}: call the model with the kwargs handle.shard returned, unchanged"
            )

    def chain(self, s: int) -> list[tuple[int, int]]:
        """The non-empty pieces ``(rank, slot)`` of sequence ``s`` in sequence order."""
        found = [
            (int(self.starts[r, s, j]), r, j)
            for r in range(self.lens.shape[0])
            for j in range(2)
            if self.lens[r, s, j] > 0
        ]
        return [(r, j) for _, r, j in sorted(found)]


def linear_cp_forward(layer, hidden_states: Tensor, shard) -> Tensor:
    """The layer's output ``[1, T, hidden]`` for this rank's ``T`` tokens of the shard (module
    docstring)."""
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(
            f"a Gated DeltaNet layer under context parallelism takes one packed row [1, T, hidden], got "
            f"{tuple(hidden_states.shape)}"
        )
    if getattr(layer, "activation", "silu") not in ("silu", "swish"):
        raise NotImplementedError(f"{type(layer).__name__}: a convolution activation {layer.activation!r}")
    x = hidden_states[0]
    tokens = x.shape[0]
    lay = _Layout(shard, tokens)
    group = shard.process_group() if lay.degree > 1 else None
    width = int(layer.conv_kernel_size) - 1
    mixed, z, b, a = _projections(layer, x)
    channels = mixed.shape[-1]
    slots = [(s, j) for s in range(lay.sequences) for j in range(2)]

    def piece(i: int) -> Tensor:
        return mixed[int(lay.offsets[i]) : int(lay.offsets[i + 1])]

    # 2. the convolution windows: the last `width` inputs of every piece, gathered
    tails = mixed.new_zeros((lay.sequences, 2, width, channels))
    if lay.degree > 1 and width:
        rows = []
        for i, _ in enumerate(slots):
            p = piece(i)[-width:]
            rows.append(
                torch.cat([p.new_zeros((width - p.shape[0], channels)), p]) if p.shape[0] < width else p
            )
        tails = torch.stack(rows).reshape(lay.sequences, 2, width, channels) if rows else tails
        every_tail = _GroupGather.apply(tails, group, lay.rank, lay.degree)  # [d, S, 2, w, C]
    weight, bias = _conv(layer)
    convolved = []
    for i, (s, j) in enumerate(slots):
        p = piece(i)
        if p.shape[0] == 0:
            continue
        if lay.degree > 1 and width:
            chain = lay.chain(s)
            at = chain.index((lay.rank, j))
            window: list[Tensor] = []
            need = width
            for r, jj in reversed(chain[:at]):  # the inputs before this piece, nearest first
                have = int(min(lay.lens[r, s, jj], width))
                take = min(have, need)
                window.insert(0, every_tail[r, s, jj, width - take :])
                need -= take
                if need == 0:
                    break
            if need:
                window.insert(0, p.new_zeros((need, channels)))
            halo = torch.cat(window)
        else:
            halo = p.new_zeros((width, channels))
        seq = torch.cat([halo, p]).transpose(0, 1)[None]  # [1, C, w + L]
        convolved.append(F.silu(F.conv1d(seq, weight, bias, groups=channels))[0].transpose(0, 1))
    mixed = torch.cat(convolved) if convolved else mixed[:0]
    key_dim, value_dim = layer.key_dim, layer.value_dim
    q, k, v = torch.split(mixed, [key_dim, key_dim, value_dim], dim=-1)
    q = q.reshape(tokens, -1, layer.head_k_dim)
    k = k.reshape(tokens, -1, layer.head_k_dim)
    v = v.reshape(tokens, -1, layer.head_v_dim)
    if q.shape[1] != v.shape[1]:  # more value heads than key heads: each key head serves a group of them
        q = q.repeat_interleave(v.shape[1] // q.shape[1], dim=1)
        k = k.repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    beta = b.sigmoid()
    if getattr(layer, "allow_neg_eigval", False):  # OLMo hybrid: beta in [0, 2]
        beta = beta * 2.0
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    heads = v.shape[1]

    # 3. the recurrence: every piece's map, gathered and composed into its starting state
    starts_of: dict[int, Tensor] = {}
    if lay.degree > 1:
        kn = _l2norm(layer)(k.float(), dim=-1)
        if kn.shape[1] != heads:
            kn = kn.repeat_interleave(heads // kn.shape[1], dim=1)
        cu = torch.as_tensor(lay.offsets, dtype=torch.int64, device=x.device)
        longest = int(np.diff(lay.offsets).max(initial=0))
        m, u = delta_rule_chunk_state(kn, v.float(), g, beta.float(), cu, longest)
        maps = torch.cat([m, u], dim=-1).reshape(lay.sequences, 2, heads, layer.head_k_dim, -1)
        every_map = _GroupGather.apply(maps, group, lay.rank, lay.degree)  # [d, S, 2, H, K, K + V]
        dk = layer.head_k_dim
        for i, (s, j) in enumerate(slots):
            if lay.lens[lay.rank, s, j] == 0:
                continue
            chain = lay.chain(s)
            at = chain.index((lay.rank, j))
            if at == 0:
                continue
            before = torch.stack([every_map[r, s, jj] for r, jj in chain[:at]])  # [c, H, K, K + V]
            _, state = compose_chunk_states(before[..., :dk], before[..., dk:])
            starts_of[i] = state
    rule = _chunk_rule(layer)
    outs = []
    for i in range(len(slots)):
        lo, hi = int(lay.offsets[i]), int(lay.offsets[i + 1])
        if hi == lo:
            continue
        init = starts_of.get(i)
        out, _ = rule(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g=g[None, lo:hi], beta=beta[None, lo:hi],
            initial_state=None if init is None else init[None].to(torch.float32),
            output_final_state=False, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(out[0])
    core = torch.cat(outs) if outs else v.new_zeros((0, heads, layer.head_v_dim))
    norm, out_proj = (
        (layer.o_norm, layer.o_proj) if hasattr(layer, "o_norm") else (layer.norm, layer.out_proj)
    )
    core = norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return out_proj(core.reshape(1, tokens, -1).to(hidden_states.dtype))


def _layers(model):
    """``(decoder layer, its Gated DeltaNet)`` of every layer with one of :data:`CP_LINEAR`."""
    for module in model.modules():
        inner = getattr(module, "linear_attn", None)
        if inner is not None and type(inner).__name__ in CP_LINEAR:
            yield module, inner


def install_linear_cp(model) -> None:
    """On every decoder layer with a Gated DeltaNet of :data:`CP_LINEAR`: a forward pre-hook that
    hands the call's shard (``mmbalance_cp``) to the layer, and the layer's forward runs
    :func:`linear_cp_forward` when it has one (its own forward otherwise). Counted: one
    installation, however many handles."""
    for decoder, inner in _layers(model):
        users = inner.__dict__.get("_mmbalance_linear_cp_users", 0)
        inner.__dict__["_mmbalance_linear_cp_users"] = users + 1
        if users:
            continue

        def hand(module, args, kwargs, inner=inner):
            inner.__dict__[_SHARD] = kwargs.get(CP_KEYWORD)
            return None

        stock = inner.forward  # (a wrapper already on the instance: keep_sequences_apart's)

        def forward(hidden_states, *args, _stock=stock, _inner=inner, **kwargs):
            shard = _inner.__dict__.get(_SHARD)
            if shard is None:
                return _stock(hidden_states, *args, **kwargs)
            return linear_cp_forward(_inner, hidden_states, shard)

        inner.__dict__["_mmbalance_linear_cp"] = (
            decoder.register_forward_pre_hook(hand, with_kwargs=True),
            wrap_forward(inner, forward),
        )


def remove_linear_cp(model) -> None:
    """Undo one :func:`install_linear_cp`: the last removal puts the layers back."""
    for _, inner in _layers(model):
        users = inner.__dict__.get("_mmbalance_linear_cp_users", 0) - 1
        inner.__dict__["_mmbalance_linear_cp_users"] = max(users, 0)
        if users > 0:
            continue
        installed = inner.__dict__.pop("_mmbalance_linear_cp", None)
        inner.__dict__.pop(_SHARD, None)
        if installed is not None:
            hook, ours = installed
            hook.remove()
            unwrap_forward(inner, ours)  # (ours passes every call through now: no shard is handed to it)
