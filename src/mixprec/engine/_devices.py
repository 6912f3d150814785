"""The devices autocast knows: default and supported dtypes, default policy.

Code that needs a device's dtypes or its default policy reads them here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from mixprec import _errors


def _always() -> bool:
    return True


def _backend_available(name: str) -> Callable[[], bool]:
    def available() -> bool:
        module = getattr(torch, name, None)
        is_available = getattr(module, "is_available", None)
        return bool(is_available()) if is_available is not None else False

    return available


#: torch's initial autocast dtype per device type (its state is per thread: read once, in a new thread).
_torch_initial: dict[str, torch.dtype] = {}


def torch_initial_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype torch starts each thread with for the device type (None if torch has no state
    for it)."""
    if not _torch_initial:
        def read() -> None:
            for name in DEVICES:
                if torch_knows(name):
                    _torch_initial[name] = torch.get_autocast_dtype(name)

        reader = threading.Thread(target=read, name="mixprec-read-autocast-defaults")
        reader.start()
        reader.join()
    return _torch_initial.get(device_type)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What autocast does on one device type."""

    name: str
    documented_dtype: torch.dtype | None  # the AMP references' default; None: torch's (``torch_initial_dtype``)
    supported_dtypes: tuple[torch.dtype, ...]
    policy: str  # attribute name in mixprec.policies
    available: Callable[[], bool]

    @property
    def default_dtype(self) -> torch.dtype:
        """The dtype of a region made with no ``dtype`` outside any region: the references' where they name
        one (CPU and XPU bfloat16, CUDA float16), else torch's (float16 where torch has no state)."""
        if self.documented_dtype is not None:
            return self.documented_dtype
        return torch_initial_dtype(self.name) or torch.float16


#: The lower-precision dtypes a region can run in: the one place that lists them (the FX pass, the doctor's
#: comparison and the device table below read it).
LOW_PRECISION = (torch.bfloat16, torch.float16)
_LOW = LOW_PRECISION[::-1]  # devices whose default is float16 list it first

DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("cpu", torch.bfloat16, (torch.bfloat16, torch.float16), "CPU", _always),
        DeviceSpec("cuda", torch.float16, _LOW, "CUDA", _backend_available("cuda")),
        DeviceSpec("xpu", torch.bfloat16, (torch.bfloat16, torch.float16), "XPU", _backend_available("xpu")),
        DeviceSpec("mps", None, _LOW, "CUDA", _backend_available("mps")),
        DeviceSpec("mtia", None, _LOW, "CUDA", _backend_available("mtia")),
        DeviceSpec("maia", None, _LOW, "CUDA", _backend_available("maia")),
        DeviceSpec("hpu", None, _LOW, "CUDA", _backend_available("hpu")),
        DeviceSpec("xla", None, _LOW, "CUDA", _always),
        DeviceSpec("ipu", None, _LOW, "CUDA", _always),
    )
}


def torch_knows(device_type: str) -> bool:
    """Whether torch has autocast state for the device type (it may still be absent from this machine)."""
    try:
        return bool(torch._C._is_autocast_available(device_type))
    except RuntimeError:
        return False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec(device_type: object) -> DeviceSpec:
    """Look up a device type, with mixprec's error for anything unknown."""
    if not isinstance(device_type, str):
        raise TypeError(
            _errors.message(
                "autocast device_type is invalid",
                "it must be a string naming a device type",
                received={"device_type": device_type},
                expected=sorted(DEVICES),
            )
        )
    found = DEVICES.get(device_type)
    if found is None:
        raise ValueError(
            _errors.message(
                "autocast device_type is unknown",
                "mixprec has no autocast rules for this device type",
                received={"device_type": device_type},
                expected=sorted(DEVICES),
                fix="Pass the device type without an index, e.g. 'cuda' rather than 'cuda:0'.",
            )
        )
    return found


def check_dtype(where: str, device_type: str, dtype: object) -> None:
    """Raise mixprec's error unless ``dtype`` is a low-precision dtype the device's autocast supports."""
    supported = spec(device_type).supported_dtypes
    if isinstance(dtype, torch.dtype) and dtype in supported:
        return
    raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
        _errors.message(
            f"{where}: dtype is invalid",
            f"it must be a low-precision dtype {device_type} autocast supports",
            received={"dtype": dtype},
            expected=[dtype_name(d) for d in supported],
        )
    )


def usable(found: DeviceSpec, dtype: torch.dtype) -> bool:
    """Whether a region on ``found``'s device in ``dtype`` can run; warns (the region is then disabled) if not."""
    if not found.available():
        _errors.warn(
            _errors.message(
                "autocast disabled",
                f"device_type {found.name!r} is not available on this machine",
                fix=f"Use a device type that is available, e.g. 'cpu', or run where {found.name} is present.",
            ),
            _errors.AutocastDisabledWarning,
        )
        return False
    if dtype not in found.supported_dtypes:
        _errors.warn(
            _errors.message(
                "autocast disabled",
                f"{found.name} autocast does not support this dtype",
                received={"dtype": dtype},
                expected=[dtype_name(d) for d in found.supported_dtypes],
            ),
            _errors.AutocastDisabledWarning,
        )
        return False
    return True


def dtype_in_force(device_type: str) -> torch.dtype:
    """What ``dtype=None`` means for a region made now, as ``torch.autocast`` reads it: the autocast dtype in
    force for the device (an enclosing region's, or ``torch.set_autocast_dtype``'s). Outside any region, torch's
    initial value stands for the device's default (``default_dtype``: the XPU guide's bfloat16 where torch
    starts XPU at float16)."""
    found = spec(device_type)
    if not torch_knows(device_type):
        return found.default_dtype
    current: torch.dtype = torch.get_autocast_dtype(device_type)
    if (
        current is not found.documented_dtype
        and found.documented_dtype is not None
        and not torch.is_autocast_enabled(device_type)
        and current is torch_initial_dtype(device_type)
    ):
        return found.documented_dtype
    return current


def enabled() -> list[str]:
    """The device types whose autocast is on in this thread (torch's state)."""
    return [d for d in DEVICES if torch_knows(d) and torch.is_autocast_enabled(d)]
