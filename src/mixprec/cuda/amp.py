"""``mixprec.cuda.amp``: torch.cuda.amp's names and signatures (no device_type)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._autocast import autocast as _autocast
from mixprec._custom import _check_callable
from mixprec._custom import custom_bwd as _custom_bwd
from mixprec._custom import custom_fwd as _custom_fwd
from mixprec.scaler import GradScaler as _GradScaler

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]


class autocast(_autocast):  # noqa: N801 - torch's name
    """``torch.cuda.amp.autocast``: mixprec.autocast on CUDA (default float16)."""

    def __new__(cls, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> Any:
        return _autocast.__new__(cls, "cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def custom_fwd(fwd: Callable[..., Any] | None = None, *, cast_inputs: torch.dtype | None = None) -> Any:
    """``torch.cuda.amp.custom_fwd``: mixprec.custom_fwd with device_type='cuda'."""
    return _custom_fwd(fwd, device_type="cuda", cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable[..., Any]) -> Any:
    """``torch.cuda.amp.custom_bwd``: mixprec.custom_bwd with device_type='cuda'."""
    _check_callable("custom_bwd", "bwd", bwd)  # None would make mixprec.custom_bwd return a decorator
    return _custom_bwd(bwd, device_type="cuda")


class GradScaler(_GradScaler):
    """``torch.cuda.amp.GradScaler``: the signature of the torch.cuda.amp reference, no device argument."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        super().__init__("cuda", init_scale, growth_factor, backoff_factor, growth_interval, enabled)
