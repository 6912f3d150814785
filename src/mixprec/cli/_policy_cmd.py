"""``mixprec policy show|diff|explain``: the policy tables, read straight from the data."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mixprec.cli._common import CliError, device_type, low_dtype, text
from mixprec.engine import _devices


def import_modules(modules: list[str]) -> None:
    """Import each module (``package.module`` or ``path/to/file.py``), for the custom ops it registers."""
    import importlib
    import runpy

    for module in modules:
        try:
            if module.endswith(".py"):
                if not Path(module).is_file():
                    raise CliError(f"--import {module!r}: no such file")
                runpy.run_path(module)
            else:
                importlib.import_module(module)
        except ImportError as error:
            raise CliError(f"--import {module!r}: {error}") from None


def resolve(name: str) -> Any:
    """A policy by built-in name (``CPU``, ``cuda_documented``), device type (``cpu``) or TOML file."""
    import mixprec

    if name.endswith(".toml") or Path(name).is_file():
        if not Path(name).is_file():
            raise CliError(f"policy file {name!r} " + ("is not a file" if Path(name).exists() else "does not exist"))
        try:
            return mixprec.Policy.from_file(name)
        except (ValueError, TypeError, OSError) as error:
            raise CliError(f"policy file {name!r} is not a policy: {error}".replace("\n", " ")) from None
    if name.upper() in mixprec.policies.BUILTIN:
        return getattr(mixprec.policies, name.upper())
    if name in _devices.DEVICES:
        return getattr(mixprec.policies, _devices.DEVICES[name].policy)
    known = [*mixprec.policies.BUILTIN, *sorted(_devices.DEVICES)]
    raise CliError(f"unknown policy {name!r}; expected a TOML file or one of: {', '.join(known)}")


def _console() -> Any:
    from rich.console import Console

    return Console(width=max(Console().width, 100))


def show(device: str) -> None:
    """The policy a device uses by default, one row per category."""
    from rich.table import Table

    spec = _devices.DEVICES.get(device)
    policy = resolve(device)
    title = f"Policy {policy.name}"
    import mixprec

    release = mixprec.policies.describes(policy)
    if release is not None:
        title += f", {release}'s native autocast"
    if spec is not None:
        dtypes = ", ".join(_devices.dtype_name(d) for d in spec.supported_dtypes)
        title += f" (device {device}: default dtype {_devices.dtype_name(spec.default_dtype)}; supports {dtypes})"
    table = Table(title=text(title), show_lines=True)
    table.add_column("category", no_wrap=True)
    table.add_column("ops", justify="right")
    table.add_column("names")
    from mixprec.policies import Category

    for category in Category:
        ops = policy.ops(category.value)
        if ops:
            table.add_row(category.value, str(len(ops)), text(", ".join(ops)))
    console = _console()
    console.print(table)
    if policy.ops("fp8"):
        fields = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(policy.fp8_recipe).items())
        console.print(f"fp8 recipe: {fields}", highlight=False, markup=False)


def diff(a: str, b: str) -> None:
    """Every op the two policies treat differently."""
    from rich.table import Table

    first, second = resolve(a), resolve(b)
    names = (first.name, second.name) if first.name != second.name else (a, b)  # (with_ops keeps the base's name)
    changed = first.diff(second)
    recipes = {
        field: (getattr(first.fp8_recipe, field), getattr(second.fp8_recipe, field))
        for field in (f.name for f in dataclasses.fields(first.fp8_recipe))
        if getattr(first.fp8_recipe, field) != getattr(second.fp8_recipe, field)
    }
    console = _console()
    if not changed:
        console.print(f"{names[0]} and {names[1]} put every op in the same category.", highlight=False, markup=False)
    else:
        table = Table(title=text(f"{len(changed)} ops differ: {names[0]} vs {names[1]}"))
        table.add_column("op")
        table.add_column(text(names[0]))
        table.add_column(text(names[1]))
        for op, (left, right) in changed.items():
            table.add_row(text(op), left or "(unlisted)", right or "(unlisted)")
        console.print(table)
    if recipes:
        table = Table(title=text(f"fp8 recipes differ: {names[0]} vs {names[1]}"))
        table.add_column("field")
        table.add_column(text(names[0]))
        table.add_column(text(names[1]))
        for field, (left, right) in recipes.items():
            table.add_row(field, repr(left), repr(right))
        console.print(table)


def explain(op: str, device: str, dtype: str | None, policy_name: str | None = None) -> None:
    """Why autocast runs ``op`` as it does under ``policy_name`` (default: the device's), for float32 inputs and
    for inputs already in the low dtype. Any device mixprec knows: explain runs nothing there."""
    import mixprec

    if device not in _devices.DEVICES:
        device_type(device)  # (its error: the devices mixprec knows)
    low = low_dtype(device, dtype)
    policy = resolve(policy_name if policy_name is not None else device)
    try:
        answers = [
            mixprec.explain(op, device, policy, dtype=low, input_dtypes=(inputs,)) for inputs in (_float32(), low)
        ]
    except (ValueError, TypeError) as error:
        raise CliError(f"cannot explain op {op!r}: {error}".replace("\n", " ")) from None
    console = _console()
    for answer in answers:
        console.print(str(answer), highlight=False, markup=False)


def layers(
    target: str, device: str, dtype: str | None, policy_name: str, choose: bool, keep: list[str], min_features: int
) -> None:
    """Each matmul-family call of TARGET's model, by module path: the format it runs in under the policy and why
    (with ``choose``, after ``choose_fp8_layers`` kept the layers where fp8 hurts or loses out)."""
    import mixprec
    from mixprec.cli._doctor import load_target

    device = device_type(device)
    low = low_dtype(device, dtype)
    policy = resolve(policy_name)
    model, inputs, _ = load_target(target)
    model = model.to(device)
    inputs = tuple(t.to(device) if hasattr(t, "to") else t for t in inputs)
    console = _console()
    try:
        chosen = (mixprec.choose_fp8_layers(model, policy, keep=keep, min_features=min_features, example=inputs)
                  if choose else None)
    except ValueError as error:
        raise CliError(str(error).replace("\n", " ")) from None
    try:
        sites = mixprec.explain(model, device, policy, dtype=low, example=inputs)
    except Exception as error:  # the user's model failing is bad input
        raise CliError(f"TARGET {target!r} raised {type(error).__name__}: {error}".replace("\n", " ")) from None
    finally:
        if chosen is not None:
            chosen.remove()
    if chosen is not None:
        console.print(f"Layers (choose_fp8_layers, policy {policy.name}):", highlight=False, markup=False)
        console.print(str(chosen), highlight=False, markup=False)
        console.print()
    console.print(f"Call sites under {device} autocast to {_devices.dtype_name(low)}, policy {policy.name}:",
                  highlight=False, markup=False)  # fmt: skip
    console.print(str(sites), highlight=False, markup=False, soft_wrap=True)


def _float32() -> Any:
    import torch

    return torch.float32
