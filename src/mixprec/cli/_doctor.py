"""``mixprec doctor TARGET``: load the target, diagnose it, print the worst ops, write the reports.

TARGET is ``path/to/file.py:callable`` or ``package.module:callable``; the
callable takes no arguments and returns ``(model, example_inputs)`` or
``(model, example_inputs, loss_fn)``, where ``example_inputs`` is a tensor or a
tuple of positional arguments and ``loss_fn(output)`` returns a scalar.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mixprec.cli._common import CliError, device_type, low_dtype, out_dir, text
from mixprec.cli._report import write_html
from mixprec.diagnostics import LOSS, Diagnosis, OpReport, diagnose


@contextlib.contextmanager
def _as_target(location: str, directory: str) -> Iterator[None]:
    """Import and call a TARGET as ``python path/to/file.py`` or ``python -m package.module`` would see itself:
    ``sys.argv`` is ``[location]`` (a module-level argparse reads no mixprec argument) and ``directory`` (the
    file's, or the working directory for a module) leads ``sys.path``; a ``sys.exit`` in it is bad input."""
    argv, sys.argv = sys.argv, [location]
    sys.path.insert(0, directory)
    try:
        yield
    except SystemExit as exiting:
        raise CliError(f"TARGET {location!r} called sys.exit({exiting.code!r}) while mixprec ran it") from None
    finally:
        sys.argv = argv
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)


def _is_file(location: str) -> bool:
    return location.endswith(".py") or os.sep in location or "/" in location


def _directory(location: str) -> str:
    """What leads ``sys.path`` for a TARGET: a file's own directory, else the working directory."""
    return str(Path(location).resolve().parent) if _is_file(location) else os.getcwd()


