"""What torch.compile needs to know to trace mixprec without graph breaks.

Dynamo routes a builtin torch function to the torch-function modes on the stack
only if the builtin is in its own set of overridable functions, built from
``torch.overrides.get_overridable_functions()``. That set misses builtins which
do check for torch-function modes in eager mode but are reached through a private
namespace: ``torch._C._nn.binary_cross_entropy`` (under ``F.binary_cross_entropy``),
``torch._VF.norm`` (under ``torch.norm``), the ``_C._nn`` losses and upsampling
ops. Under torch.compile the mode would never see them, and a policy's rule for
them (banned, fp32_append_dtype, ...) would silently not apply. ``register``
adds the builtins a policy names to that set when the policy's rules are built
(never at import).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

_BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def register(funcs: Iterable[Callable[..., Any]]) -> None:
    """Let dynamo dispatch ``funcs`` (builtins that honour torch-function modes) to the mode."""
    from torch._dynamo.variables import torch as dynamo_torch

    known = dynamo_torch.get_overridable_functions()
    known.update(f for f in funcs if isinstance(f, _BUILTINS) and f not in known)
