"""Autocast policies: one data module per policy, built into Policy objects on use.

``CPU`` and ``CUDA`` reproduce the installed torch's native autocast on those
devices (their data modules hold a table per supported release, see
:func:`describes`); ``XPU`` is the XPU AMP guide's list; ``CPU_DOCUMENTED`` and ``CUDA_DOCUMENTED``
are the lists of the torch.cpu.amp and torch.cuda.amp references. Nothing is
built at import time: each attribute is made on first access.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from mixprec.policies._policy import CATEGORIES, Category, Policy

if TYPE_CHECKING:
    CPU: Policy
    CUDA: Policy
    XPU: Policy
    CPU_DOCUMENTED: Policy
    CUDA_DOCUMENTED: Policy

#: Built-in policies: attribute name -> data module.
BUILTIN = {
    "CPU": "cpu",
    "CUDA": "cuda",
    "XPU": "xpu",
    "CPU_DOCUMENTED": "cpu_documented",
    "CUDA_DOCUMENTED": "cuda_documented",
}

#: Built-in policies that hold a document's lists; the others reproduce torch's native tables.
DOCUMENTED = ("XPU", "CPU_DOCUMENTED", "CUDA_DOCUMENTED")
#: Built-in policies that reproduce torch's native tables, one table per supported torch release.
NATIVE = ("CPU", "CUDA")

__all__ = ["BUILTIN", "CATEGORIES", "DOCUMENTED", "NATIVE", "Category", "Policy", "describes", "lists", *BUILTIN]


def lists(attr: str, release: str | None = None) -> dict[str, tuple[str, ...]]:
    """A built-in policy's ``{category: ops}`` as its data module gives them for a torch release
    (``"2.15"``; None: the release the installed torch's tables follow). Documented lists have one."""
    from mixprec import _compat, _errors

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


def describes(policy: Policy) -> str | None:
    """Which torch release's native autocast a policy's unchanged entries reproduce (``"torch 2.15"``), or
    None for a table that is no release's (a documented list, a policy built from scratch)."""
    from mixprec import _compat, _errors

    _errors.check_type("policy", policy, Policy, what="mixprec.policies.describes")
    return f"torch {_compat.table_release()}" if policy.base in NATIVE else None


@functools.cache
def _build(attr: str) -> Policy:
    return Policy.from_lists(attr, lists(attr), base=attr)


def __getattr__(attr: str) -> Policy:
    if attr in BUILTIN:
        return _build(attr)
    what = f"module 'mixprec.policies' has no attribute {attr!r}"
    if attr.startswith("__"):
        raise AttributeError(what)
    from mixprec import _errors

    raise AttributeError(
        _errors.message(what, "no built-in policy has this name", received={"name": attr}, expected=list(BUILTIN))
    )
