"""Every code block in README.md and docs/ works as written.

* Python blocks run with pytest-examples, each in a fresh module (every block is self-contained), and what
  they print is checked against the ``#>`` lines under each ``print``. A block fenced as
  ```` ```python requires="cuda" ```` runs where CUDA is present. ``pytest tests/test_docs.py --update-examples``
  rewrites the ``#>`` lines from a run.
* ``console`` blocks are sessions: each ``$ mixprec ...`` line runs in-process and its output is compared
  with the lines under it (doctest's rules: ``...`` stands for any text, whitespace runs are equal).
* ``bash`` blocks are commands a reader types. The ones that take minutes (the release matrix, the
  benchmarks, installs) are not re-run inside the suite; each is checked to name what exists: the
  script and each flag its parser accepts, the nox session, the requirements file, the package extra, the
  ``mixprec`` subcommand and its options. The test command itself is what ``.ci/run`` runs.
"""

from __future__ import annotations

import doctest
import os
import pathlib
import re
import shlex
import sys

import pytest
import torch
from markdown_it import MarkdownIt
from pytest_examples import CodeExample, EvalExample, find_examples

import _cli

ROOT = pathlib.Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = [example for example in find_examples(*DOCUMENTS) if example.prefix.split()[0] in ("py", "python")]
SHELLS = ("bash", "console", "sh", "shell")
ALLOWED = {"python", "py", "bash", "console", "text", "toml", "json", "yaml", "sh", "shell"}


