"""mixprec's own thread-local state, beside torch's autocast state.

A region sets torch's autocast state for its device (enabled, dtype, cache,
nesting), so everything that asks torch sees it. What torch has no slot for,
the policy and the compute choice, lives here: for each device, the innermost
mixprec ``Setting`` of this thread. The kernels at the Autocast keys read it;
a thread with no setting for a device (a plain ``torch.autocast`` region) gets
the device's native behaviour.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from mixprec.policies import Policy


@dataclasses.dataclass(frozen=True, eq=False)
class Setting:
    """What a mixprec region adds to torch's state for one device: the policy and the compute."""

    device_type: str
    policy: Policy
    emulate: bool = False  # every lower_precision_fp op computes emulated
    emulate_ops: frozenset[str] = frozenset()  # these overloads too, under native compute (compute="auto")
    from_module: bool = False  # set by set_module_policy's hook (which runs again in a checkpoint's recompute)

    @property
    def key(self) -> tuple[str, int, bool, frozenset[str], bool]:
        return (self.device_type, id(self.policy), self.emulate, self.emulate_ops, self.from_module)


@dataclasses.dataclass
class Frame:
    """One open region level: what to restore when it closes."""

    device_type: str
    pushed: bool  # whether the level set a mixprec setting (a disabled level keeps the one in force)
    previous: Setting | None  # this thread's mixprec setting for the device before the level
    torch_state: Any  # what torch.amp._enter_autocast returned, for _exit_autocast; None if not entered


class ThreadState(threading.local):
    def __init__(self) -> None:
        self.active: dict[str, Setting] = {}  # device type -> innermost mixprec setting
        self.frames: list[Frame] = []
        self.module_policies: list[Policy] = []  # set_module_policy: innermost last

    @property
    def nesting(self) -> int:
        return len(self.frames)


_state = ThreadState()


def get() -> ThreadState:
    """This thread's mixprec state."""
    return _state


def torch_enabled(device_type: str) -> bool:
    """Whether torch's autocast is on for ``device_type`` in this thread (whoever turned it on)."""
    return bool(torch.is_autocast_enabled(device_type))
