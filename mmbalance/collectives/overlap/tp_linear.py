"""Tensor-parallel linears with sequence parallelism, built on the overlapped collectives.

A transformer MLP (or attention projection pair) over ``W`` tensor-parallel ranks::

    x_r [T_r, H]  --ColumnParallelLinear-->  [T, F_r]  --activation-->  --RowParallelLinear-->  [T_r, H]
                   all-gather + GEMM (sliced)                            GEMM + reduce-scatter (sliced)

Activations outside the pair are sharded along the sequence (dim 0, ``T_r`` rows on rank ``r``,
uneven allowed); inside it they are full-length and sharded along the features. The modules are
drop-in for ``nn.Linear`` at those two places: same constructor arguments, same initialization
distribution, any number of middle dimensions (``[T_r, *, H]``, the sequence first).

The per-rank sequence lengths ``T_r`` must be known to both modules. Pass them per call
(``shard_sizes=``), or once for a whole block with ``with sequence_shards(sizes): ...``. Without
either, ``ColumnParallelLinear`` exchanges them (one small all-gather) and ``RowParallelLinear``
assumes the even ``torch.tensor_split`` split of ``T``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Self

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import Entry
from ..group import world_of
from .matmul import all_gather_matmul, matmul_reduce_scatter
from .plan import ShardLayout

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "sequence_shards"]

_STATE = threading.local()


@contextlib.contextmanager
def sequence_shards(sizes: Sequence[int] | ShardLayout) -> Iterator[ShardLayout]:
    """Within the block, tensor-parallel linears use ``sizes`` (per-rank ``T_r``) as their sequence layout."""
    layout = ShardLayout.from_sizes(sizes)
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    stack.append(layout)
    try:
        yield layout
    finally:
        stack.pop()


def _current_shards() -> ShardLayout | None:
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def _scaled(layout: ShardLayout | None, per_row: int) -> ShardLayout | None:
    if layout is None or per_row == 1:
        return layout
    return ShardLayout(tuple(s * per_row for s in layout.sizes))


def _rng_digest(device: torch.device) -> int:
    """A hash of the random-number state that will draw the master weights on ``device``."""
    import hashlib

    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
    else:
        state = torch.get_rng_state()
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _master_linear(in_features: int, out_features: int, bias: bool, like: torch.Tensor):
    """The dense ``nn.Linear(in_features, out_features)`` initialization, drawn exactly as
    ``nn.Linear`` draws it (same generator calls, same order), on ``like``'s device and dtype."""
    weight = torch.empty(out_features, in_features, device=like.device, dtype=like.dtype)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        b = torch.empty(out_features, device=like.device, dtype=like.dtype)
        nn.init.uniform_(b, -bound, bound)
    return weight, b


def _check_master_rng(module: nn.Module, group) -> None:
    """Every tensor-parallel rank must draw the same master weights (Megatron's rule): compare the
    generator states in one small collective; differently seeded ranks raise on every rank."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta":
        return
    with Entry(f"{type(module).__name__}.reset_parameters", group) as e:
        e.fields["random state (seed every tensor-parallel rank alike)"] = _rng_digest(weight.device)
        e.like = weight
    e.agree()


def _feature_problems(x: torch.Tensor, features: int, name: str) -> list[str]:
    """What is wrong with the module input (reported inside the collective's agreement step, so a
    bad input on one rank raises on every rank)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != features:
        return [f"input must be [T, *, {features}] ({name}), got shape {tuple(x.shape)}"]
    return []


class _ShardedLinear(nn.Module):
    """What the column- and row-parallel linears share: the arguments, this rank's slice of the
    sharded features (``features_dim`` of the weight: 0 for the outputs, 1 for the inputs), the
    master-weight initialisation, the copy from an ``nn.Linear`` and the reading of an input."""

    features_dim: int

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, group, chunks, backend, device, dtype
    ) -> None:
        super().__init__()
        rank, world = world_of(group)
        sharded, name = (
            (out_features, "out_features") if self.features_dim == 0 else (in_features, "in_features")
        )
        if sharded < world:
            raise ValueError(f"{name} ({sharded}) must be at least the group size ({world})")
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.chunks = chunks
        self.backend = backend
        split = ShardLayout.even(sharded, world)
        self.features = split.rows(rank)  # this rank's slice of the sharded features
        shape = [out_features, in_features]
        shape[self.features_dim] = split.sizes[rank]
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))
        bias_size = split.sizes[rank] if self.features_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype)) if bias else None

    def _keep(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy this rank's part of the dense ``weight`` and ``bias`` into the parameters."""
        with torch.no_grad():
            self.weight.copy_(weight[self.features] if self.features_dim == 0 else weight[:, self.features])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias[self.features] if self.features_dim == 0 else bias)

    def reset_parameters(self) -> None:
        """Draw the dense ``nn.Linear(in_features, out_features)`` weights from the current generator
        and keep this rank's part: the sharded module equals, shard for shard, the dense module built
        with the same seed (Megatron's master-weight rule). Every rank must be seeded alike (checked):
        the row-parallel bias is replicated and would otherwise differ between ranks."""
        _check_master_rng(self, self.group)
        with torch.no_grad():
            weight, bias = _master_linear(
                self.in_features, self.out_features, self.bias is not None, self.weight
            )
        self._keep(weight, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, **kw) -> Self:
        """This rank's shard of an existing ``nn.Linear`` (same values, copied)."""
        mod = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            group=group,
            device="meta",  # no random draw: the values are copied
            dtype=linear.weight.dtype,
            **kw,
        ).to_empty(device=linear.weight.device)
        mod._keep(linear.weight, linear.bias)
        return mod

    def _read(self, input: torch.Tensor, shard_sizes, features: int, name: str):
        """``(input, its middle dimensions, this rank's sequence layout or None, problems)``: a bad input or ``shard_sizes`` becomes a problem the collective reports on
        every rank, and an empty stand-in input."""
        problems = _feature_problems(input, features, name)
        if problems:
            input = input.new_empty(0, features)
        mid = tuple(input.shape[1:-1])
        try:
            layout = ShardLayout.from_sizes(shard_sizes) if shard_sizes is not None else _current_shards()
        except (TypeError, ValueError) as exc:
            problems, layout = [*problems, f"shard_sizes: {exc}"], None
        return input, mid, layout, problems


