"""The built-in policies' data modules, read as plain data: names, lists per torch release, tables."""

from __future__ import annotations

import functools
import importlib

from mixprec import _compat, _errors
from mixprec.policies._category import Category

#: Built-in policies: attribute name -> data module.
BUILTIN = {
    "CPU": "cpu",
    "CUDA": "cuda",
    "XPU": "xpu",
    "CPU_DOCUMENTED": "cpu_documented",
    "CUDA_DOCUMENTED": "cuda_documented",
    "FP8": "fp8",
}

#: Built-in policies that hold a document's lists; the others reproduce torch's native tables.
DOCUMENTED = ("XPU", "CPU_DOCUMENTED", "CUDA_DOCUMENTED")
#: Built-in policies that reproduce torch's native tables, one table per supported torch release.
NATIVE = ("CPU", "CUDA")

def lists(attr: str, release: str | None = None) -> dict[str, tuple[str, ...]]:
    """A built-in policy's ``{category: ops}`` as its data module gives them for a torch release
    (``"2.15"``; None: the release the installed torch's tables follow). Documented lists have one."""
    _errors.check_type("name", attr, str, what="mixprec.policies.lists")
    _errors.check_type("release", release, str, optional=True, what="mixprec.policies.lists")
    if attr not in BUILTIN:
        raise ValueError(
            _errors.message(
                f"No built-in policy named {attr!r}",
                "lists reads the data module of a built-in policy",
                received={"name": attr},
                expected=list(BUILTIN),
            )
        )
    module = importlib.import_module(f"mixprec.policies.{BUILTIN[attr]}")
    table = {category: tuple(ops) for category, ops in module.TABLE.items()}
    releases = getattr(module, "RELEASES", None)
    if releases is None:
        return table
    release = _compat.table_release() if release is None else release
    if release not in releases:
        raise ValueError(
            _errors.message(
                f"No {attr} table for torch {release}",
                "the built-in native tables cover the supported releases only",
                received={"release": release},
                expected=list(releases),
            )
        )
    change = releases[release]
    removed = set(change.get("removed", ()))
    added = {op for category, ops in change.items() if category != "removed" for op in ops}
    for category in table:
        table[category] = tuple(op for op in table[category] if op not in removed and op not in added)
    for category, ops in change.items():
        if category != "removed":
            table[category] = table.get(category, ()) + tuple(ops)
    return table


@functools.cache
def _table(attr: str) -> tuple[tuple[str, Category], ...]:
    return tuple((op.strip(), Category(category)) for category, ops in lists(attr).items() for op in ops)


def table_of(attr: str) -> dict[str, Category]:
    """A built-in policy's ``{op: Category}`` on the installed torch (a new dict)."""
    return dict(_table(attr))
