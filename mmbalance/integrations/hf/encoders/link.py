"""The zero that keeps every rank's backward in the moves: :class:`ZeroLink`.

A rank whose batch holds no item still encodes a stand-in and still receives (nothing) through the
all-to-alls, and its backward must run those collectives too, or the other ranks wait for it. A
zero that depends on every such tensor, added to something the loss is built from, makes autograd
reach them on every rank. Used by encoder balancing and by dynamic context parallelism's feature
moves.
"""

from __future__ import annotations

import torch

__all__ = ["ZeroLink"]


class ZeroLink(torch.autograd.Function):
    """A zero scalar whose backward sends zero gradients to ``tensors``: adding it to something
    the loss depends on makes every rank's backward run through ``tensors`` (the returned outputs
    and the stand-in encoding, hence the backward all-to-all and the encoder), without reading
    their values (an inf in them cannot turn the zero into a NaN)."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device)

    @staticmethod
    def backward(ctx, grad):
        # zeros that take no memory (one element, expanded): the point is the path, not the value
        return tuple(
            torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.meta
        )
