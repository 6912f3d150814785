"""``mixprec.cpu.amp``: torch.cpu.amp's names, for a one-line switch."""

from __future__ import annotations

from typing import Any

import torch

from mixprec._autocast import autocast as _autocast

__all__ = ["autocast"]


class autocast(_autocast):  # noqa: N801 - torch's name
    """``torch.cpu.amp.autocast``: mixprec.autocast on the CPU (default bfloat16)."""

    def __new__(cls, enabled: bool = True, dtype: torch.dtype = torch.bfloat16, cache_enabled: bool = True) -> Any:
        return _autocast.__new__(cls, "cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16, cache_enabled: bool = True) -> None:
        super().__init__("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
