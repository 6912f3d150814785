"""The engine's one cache shape: a dict bounded in size, for memos keyed by content.

Policies, settings and their derived tables are immutable data, so a memo keyed by what they hold (never by
``id()``) answers for an equal object made later (a policy written inline in a training step is a new object
on every step) and cannot confuse two objects that happened to share an address. Lookups are plain
``dict.get`` calls, as the kernels' hot path needs; ``put`` evicts the oldest entry at the size limit.
"""

from __future__ import annotations

import threading
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

_putting = threading.Lock()  # (puts are misses: never the kernels' hot path)
#: Every memo made here, for ``clear_all`` (the documented reset, ``mixprec.engine.reset``).
_all: list[Memo] = []  # type: ignore[type-arg]


class Memo(dict[K, V]):
    """A dict that holds at most ``size`` entries: ``put`` drops the oldest first."""

    def __init__(self, size: int, name: str, *, reset: bool = True) -> None:
        super().__init__()
        self.size = size
        self.name = name
        if reset:  # (one an object owns, ``reset=False``, goes with the object)
            _all.append(self)

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (dropping the oldest entry when full) and return it."""
        with _putting:  # (two threads evicting at once would both take the same oldest key)
            if key not in self and len(self) >= self.size:
                del self[next(iter(self))]
            self[key] = value
        return value

    def __repr__(self) -> str:
        return f"Memo({self.name!r}, {len(self)}/{self.size})"


def clear_all() -> None:
    """Empty every memo (what they hold is derived, so this changes no behaviour, only cost)."""
    for memo in _all:
        memo.clear()
