"""Running Python-level composites so that the ops inside them are autocast.

A ``TorchFunctionMode`` handler runs with the mode switched off, so the ops that
a Python composite such as ``F.multi_head_attention_forward`` calls would escape
autocast. Re-pushing the mode and calling the composite does not work either:
its own ``has_torch_function`` gate sends the call straight back to the mode.

The composite is therefore run as a *twin*: the same code object, closure and
defaults, with globals in which the three gate functions answer False and every
other name is looked up live in the composite's own module. The twin runs with
the mode pushed, so each op it calls goes through the mode; its own gate no
longer re-dispatches it. Functions without a gate (plain wrappers) get no twin.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec import _shelf

_GATES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: object) -> bool:
    return False


class _TwinGlobals(dict):  # type: ignore[type-arg]
    """Gate names answer False; every other global is read from the live module."""

    __slots__ = ("live",)
    live: dict[str, Any]

    def __missing__(self, key: str) -> Any:
        return self.live[key]


_twins: dict[Callable[..., Any], Callable[..., Any] | None] = {}


def _make_twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    if not isinstance(func, types.FunctionType):
        return None
    code = func.__code__
    if not any(gate in code.co_names for gate in _GATES):
        return None
    scope = _TwinGlobals({gate: _never for gate in _GATES})
    scope.live = func.__globals__
    scope["__builtins__"] = func.__globals__.get("__builtins__", __builtins__)
    twin = types.FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    twin.__kwdefaults__ = func.__kwdefaults__
    return twin


def _make_traceable_twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """A twin for torch.compile: its globals are a plain copy (dynamo ignores ``__missing__``).

    The copy is taken when the twin is first made, so a global of the composite's
    module patched later is not seen by traces (the eager twin reads it live).
    """
    made = _make_twin(func)
    if made is None or "super" in made.__code__.co_names:  # dynamo cannot trace super() outside its class
        return None
    scope = {**func.__globals__, **{gate: _never for gate in _GATES}}  # type: ignore[attr-defined]
    traceable = types.FunctionType(made.__code__, scope, made.__name__, made.__defaults__, made.__closure__)
    traceable.__kwdefaults__ = made.__kwdefaults__
    if torch._dynamo.trace_rules.check_file(made.__code__.co_filename, True).skipped:  # torch.functional.norm
        return torch._dynamo.dont_skip_tracing(traceable)  # type: ignore[no-any-return]
    return traceable


def twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The gate-free twin of a Python composite, or None if it has no gate."""
    if torch.compiler.is_compiling():
        return _shelf.fetch(_shelved, func, _make_traceable_twin)
    try:
        return _twins[func]
    except KeyError:
        made = _twins[func] = _make_twin(func)
        return made
    except TypeError:  # unhashable callable
        return None


_shelved = _shelf.Shelf()
