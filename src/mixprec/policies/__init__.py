"""Autocast policies: one data module per policy, built into Policy objects on use.

``CPU`` and ``CUDA`` reproduce the installed torch's native autocast on those
devices (their data modules hold a table per supported release, see
:func:`describes`); ``XPU`` is the XPU AMP guide's list; ``CPU_DOCUMENTED`` and ``CUDA_DOCUMENTED``
are the lists of the torch.cpu.amp and torch.cuda.amp references; ``FP8`` is ``CUDA`` with the matmul family
(``linear``, ``mm``, ``addmm``, ``matmul``) in fp8. Nothing is
built at import time: each attribute is made on first access.
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

from mixprec.policies._builtin import BUILTIN, DOCUMENTED, NATIVE, lists, table_of
from mixprec.policies._category import CATEGORIES, Category
from mixprec.policies._policy import Policy
from mixprec.policies._recipe import Fp8Recipe

if TYPE_CHECKING:
    CPU: Policy
    CUDA: Policy
    XPU: Policy
    CPU_DOCUMENTED: Policy
    CUDA_DOCUMENTED: Policy
    FP8: Policy

__all__ = [  # the built-in policies by name: griffe (the API reference) reads __all__ as strings only
    "BUILTIN",
    "CATEGORIES",
    "CPU",
    "CPU_DOCUMENTED",
    "CUDA",
    "CUDA_DOCUMENTED",
    "DOCUMENTED",
    "FP8",
    "NATIVE",
    "XPU",
    "Category",
    "Fp8Recipe",
    "Policy",
    "describes",
    "lists",
]


def describes(policy: Policy) -> str | None:
    """Which torch release's native autocast a policy's unchanged entries reproduce (``"torch 2.15"``), or
    None for a table that is no release's (a documented list, a policy built from scratch)."""
    from mixprec import _compat, _errors

    _errors.check_type("policy", policy, Policy, what="mixprec.policies.describes")
    return f"torch {_compat.table_release()}" if policy.base in NATIVE else None


@functools.cache
def _build(attr: str) -> Policy:
    return Policy(attr, types.MappingProxyType(table_of(attr)), base=attr)


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
