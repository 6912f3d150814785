"""The ``mixprec`` command: ``demo``, ``doctor`` and ``policy``.

typer, rich and matplotlib are imported here and in the command modules only,
never by ``import mixprec``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """Run the command line (the ``mixprec`` console script)."""
    from mixprec.cli._app import run

    run(argv)


__all__ = ["main"]
