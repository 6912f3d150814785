"""A dispatch-level cast counter, shared by the tests that compare cast counts with native autocast."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountCasts(TorchDispatchMode):
    """Counts ``aten::_to_copy`` calls (every dtype cast, native autocast's and mixprec's) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))