def _load_module(location: str) -> Any:
    if _is_file(location):
        path = Path(location)
        if not path.is_file():
            raise CliError(f"TARGET file {location!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"_mixprec_target_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise CliError(f"TARGET file {location!r} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        try:
            with _as_target(location, _directory(location)):  # (so the file can import its neighbours)
                spec.loader.exec_module(module)
        except Exception as error:  # (a syntax error, a missing package, the file's own raise: bad input)
            if isinstance(error, CliError):
                raise
            raise CliError(_raised(f"TARGET file {location!r}", error, "as it was imported")) from None
        return module
    try:
        with _as_target(location, _directory(location)):  # (as python -m finds a module in the working directory)
            return importlib.import_module(location)
    except ImportError as error:
        raise CliError(f"TARGET module {location!r} cannot be imported: {error}") from None
    except Exception as error:
        if isinstance(error, CliError):
            raise
        raise CliError(_raised(f"TARGET module {location!r}", error, "as it was imported")) from None


def _raised(what: str, error: BaseException, when: str) -> str:
    return f"{what} raised {type(error).__name__} {when}: {error}".replace("\n", " ")


def load_target(target: str) -> tuple[torch.nn.Module, tuple[Any, ...], Callable[..., Any] | None]:
    """Import TARGET and call it; check that it returns (model, inputs[, loss_fn])."""
    location, sep, name = target.rpartition(":")
    if not sep or not location or not name:
        raise CliError(f"TARGET {target!r} must be path/to/file.py:callable or package.module:callable")
    factory = getattr(_load_module(location), name, None)
    if factory is None:
        raise CliError(f"TARGET {target!r}: {location!r} has no attribute {name!r}")
    if not callable(factory):
        raise CliError(f"TARGET {target!r}: {name!r} is not callable (type {type(factory).__name__})")
    try:
        with _as_target(location, _directory(location)):
            made = factory()
    except Exception as error:  # any failure of the user's factory is bad input (CliError: its sys.exit)
        if isinstance(error, CliError):
            raise
        raise CliError(f"TARGET {target!r} raised {type(error).__name__}: {error}".replace("\n", " ")) from None
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise CliError(
            f"TARGET {target!r} returned {type(made).__name__}; expected (model, example_inputs) "
            "or (model, example_inputs, loss_fn)"
        )
    model, inputs, loss_fn = made if len(made) == 3 else (*made, None)
    if not isinstance(model, torch.nn.Module):
        raise CliError(f"TARGET {target!r} returned a {type(model).__name__} as model; expected a torch.nn.Module")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not isinstance(inputs, (tuple, list)):
        kind = type(inputs).__name__
        raise CliError(f"TARGET {target!r} returned {kind} as example_inputs; expected a tensor or tuple")
    if loss_fn is not None and not callable(loss_fn):
        raise CliError(f"TARGET {target!r} returned a {type(loss_fn).__name__} as loss_fn; expected a callable")
    return model, tuple(inputs), loss_fn


def _policy(path: Path | None) -> Any:
    if path is None:
        return None
    import mixprec

    if not path.is_file():
        raise CliError(f"--policy file {str(path)!r} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        return mixprec.Policy.from_file(path)
    except (ValueError, TypeError, OSError) as error:
        raise CliError(f"--policy file {str(path)!r} is not a policy: {error}".replace("\n", " ")) from None


def _fmt(value: float | None, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


def short(source: str) -> str:
    """``file:line`` relative to the working directory when inside it."""
    try:
        return os.path.relpath(source) if source and not os.path.relpath(source).startswith("..") else source
    except ValueError:
        return source


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "float8_e4m3fn": "e4m3",
          "float8_e5m2": "e5m2"}


def _dtypes(names: list[str]) -> str:
    return ",".join(_SHORT.get(n, n) for n in names)


def _op(name: str) -> str:
    return name.removeprefix("torch.").removeprefix("nn.functional.")


def _table(diagnosis: Diagnosis) -> Any:
    from rich.table import Table

    table = Table(title=f"Worst ops under {diagnosis.device} autocast ({str(diagnosis.dtype).removeprefix('torch.')})")
    for name in ("#", "op", "module", "source", "dtypes", "casts", "abs err", "rel err", "overflow", "underflow",
                 "inf/NaN"):  # fmt: skip
        table.add_column(name, no_wrap=name != "op")
    for r in diagnosis.worst():
        table.add_row(
            str(r.index), text(_op(r.op)), text(r.module or "(model)"), text(os.path.basename(r.source)),
            f"{_dtypes(r.input_dtypes)} -> {_dtypes(r.output_dtypes)}", str(r.casts), _fmt(r.max_abs_error),
            _fmt(r.max_rel_error), _fmt(r.overflow_fraction, ".1%"), _fmt(r.underflow_fraction, ".1%"),
            str(r.nonfinite_outputs),
        )  # fmt: skip
    return table


def _fp8_table(diagnosis: Diagnosis) -> Any:
    """One row per call site that ran its GEMM in fp8, in execution order; None where none did."""
    from rich.table import Table

    sites = [r for r in diagnosis.rows if r.fp8_format is not None]
    if not sites:
        return None
    table = Table(title="fp8 call sites")
    for name in ("#", "op", "module", "fp8", "input amax", "weight amax", "saturated", "flushed", "GEMM err",
                 "grad", "grad amax", "grad saturated", "grad flushed"):  # fmt: skip
        table.add_column(name, no_wrap=True)
    for r in sites:
        table.add_row(
            str(r.index), text(_op(r.op)), text(r.module or "(model)"), _SHORT.get(r.fp8_format or "", r.fp8_format),
            _fmt(r.fp8_amax, ".3g"), _fmt(r.fp8_amax_weight, ".3g"), _fmt(r.fp8_saturated, ".2%"),
            _fmt(r.fp8_flushed, ".2%"), _fmt(r.fp8_error), _SHORT.get(r.fp8_grad_format or "", "-"),
            _fmt(r.fp8_grad_amax, ".3g"), _fmt(r.fp8_grad_saturated, ".2%"), _fmt(r.fp8_grad_flushed, ".2%"),
        )  # fmt: skip
    return table


def _summary(diagnosis: Diagnosis) -> list[str]:
    first: OpReport | None = diagnosis.first
    if first is None:
        return [f"No inf/NaN under autocast ({diagnosis.nonfinite_reference} in the float32 run)."]
    where = "loss_fn" if first.module == LOSS else f"module {first.module or '(model)'!r}"
    lines = [
        f"First inf/NaN: {first.op} (op #{first.index}, {first.phase}) in {where} at {short(first.source)}",
    ]
    if not first.produced_nonfinite and diagnosis.nonfinite_autocast <= diagnosis.nonfinite_reference:
        lines.append(
            f"float32 makes as many ({diagnosis.nonfinite_reference}): not autocast's doing, and no module "
            "policy fixes it; look at the model or its inputs"
        )
    suggestion = diagnosis.suggestion
    if suggestion is not None:
        after = suggestion.nonfinite_after
        left = "no inf/NaN left" if after == 0 else f"{after} inf/NaN, as many as float32"
        verdict = f"fixes it: {left}" if suggestion.fixes else f"still {after} inf/NaN"
        lines.append(f"Suggestion: {suggestion.code}   (re-run with it: {verdict})")
    return lines


def run_doctor(target: str, device: str, dtype: str | None, policy: Path | None, out: Path) -> None:
    """The ``mixprec doctor`` command."""
    from rich.console import Console

    device = device_type(device)
    low = low_dtype(device, dtype)
    out = out_dir(out)
    chosen = _policy(policy)
    loaded = load_target(target)
    console = Console(width=max(Console().width, 150))
    with console.status("Running float32 and autocast passes..."):
        try:
            diagnosis = diagnose(loaded, device, low, chosen)
        except Exception as error:  # the model failed (wrong inputs, a failing loss_fn): bad input, as in load_target
            text = f"TARGET {target!r} failed when run: {type(error).__name__}: {error}"
            raise CliError(text.replace("\n", " ")) from None
        except SystemExit as exiting:  # (in its forward or loss_fn: the doctor has no report to give)
            raise CliError(f"TARGET {target!r} called sys.exit({exiting.code!r}) while the doctor ran it") from None
    console.print(_table(diagnosis))
    fp8 = _fp8_table(diagnosis)
    if fp8 is not None:
        console.print(fp8)
    for line in _summary(diagnosis):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    os.makedirs(out, exist_ok=True)
    report = diagnosis.to_json(target)
    (out / "report.json").write_text(json.dumps(_finite(report), indent=2, allow_nan=False))
    write_html(report, out / "report.html")
    console.print(f"Wrote {out / 'report.json'} and {out / 'report.html'}", highlight=False, markup=False)


def _finite(value: Any) -> Any:
    """``value`` (the report) with each float that is not finite (an fp8 call's inf amax) as the string JSON
    can hold: ``"inf"``, ``"-inf"`` or ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
