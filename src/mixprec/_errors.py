"""One error and warning style for all of mixprec.

Messages read ``<what failed>: <why>. Received: name=value (type T). Expected ...
<how to fix>``, so that every user-facing text has the same shape.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any


class MixprecWarning(UserWarning):
    """Base class of every warning that mixprec emits."""


class AutocastDisabledWarning(MixprecWarning):
    """An autocast region was asked for but cannot run, so it is disabled."""


def describe(value: Any) -> str:
    """Render a received value and its type, as the error texts show them (on one line: a tensor's or a
    module's repr spans several)."""
    text = repr(value)
    if "\n" in text:
        text = " ".join(text.split())
    return f"{text} (type {type(value).__module__}.{type(value).__qualname__})"


def message(
    what: str,
    why: str,
    *,
    received: dict[str, Any] | None = None,
    expected: Iterable[str] | str | None = None,
    fix: str | None = None,
) -> str:
    """Compose a message in mixprec's single error style."""
    parts = [f"{what}: {why}."]
    if received:
        parts.append("Received: " + ", ".join(f"{k}={describe(v)}" for k, v in received.items()) + ".")
    if expected is not None:
        if not isinstance(expected, str):
            expected = "one of: " + ", ".join(expected)
        parts.append(f"Expected {expected}.")
    if fix:
        parts.append(fix)
    return " ".join(parts)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_stacklevel(skip: tuple[str, ...]) -> int:
    """The stacklevel of the first frame outside ``skip``'s directories, counted from ``warn``'s caller."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
        level += 1
    return level


def warn(text: str, category: type[MixprecWarning] = MixprecWarning, *, past_torch: bool = False) -> None:
    """Emit a mixprec warning attributed to the user's line: the first frame outside mixprec (and, with
    ``past_torch``, outside torch too, for a warning raised in a kernel that torch's code called)."""
    skip: tuple[str, ...] = (_PACKAGE_DIR,)
    if past_torch:
        import torch  # (mixprec's warnings are raised with torch imported; this module itself does not need it)

        skip += (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)
    warnings.warn(text, category, stacklevel=_user_stacklevel(skip))


def check_type(name: str, value: object, expected: type, *, optional: bool = False, what: str = "autocast") -> None:
    """Raise mixprec's TypeError unless ``value`` is an ``expected`` (or None, when ``optional``)."""
    if (optional and value is None) or isinstance(value, expected):
        return
    label = f"{expected.__module__}.{expected.__qualname__}" if expected.__module__ != "builtins" else expected.__name__
    raise TypeError(
        message(
            f"{what} argument {name!r} has the wrong type",
            f"it must be a {label}" + (" or None" if optional else ""),
            received={name: value},
            expected=f"a {label}",
        )
    )
