"""Agreement across ranks, and the local tensors behind sharded gradients.

With FSDP (1 or 2) each rank holds a shard of the gradients, so an inf may be
visible on one rank only. Before a step is taken or skipped, ``found_inf`` is
all-reduced with MAX over the process group, so every rank decides alike.
"""

from __future__ import annotations

import sys

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    if type(t) is torch.Tensor:  # the common case, once per gradient per step: no attribute lookup
        return t
    # A DTensor exists only once torch.distributed.tensor is imported; importing it here would cost every user.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.to_local()  # type: ignore[no-any-return]
    return t


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def active(group: object | None) -> bool:
    """Whether ranks agree on found_inf: distributed is running and agreement is not turned off."""
    return group is not False and _initialized()


def agree(found_inf: torch.Tensor, group: object | None, via: torch.device | None = None) -> None:
    """All-reduce ``found_inf`` (MAX) in place across ``group`` if distributed is running.

    ``via`` is the scaler's device: a flag on another device (CPU-offloaded
    gradients, FSDP's ``CPUOffload``) is reduced through a copy there, since a
    NCCL group cannot reduce CPU tensors. torch's ShardedGradScaler does the same.
    """
    if not active(group):
        return
    if via is None or found_inf.device == via:
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
        return
    moved = found_inf.to(via)
    torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
    found_inf.copy_(moved)
