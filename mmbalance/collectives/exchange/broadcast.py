"""``broadcast_from_leader``: one rank's tensor on every rank of a group, differentiable.

Used where a group of ranks (a tensor- or context-parallel LLM group) shares the batch that the
LLM plan gave its first rank: the leader's assembled batch is broadcast to the group, and in the
backward the group's gradients are summed back to the leader.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..agreement import Entry
from ..inflight import run

__all__ = ["broadcast_from_leader"]


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, shape, group, leader):
        ctx.group, ctx.leader, ctx.in_shape = group, leader, x.shape
        ctx.is_leader = dist.get_rank() == leader
        buf = x.contiguous().clone() if ctx.is_leader else x.new_empty(tuple(shape))
        run(dist.broadcast, buf, src=leader, group=group)
        return buf

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        run(dist.reduce, grad, dst=ctx.leader, group=ctx.group)
        if not ctx.is_leader:
            grad = grad.new_zeros(ctx.in_shape)
        return (grad if ctx.needs_input_grad[0] else None), None, None, None, None


def broadcast_from_leader(x: Tensor, shape: Sequence[int], group, leader: int) -> Tensor:
    """The leader's ``x`` on every rank of ``group``; differentiable (gradients are summed back to
    the leader).

    Non-leaders pass their own local tensor (for example the empty batch the plan gave them): it
    is not read, but it keeps the non-leader's earlier collectives (the moves that produced it) in
    the autograd graph, so their backward all-to-alls run on every rank. ``shape`` is the leader's
    shape, known from the plan (no size exchange). ``leader`` is a global rank.

    One agreement collective first: ``shape``, ``leader`` and the dtype must be the same on every
    rank, and the leader's ``x`` must have ``shape``; otherwise every rank raises. When any rank
    needs a gradient, every rank's output requires grad, so the backward reduction runs everywhere.
    """
    with Entry("broadcast_from_leader", group) as e:
        e.values = [0, 0]
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        shape = tuple(int(s) for s in shape)
        if dist.get_rank() == leader and tuple(x.shape) != shape:
            raise ValueError(f"x has shape {tuple(x.shape)} on the leader, expected {shape}")
        e.like = x
        e.fields = {"shape": shape, "leader": int(leader), "dtype": x.dtype, "device": x.device.type}
        e.values = [int(x.requires_grad), int(torch.is_grad_enabled())]
    needed = e.grad_bits(e.agree(), 0)
    anchor = torch.empty(0, device=x.device, requires_grad=bool(needed))
    return _Broadcast.apply(x, anchor, shape, group, leader)
