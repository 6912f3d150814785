"""Values built eagerly and read by torch.compile's trace without going stale.

Building a policy's rule table or a composite's twin cannot be traced, and a
dict that the trace has read stays frozen in the trace even when an eager call
grows it. A ``Shelf`` therefore keeps each value under its own attribute:
``fetch`` runs ``put`` eagerly (``assume_constant_result``: the attribute name
enters the trace as a constant) and then reads that attribute, which the trace
reads live and guards like any other.

Algorithm::

    name = put(shelf, key, build)        # eager: shelf.<name> = (key, build(key)) unless there
    return getattr(shelf, name)[1]       # traced: a guarded attribute read
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mixprec import _compile


class Shelf:
    """A namespace of ``(key, value)`` pairs, one attribute per key object (at most ``limit``)."""

    __slots__ = ("__dict__", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit


@_compile.constant
def put(shelf: Shelf, key: Any, build: Callable[[Any], Any]) -> str:
    """Store ``build(key)`` on ``shelf`` unless stored for this very object; returns the attribute."""
    name = f"v{id(key)}"
    entry = getattr(shelf, name, None)
    if entry is not None and entry[0] is key:
        return name
    value = build(key)
    if len(vars(shelf)) >= shelf.limit:
        vars(shelf).clear()
    setattr(shelf, name, (key, value))
    return name


def fetch(shelf: Shelf, key: Any, build: Callable[[Any], Any]) -> Any:
    """``build(key)``, built once per key object; traceable by torch.compile."""
    return getattr(shelf, put(shelf, key, build))[1]
