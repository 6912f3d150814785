"""The typer application: commands, and turning bad input into one line with exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer >= 0.25 vendors click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exceptions  # type: ignore[no-redef]

from mixprec import _errors
from mixprec.cli._common import CliError

app = typer.Typer(
    name="mixprec",
    help="Automatic mixed precision for PyTorch: a demo, a numerics doctor and the policy tables.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
policy_app = typer.Typer(help="Show, compare and explain autocast policies.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")

Out = Annotated[Path, typer.Option("--out", help="Directory for the written files.")]
Device = Annotated[str, typer.Option("--device", help="Device type to run on.")]
Imports = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option(
        "--import",
        metavar="MODULE",
        help="Import a module first, e.g. the one that registers a policy file's custom ops (repeatable).",
    ),
]


@app.command()
def demo(
    steps: Annotated[int, typer.Option("--steps", min=1, help="Training steps per run.")] = 150,
    device: Device = "cpu",
    out: Out = Path("mixprec-demo"),
) -> None:
    """Train a small CNN on scikit-learn's digits in float32, bfloat16 and float16 (+ GradScaler)."""
    from mixprec.cli._demo import run_demo

    run_demo(steps, device, out)


@app.command()
def doctor(
    target: Annotated[
        str, typer.Argument(metavar="TARGET", help="path/to/file.py:callable or package.module:callable.")
    ],
    device: Device = "cpu",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bfloat16 or float16.")] = None,  # noqa: UP045
    policy: Annotated[Optional[Path], typer.Option("--policy", help="A policy TOML file.")] = None,  # noqa: UP045
    out: Out = Path("mixprec-doctor"),
) -> None:
    """Compare a model op by op in float32 and under autocast; find the first inf/NaN and a fix."""
    from mixprec.cli._doctor import run_doctor

    run_doctor(target, device, dtype, policy, out)


@policy_app.command("show")
def policy_show(
    device: Annotated[str, typer.Argument(help="A device type (cpu, cuda, ...), policy name or TOML file.")],
    imports: Imports = None,
) -> None:
    """List the device's default policy, category by category."""
    from mixprec.cli._policy_cmd import import_modules, show

    import_modules(imports or [])
    show(device)


@policy_app.command("diff")
def policy_diff(
    a: Annotated[str, typer.Argument(help="A policy name (CPU, CUDA, ...) or TOML file.")],
    b: Annotated[str, typer.Argument(help="A policy name (CPU, CUDA, ...) or TOML file.")],
    imports: Imports = None,
) -> None:
    """The ops whose category differs between two policies."""
    from mixprec.cli._policy_cmd import diff, import_modules

    import_modules(imports or [])
    diff(a, b)


@policy_app.command("explain")
def policy_explain(
    op: Annotated[str, typer.Argument(help="An op name, e.g. softmax or aten::mm.")],
    device: Annotated[str, typer.Option("--device", help="Device type (any mixprec knows; nothing runs there).")] = (
        "cpu"
    ),
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bfloat16 or float16.")] = None,  # noqa: UP045
    policy: Annotated[Optional[str], typer.Option("--policy", help="A policy name or TOML file.")] = None,  # noqa: UP045
) -> None:
    """Why autocast runs OP in the dtype it does."""
    from mixprec.cli._policy_cmd import explain

    explain(op, device, dtype, policy)


@policy_app.command("layers")
def policy_layers(
    target: Annotated[
        str, typer.Argument(metavar="TARGET", help="path/to/file.py:callable or package.module:callable.")
    ],
    device: Device = "cpu",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bfloat16 or float16.")] = None,  # noqa: UP045
    policy: Annotated[str, typer.Option("--policy", help="A policy name or TOML file.")] = "FP8",
    choose: Annotated[
        bool, typer.Option("--choose/--no-choose", help="Keep layers out of fp8 as choose_fp8_layers does.")
    ] = True,
    keep: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--keep", metavar="PATTERN", help="A module path or pattern to keep out of fp8 (repeatable)."),
    ] = None,
    min_features: Annotated[
        int, typer.Option("--min-features", min=0, help="Keep layers with fewer in or out features out of fp8.")
    ] = 2048,
) -> None:
    """Each matmul-family call of TARGET's model by module path: the format it runs in, and why."""
    from mixprec.cli._policy_cmd import layers

    layers(target, device, dtype, policy, choose, keep or [], min_features)


def run(argv: list[str] | None = None) -> None:
    """Run the app; bad input prints ``mixprec: error: ...`` on one line and exits with 2."""
    if argv is not None and not (isinstance(argv, (list, tuple)) and all(isinstance(a, str) for a in argv)):
        raise TypeError(
            _errors.message("mixprec.cli.main: argv is invalid", "it holds the command line's words",
                            received={"argv": argv}, expected="None (sys.argv) or a list of str")
        )
    try:
        code = app(args=argv, prog_name="mixprec", standalone_mode=False)  # --help returns its exit code
    except CliError as error:
        _fail(str(error))
    except click_exceptions.UsageError as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # the help is printed already; name what is missing
            ctx = error.ctx
            listed = getattr(ctx.command, "list_commands", None) if ctx is not None else None
            _fail("missing command; expected one of: " + ", ".join(listed(ctx) if listed is not None else []))
        _fail(error.format_message().replace("\n", " ") + _received(error, argv))
    except typer.Abort:
        _fail("aborted")
    except typer.Exit as done:
        sys.exit(done.exit_code)
    if isinstance(code, int) and code:
        sys.exit(code)


def _received(error: click_exceptions.UsageError, argv: list[str] | None) -> str:
    """`` (received '-3')`` for an option's bad value (click's message names the option, not the value)."""
    param = getattr(error, "param", None)
    if not isinstance(error, click_exceptions.BadParameter) or param is None:
        return ""
    words = list(sys.argv[1:] if argv is None else argv)
    for i, word in enumerate(words):
        for opt in getattr(param, "opts", ()):
            if word.startswith(opt + "="):
                return f" (received {word[len(opt) + 1:]!r})"
            if word == opt and i + 1 < len(words):
                return f" (received {words[i + 1]!r})"
    return ""


def _fail(text: str) -> None:
    print(f"mixprec: error: {text}", file=sys.stderr)
    sys.exit(2)
