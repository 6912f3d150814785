"""How many examples the property tests draw in this run.

The newest release's whole suite draws every example (``examples(n)`` is ``n``). The runs on older releases
(``--version-sensitive``, ``--not-newest``: ``tests/conftest.py`` sets ``SHARE``) draw a third: the rules those
tests hold mixprec to do not change between releases, and the release's internals they touch (dynamo,
AOTAutograd, inductor, FX, the dispatcher) are met by every example, so a third of them still meets each one,
and CI's time limit covers the release matrix. Derandomized, the third is the first third of the same examples.
"""

from __future__ import annotations

SHARE = 1.0  # conftest.py: a third on a run that is not the newest release's whole suite


def examples(n: int) -> int:
    """The examples to draw this run, of the ``n`` the whole suite draws (at least one)."""
    return max(1, round(n * SHARE))
