"""Which process group a collective runs on, and this process's place in it: one helper for every
entry point, so the same fault raises the same exception everywhere."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["NotInitializedError", "group_timeout", "world_of"]


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
