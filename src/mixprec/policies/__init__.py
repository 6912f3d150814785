"""Autocast policies: one data module per policy, built into Policy objects on use.

``CPU`` and ``CUDA`` reproduce torch 2.13's native autocast on those devices;
``XPU`` is the XPU AMP guide's list; ``CPU_DOCUMENTED`` and ``CUDA_DOCUMENTED``
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

__all__ = ["BUILTIN", "CATEGORIES", "DOCUMENTED", "Category", "Policy", *BUILTIN]


@functools.cache
def _build(attr: str) -> Policy:
    module = importlib.import_module(f"mixprec.policies.{BUILTIN[attr]}")
    return Policy.from_lists(attr, module.TABLE, base=attr)


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
