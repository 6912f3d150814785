"""Agreement across ranks, and the local tensors behind sharded gradients.

With FSDP (1 or 2) each rank holds a shard of the gradients, so an inf may be
visible on one rank only. Before a step is taken or skipped, ``found_inf`` is
all-reduced with MAX over the process group, so every rank decides alike.
"""

from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None and type(t).__name__ == "DTensor":
        return to_local()  # type: ignore[no-any-return]
    return t


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agree(found_inf: torch.Tensor, group: object | None) -> None:
    """All-reduce ``found_inf`` (MAX) in place across ``group`` if distributed is running."""
    if group is False or not _initialized():
        return
    torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
