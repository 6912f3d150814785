"""Autocast state: thread-local, per device type, restored on exit.

Each thread has one ``ThreadState``: the settings of every device type, the
nesting depth shared by all devices, the cast cache, and the single
interception mode that is on the torch-function mode stack while any region is
open. A new thread starts with no region open, so autocast is off there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from mixprec import _cast
from mixprec.policies import Policy


@dataclasses.dataclass(frozen=True)
class Context:
    """One enabled device's autocast settings, as the mode reads them."""

    device_type: str
    dtype: torch.dtype
    policy: Policy
    rules: dict[Callable[..., Any], Callable[..., Any]]
    cache_enabled: bool
    compiled: Any  # mixprec._mode.Compiled: the rules above, and which composites to expand
    emulate: bool = False  # compute lower_precision_fp ops with float32 kernels (mixprec._emulate)


@dataclasses.dataclass(frozen=True)
class DeviceSetting:
    enabled: bool
    dtype: torch.dtype
    policy: Policy
    cache_enabled: bool
    emulate: bool = False


class ThreadState(threading.local):
    def __init__(self) -> None:
        self.devices: dict[str, DeviceSetting] = {}
        self.saved: list[tuple[str, DeviceSetting | None]] = []
        self.contexts: tuple[Context, ...] = ()
        self.cache: _cast.Cache = {}
        self.mode: Any = None
        self.expanding: list[Callable[..., Any]] = []
        self.module_policies: list[Policy] = []  # set_module_policy: innermost last

    @property
    def nesting(self) -> int:
        return len(self.saved)


_state = ThreadState()


def get() -> ThreadState:
    """This thread's autocast state."""
    return _state
