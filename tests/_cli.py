"""Run the ``mixprec`` command in-process, as the console script does, and capture what it prints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mixprec.cli import main

TARGETS = Path(__file__).parent / "cli_targets"
PLANTED = TARGETS / "planted_overflow.py"


@dataclasses.dataclass
class Result:
    code: int
    out: str
    err: str


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    """``mixprec *argv``: the exit code (0 when it returns) and its stdout/stderr."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


def planted_line() -> int:
    """The line of the planted overflow (``x * 1e5``) in the fixture."""
    lines = PLANTED.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "x * 1e5" in line)
