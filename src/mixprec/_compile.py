"""What torch.compile needs to know to trace mixprec without graph breaks.

Dynamo routes a builtin torch function to the torch-function modes on the stack
only if the builtin is in its own set of overridable functions, built from
``torch.overrides.get_overridable_functions()``. That set misses builtins which
do check for torch-function modes in eager mode but are reached through a private
namespace: ``torch._C._nn.binary_cross_entropy`` (under ``F.binary_cross_entropy``),
``torch._VF.norm`` (under ``torch.norm``), the ``_C._nn`` losses and upsampling
ops. Under torch.compile the mode would never see them, and a policy's rule for
them (banned, fp32_append_dtype, ...) would silently not apply. ``register``
adds the builtins a policy names to that set the first time a trace looks the
policy up (never at import, and never in eager mode, which does not need dynamo).
The builtins are reached through Python wrappers (``F.binary_cross_entropy``,
``torch.norm``) that reach the mode first, so the set is complete before dynamo
meets them.

Nothing here imports ``torch._dynamo`` when mixprec is imported: ``constant``
marks a function as ``torch.compiler.assume_constant_result`` does (that one
imports dynamo, about a second), and a test checks that the marks agree.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

_BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)
F = TypeVar("F", bound=Callable[..., Any])


def constant(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo: the trace runs ``fn``
    eagerly and uses its result as a constant."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


_registered: dict[int, Any] = {}  # id(policy) -> policy, for the policies already registered


def register(funcs: Iterable[Callable[..., Any]]) -> None:
    """Let dynamo dispatch ``funcs`` (builtins that honour torch-function modes) to the mode.

    The set is private to dynamo: if a torch release drops it, eager autocast is
    unaffected and only these builtins go unseen under torch.compile.
    """
    try:
        from torch._dynamo.variables import torch as dynamo_torch

        known = dynamo_torch.get_overridable_functions()
    except (ImportError, AttributeError):  # pragma: no cover - depends on torch's private layout
        return
    known.update(f for f in funcs if isinstance(f, _BUILTINS) and f not in known)


def call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` as dynamo can trace it: a Python ``torch.Tensor`` method
    (``Tensor.unflatten``, which calls ``super()``) is called as a method of its tensor."""
    name = getattr(func, "__name__", "")
    if args and isinstance(args[0], torch.Tensor) and getattr(torch.Tensor, name, None) is func:
        return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


def register_policy(policy: Any) -> None:
    """``register`` the builtins that ``policy`` names, once per policy object."""
    if _registered.get(id(policy)) is not policy:
        register(policy._by_callable)
        _registered[id(policy)] = policy


@constant
def category(policy: Any, func: Callable[..., Any]) -> str | None:
    """``policy``'s category name for ``func``, run eagerly by torch.compile (a constant in the trace)."""
    register_policy(policy)
    try:
        found = policy._by_callable.get(func)
    except TypeError:  # unhashable callable
        return None
    return None if found is None else str(found.value)


@constant
def advice(policy: Any, func: Callable[..., Any]) -> str:
    """The text a banned ``func`` raises under ``policy`` (a constant in the trace)."""
    return str(policy.advice(policy._banned_names[func]))


@constant
def expands(policy: Any, func: Callable[..., Any]) -> bool:
    """Whether ``func`` is a composite to run as its twin under ``policy`` (a constant in the trace)."""
    from mixprec import _mode

    return _mode.compile_policy(policy).twin(func) is not None
