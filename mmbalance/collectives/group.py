"""Which process group a collective runs on, this process's place in it, and the device its small
control tensors live on: one helper for every entry point, so the same fault raises the same
exception everywhere. A leaf: it imports nothing else of the package."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["NotInitializedError", "comm_device", "group_timeout", "initialized", "world_of"]


class NotInitializedError(RuntimeError, ValueError):
    """``torch.distributed`` has no process group yet (a ``RuntimeError``, as torch's own, and a
    ``ValueError``: the ``group`` argument cannot name one)."""


def world_of(group=None) -> tuple[int, int]:
    """``(rank, world size)`` of this process in ``group`` (``None``: the default group).

    Raises:
        NotInitializedError: ``torch.distributed`` is not initialized.
        TypeError: ``group`` is not a process group.
        ValueError: this process is not a member of ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitializedError("torch.distributed is not initialized: call dist.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return rank, dist.get_world_size(group)


def initialized() -> bool:
    """Whether ``torch.distributed`` is available and has a default process group."""
    return dist.is_available() and dist.is_initialized()


def group_timeout(group=None) -> timedelta | None:
    """The timeout ``group`` (default: the world) was created with: the one a group this package
    creates for the user's job takes too (``new_group`` alone would use torch's 30-minute default).
    ``None`` when the process group does not say (then torch's default applies)."""
    pg = dist.group.WORLD if group is None else group
    if pg is None:
        return None
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def comm_device(group, like: torch.Tensor | None = None) -> torch.device:
    """The device a small control tensor must live on for ``group``'s backend."""
    if like is not None and like.is_cuda:
        return like.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
