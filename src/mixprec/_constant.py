"""``constant``: mark a function as ``torch.compiler.assume_constant_result`` does, without importing dynamo.

Under torch.compile, dynamo runs a marked function eagerly and puts its result in
the trace as a constant. Marking is an attribute, so importing mixprec imports
no dynamo (about a second); a test checks the mark against torch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def constant(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
