"""A policy as plain data: the dict of ``to_dict`` / ``from_dict`` and its TOML file.

The dict holds a policy as changes to a built-in one, so that a file beside a
training config stays short and says what the user changed::

    name = "finetune"            # optional; defaults to base, or "custom"
    base = "CPU"                 # optional; a built-in policy (mixprec.policies.BUILTIN)
    without_ops = ["cat"]        # listed by base, not autocast here

    [ops]                        # category -> ops moved there
    fp32 = ["softmax", "mylib::rotary"]

Without ``base`` the table is exactly ``[ops]``. ``from_dict`` rebuilds the
table as ``base.table``, minus ``without_ops``, plus ``[ops]``, which is what
``to_dict`` wrote, so the two round-trip.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from mixprec import _errors
from mixprec.policies import _builtin, _names
from mixprec.policies._builtin import BUILTIN
from mixprec.policies._category import category_of
from mixprec.policies._recipe import Fp8Recipe

KEYS = ("name", "base", "ops", "without_ops", "fp8")


def _builtin_names() -> tuple[str, ...]:
    return tuple(BUILTIN)


def base_table(base: str | None) -> Mapping[str, Any]:
    """The table of the built-in policy ``base`` (empty for None)."""
    if base is None:
        return {}
    return _builtin.table_of(base)


def _bad(where: str, why: str, name: str, value: object, expected: object) -> ValueError:
    exp = expected if isinstance(expected, str) else list(expected)  # type: ignore[call-overload]
    return ValueError(_errors.message(f"Invalid policy {where}", why, received={name: value}, expected=exp))


def _string_list(where: str, key: str, value: object) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise _bad(where, f"{key} must list op names as strings", key, value, "a list of strings")
    return list(items)


def check(
    data: object, where: str = "dict"
) -> tuple[str, str | None, dict[str, list[str]], list[str], Fp8Recipe]:
    """Validate a policy dict: (name, base, {category: names}, without_ops, fp8 recipe), names checked."""
    if not isinstance(data, Mapping):
        raise TypeError(
            _errors.message(f"Invalid policy {where}", "it must be a mapping", received={"data": data},
                            expected="a dict with keys: " + ", ".join(KEYS))
        )
    if not data:
        raise _bad(where, "it is empty", "data", data, "at least one of the keys " + ", ".join(KEYS))
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise _bad(where, "it has an unknown key", "key", unknown[0], KEYS)
    base = data.get("base")
    if base is not None and base not in _builtin_names():
        raise _bad(where, "base must name a built-in policy", "base", base, _builtin_names())
    name = data.get("name", base or "custom")
    if not isinstance(name, str):
        raise _bad(where, "name must be a string", "name", name, "a string")
    listed = base_table(base)
    ops = data.get("ops", {})
    if not isinstance(ops, Mapping):
        raise _bad(where, "ops must map categories to op names", "ops", ops, "a table such as {fp32 = ['softmax']}")
    # Without a base the table is the file's own: what it lists, it lists (a documented list's spellings too).
    own = {n.strip() for names in ops.values() for n in _string_list(where, "ops", names)} if base is None else ()
    moved: dict[str, list[str]] = {}
    for category, given in ops.items():
        names = [_names.edit_name(n, listed, own=own) for n in _string_list(where, "ops", given)]
        _names.check_dtype_category(category_of(category), names)
        moved[category_of(category).value] = names
    without = _string_list(where, "without_ops", data.get("without_ops", []))
    removed = [_names.edit_name(n, listed, removing=True) for n in without]
    check_once(where, moved, removed)
    return name, base, moved, removed, _recipe(where, data.get("fp8", {}))


def _recipe(where: str, given: object) -> Fp8Recipe:
    """The ``fp8`` table's recipe: the default's fields, those given replaced (each checked by ``Fp8Recipe``)."""
    fields = [f.name for f in dataclasses.fields(Fp8Recipe)]
    if not isinstance(given, Mapping):
        raise _bad(where, "fp8 must map recipe fields to values", "fp8", given, "a table such as {scaling = 'rowwise'}")
    unknown = [k for k in given if k not in fields]
    if unknown:
        raise _bad(where, "fp8 has an unknown field", "field", unknown[0], fields)
    return Fp8Recipe(**given)


def check_once(where: str, moved: dict[str, list[str]], removed: list[str]) -> None:
    seen: dict[str, str] = {}
    for category, names in [*moved.items(), ("without_ops", removed)]:
        for n in names:
            if seen.setdefault(n, category) != category:
                raise _bad(where, f"an op is listed under both {seen[n]} and {category}", "op", n,
                           "each op at most once")


def to_toml(data: Mapping[str, Any]) -> str:
    """Render ``to_dict``'s output as TOML (strings, lists of strings, and the fp8 recipe's scalars)."""
    lines = [f"{key} = {_toml_value(data[key])}" for key in ("name", "base", "without_ops") if key in data]
    lines += ["", "[ops]"] + [f"{cat} = {_toml_value(names)}" for cat, names in data.get("ops", {}).items()]
    if data.get("fp8"):
        lines += ["", "[fp8]"] + [f"{field} = {_toml_value(value)}" for field, value in data["fp8"].items()]
    return "\n".join(lines) + "\n"


#: A TOML basic string's escapes; every other control character is written ``\\uXXXX`` (TOML allows none raw).
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_char(ch: str) -> str:
    return f"\\u{ord(ch):04X}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_TOML_ESCAPES.get(ch) or _toml_char(ch) for ch in value) + '"'
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"  # type: ignore[attr-defined]


def read_toml(path: object) -> dict[str, Any]:
    """Parse a TOML file, turning a syntax error into mixprec's error naming the file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            _errors.message("Cannot read policy file", "its path has the wrong type", received={"path": path},
                            expected="a str or os.PathLike path to a TOML file")
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:  # the same type (FileNotFoundError, IsADirectoryError, ...), in mixprec's words
        raise type(error)(
            _errors.message("Cannot read policy file", str(error.strerror or error).lower(),
                            received={"path": os.fspath(path)}, expected="a readable TOML file")
        ) from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            _errors.message(
                "Cannot read policy file",
                f"it is not valid TOML ({error})",
                received={"path": str(path)},
                expected="a TOML file with the keys " + ", ".join(KEYS),
            )
        ) from None
