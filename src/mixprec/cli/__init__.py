"""The ``mixprec`` command: ``demo``, ``doctor`` and ``policy``.

Its libraries (typer, rich, matplotlib, scikit-learn) are the ``cli`` extra: imported by the command
modules only, never by ``import mixprec``.
"""

from __future__ import annotations

import importlib.util
import sys

#: The cli extra's libraries, by import name.
EXTRA = ("typer", "rich", "matplotlib", "sklearn")


def main(argv: list[str] | None = None) -> None:
    """Run the command line (the ``mixprec`` console script)."""
    missing = [name for name in EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"mixprec: error: the mixprec command needs the cli extra ({', '.join(missing)} not installed); "
            "install it with: pip install 'mixprec[cli]'",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from mixprec.cli._app import run

    run(argv)


__all__ = ["main"]