def _fences(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """(language, first line, text) of each fenced block of a markdown file."""
    tokens = MarkdownIt("commonmark").parse(path.read_text())
    return [(t.info.split()[0] if t.info else "", t.map[0] + 1, t.content) for t in tokens if t.type == "fence"]


BLOCKS = [(path, *fence) for path in DOCUMENTS for fence in _fences(path)]


def _id(path: pathlib.Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


@pytest.fixture(autouse=True)
def _as_a_fresh_script(tmp_path, monkeypatch):
    """Each block runs as a script would: in a scratch directory with examples/ beside it, and whatever
    process-wide state a framework sets (Trainer(bf16=True) writes ACCELERATE_MIXED_PRECISION into the
    environment, Accelerate keeps one state per process) is undone afterwards."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    environment = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environment)
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("example", PYTHON, ids=str)
def test_python_block(example: CodeExample, eval_example: EvalExample):
    if example.prefix_settings().get("requires") == "cuda" and not torch.cuda.is_available():
        pytest.skip("a CUDA block; this machine has no CUDA device")
    eval_example.set_config(line_length=110)
    if eval_example.update_examples:
        eval_example.run_print_update(example)
    else:
        eval_example.run_print_check(example)


def test_every_block_has_a_known_language():
    """An unlabelled block or a typo ("pyhton") would escape the checks above."""
    odd = [f"{_id(path, line)} {language!r}" for path, language, line, _ in BLOCKS if language not in ALLOWED]
    assert not odd, f"fenced blocks need one of {sorted(ALLOWED)} as their language: {odd}"
    assert len(PYTHON) == sum(language in ("python", "py") for _, language, _, _ in BLOCKS)


def _sessions() -> list[tuple[str, str, str]]:
    """(where, command, expected output) of each ``$ mixprec`` line of the console blocks."""
    found = []
    for path, language, line, text in BLOCKS:
        if language != "console":
            continue
        for match in re.finditer(r"^\$ (.+)\n((?:(?!\$ ).*\n)*)", text, flags=re.M):
            found.append((_id(path, line), match.group(1), match.group(2)))
    return found


@pytest.mark.parametrize(("where", "command", "expected"), _sessions(), ids=lambda value: value[:60])
def test_console_session(where, command, expected, capsys):
    argv = shlex.split(command)
    assert argv[0] == "mixprec", f"{where}: console blocks show `mixprec` sessions; got {command!r}"
    result = _cli.run(capsys, *argv[1:])
    assert result.code == 0, f"{where}: `{command}` exited {result.code}: {result.err}"
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    assert checker.check_output(expected, result.out, flags), (
        f"{where}: `{command}` printed\n{result.out}\nwhere the docs show\n{expected}"
    )


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for path, language, line, text in BLOCKS:
        if language not in ("bash", "sh", "shell"):
            continue
        for raw in text.replace("\\\n", " ").splitlines():
            code = raw.split(" #")[0].strip()
            if code and not code.startswith("#"):
                for part in re.split(r"\s*&&\s*", code):
                    found.append((_id(path, line), shlex.split(part)))
    return found


def _script_options(script: pathlib.Path) -> set[str]:
    """The options a script's argparse parser declares (read from its source: importing a benchmark
    script loads Transformers or Lightning, seconds per script)."""
    return set(re.findall(r"add_argument\(\s*[\"'](--[\w-]+)", script.read_text())) | {"--help"}


def _flags(argv: list[str]) -> list[str]:
    return [arg.split("=")[0] for arg in argv if arg.startswith("--")]


def _check_command(where: str, argv: list[str], capsys) -> None:
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    program, rest = argv[0], argv[1:]
    if program == "python" and rest[:1] == ["-m"] and rest[1] == "pytest":
        assert (ROOT / "tests").is_dir()
        return
    if program == "python":
        script = ROOT / rest[0]
        assert script.is_file(), f"{where}: no script {rest[0]}"
        missing = [flag for flag in _flags(rest) if flag not in _script_options(script)]
        assert not missing, f"{where}: {rest[0]} does not take {missing}"
    elif program == "pip":
        assert rest[0] == "install", f"{where}: {argv}"
        if "-r" in rest:
            assert (ROOT / rest[rest.index("-r") + 1]).is_file(), f"{where}: no {rest}"
        for spec in (arg for arg in rest if "[" in arg):
            extra = spec.split("[")[1].split("]")[0]
            assert f"\n{extra} = [" in (ROOT / "pyproject.toml").read_text(), f"{where}: no extra {extra!r}"
    elif program == "nox":
        if "-s" in rest:
            session = rest[rest.index("-s") + 1]
            from mixprec import _compat

            defined = re.findall(r"^def (\w+)\(session", (ROOT / "noxfile.py").read_text(), flags=re.M)
            names = {*defined, *(f"tests-{release}" for release in _compat.TESTED)}
            assert session in names, f"{where}: no nox session {session!r}"
    elif program == "mixprec":
        words = [arg for arg in rest if not arg.startswith("-") and arg.isidentifier()][:2]
        sub = ["doctor"] if words[:1] == ["doctor"] else words
        result = _cli.run(capsys, *sub[:2], "--help")
        assert result.code == 0, f"{where}: no command `mixprec {' '.join(sub)}`"
        missing = [flag for flag in _flags(rest) if flag not in result.out]
        assert not missing, f"{where}: `mixprec {' '.join(sub)}` does not take {missing}"
    elif program == "bash":  # a shell script of tools/, and the parts it takes (its `case` labels)
        script = ROOT / rest[0]
        assert script.is_file(), f"{where}: no script {rest[0]}"
        parts = set(re.findall(r"^(\w[\w-]*)\)$", script.read_text(), flags=re.M))
        missing = [arg for arg in rest[1:] if arg not in parts]
        assert not missing, f"{where}: {rest[0]} does not take {missing}"
    elif program in ("mkdocs", "cd", "export"):
        return
    else:
        raise AssertionError(f"{where}: no check for the command {program!r}; teach tests/test_docs.py one")


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=lambda value: str(value)[:60])
def test_shell_command_names_what_exists(where, argv, capsys):
    _check_command(where, argv, capsys)


def test_readme_commands_are_what_ci_runs():
    """The README's set-up block: the test command is the one .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    assert "pip install nox && nox" in readme
    assert "pip install nox && nox" in (ROOT / ".ci" / "run").read_text()
    assert "pip install -r requirements.txt && mixprec demo" in readme