class ColumnParallelLinear(_ShardedLinear):
    """``y = all_gather(x) @ weight.T + bias`` with the output features split over the group.

    Args:
        in_features: ``H``, the full input width (every rank sees all of it).
        out_features: ``F``, the full output width; rank ``r`` holds ``F_r`` of them (the
            ``torch.tensor_split`` split: the first ``F % W`` ranks get one more).
        bias: learn an additive bias (split like the outputs).
        group: the tensor-parallel process group (``None``: the default group).
        chunks, backend, save_gathered: passed to ``all_gather_matmul``.

    Shapes: input ``[T_r, *, H]`` (this rank's sequence shard) -> output ``[T, *, F_r]``.
    ``weight`` is ``[F_r, H]``, ``bias`` ``[F_r]``: rows ``out_slice`` of the weights that
    ``nn.Linear(H, F)`` draws from the same seed (see :meth:`reset_parameters`).
    """

    features_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        chunks: int | None = None,
        backend: str | None = None,
        save_gathered: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            group=group,
            chunks=chunks,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.save_gathered = save_gathered
        self.out_slice = self.features
        self.reset_parameters()

    def forward(
        self, input: torch.Tensor, shard_sizes: Sequence[int] | ShardLayout | None = None
    ) -> torch.Tensor:
        x, mid, layout, problems = self._read(input, shard_sizes, self.in_features, "in_features")
        y = all_gather_matmul(
            x.reshape(-1, self.in_features),
            self.weight,
            self.group,
            chunks=self.chunks,
            bias=self.bias,
            shard_sizes=_scaled(layout, math.prod(mid)),
            backend=self.backend,
            save_gathered=self.save_gathered,
            _problems=problems,
        )
        return y.view(-1, *mid, self.weight.shape[0])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, chunks={self.chunks}"
        )


class RowParallelLinear(_ShardedLinear):
    """``z = reduce_scatter(x @ weight.T) + bias`` with the input features split over the group.

    Args:
        in_features: ``F``, the full input width; rank ``r`` holds ``F_r`` of them (the
            ``torch.tensor_split`` split, matching ``ColumnParallelLinear``'s outputs).
        out_features: ``H``, the full output width.
        bias: learn an additive bias. It is replicated on every rank, added after the reduction,
            and its gradient is summed over the group in the backward, so every rank holds the
            full gradient (no extra sequence-parallel gradient reduction is needed).
        group: the tensor-parallel process group (``None``: the default group).
        chunks, backend: passed to ``matmul_reduce_scatter``.

    Shapes: input ``[T, *, F_r]`` -> output ``[T_r, *, H]`` (this rank's sequence shard).
    ``weight`` is ``[H, F_r]``, ``bias`` ``[H]``: columns ``in_slice`` of the weights that
    ``nn.Linear(F, H)`` draws from the same seed (see :meth:`reset_parameters`).
    """

    features_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        chunks: int | None = None,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            group=group,
            chunks=chunks,
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.in_slice = self.features
        self.reset_parameters()

    def forward(
        self, input: torch.Tensor, shard_sizes: Sequence[int] | ShardLayout | None = None
    ) -> torch.Tensor:
        x, mid, layout, problems = self._read(
            input, shard_sizes, self.weight.shape[1], "this rank's in_features"
        )
        if layout is None:
            layout = ShardLayout.even(x.shape[0], dist.get_world_size(self.group))
        z = matmul_reduce_scatter(
            x.reshape(-1, self.weight.shape[1]),
            self.weight,
            self.group,
            chunks=self.chunks,
            bias=self.bias,
            shard_sizes=_scaled(layout, math.prod(mid)),
            backend=self.backend,
            _problems=problems,
        )
        return z.view(-1, *mid, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, chunks={self.chunks}"
        )
