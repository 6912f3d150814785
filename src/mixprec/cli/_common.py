"""What the commands share: one-line usage errors and checking device and dtype names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mixprec.engine import _devices


class CliError(Exception):
    """Bad input: printed as one line, exit code 2, no traceback."""


def device_type(name: str) -> str:
    """A device type mixprec knows and this machine has."""
    spec = _devices.DEVICES.get(name)
    if spec is None:
        raise CliError(f"unknown device {name!r}; expected one of: {', '.join(sorted(_devices.DEVICES))}")
    if not spec.available():
        raise CliError(f"device {name!r} is not available on this machine; try --device cpu")
    return name


def low_dtype(device: str, name: str | None) -> torch.dtype:
    """The low-precision dtype named ``name`` (default: the device's autocast default)."""
    spec = _devices.DEVICES[device]
    if name is None:
        return spec.default_dtype
    names = {_devices.dtype_name(d): d for d in spec.supported_dtypes}
    if name not in names:
        raise CliError(f"unknown dtype {name!r} for {device} autocast; expected one of: {', '.join(names)}")
    return names[name]


def out_dir(out: Path) -> Path:
    """``--out``, checked before any work: a directory, or a path where one can be made."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} is a file; expected a directory (made if missing)")
    try:  # (made now, so that a path no directory can be made at fails before the run, not after it)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CliError(f"--out {str(out)!r} cannot be made: {error.strerror or error}") from None
    return out


def text(value: str) -> Any:
    """``value`` as Rich text that is never read as markup: a user's name, path or module key printed in a table
    (``model[v2].py``, a key or policy name holding ``[/]``, which Rich's markup dropped or refused)."""
    from rich.text import Text

    return Text(value)
