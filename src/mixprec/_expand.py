"""Running Python-level composites so that the ops inside them are autocast.

A ``TorchFunctionMode`` handler runs with the mode switched off, so the ops that
a Python composite such as ``F.multi_head_attention_forward`` calls would escape
autocast. Re-pushing the mode and calling the composite does not work either:
its own ``has_torch_function`` gate sends the call straight back to the mode.

The composite is therefore run as a *twin*: the same code object, closure and
defaults, with globals in which the three gate functions answer False and every
other name is looked up live in the composite's own module. The twin runs with
the mode pushed, so each op it calls goes through the mode; its own gate no
longer re-dispatches it. A wrapper without a gate whose closure holds gated
functions (torch's ``boolean_dispatch``: F.max_pool3d, torch.lu, ...) gets a twin
that closes over their twins. C++ composites with a port in ``mixprec._ports``
(``aten::pad``) run the port as their twin. Anything else gets no twin.

Custom ops (``torch.ops`` outside ``aten``) that no policy lists are expanded
too, as native autocast falls through to their kernels with autocast still on:
their twin calls the dispatcher directly (``torch._C._dispatch_call_boxed``),
past the torch-function check, so a Python kernel's inner ops reach the mode.
A kernel written in C++ runs as before.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec import _ports, _shelf

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


def _closure_twin(func: types.FunctionType) -> Callable[..., Any] | None:
    """A gate-free wrapper over gated functions (torch's ``boolean_dispatch``: F.max_pool3d,
    F.fractional_max_pool2d, torch.lu, ...): the same wrapper, closing over their twins."""
    cells = func.__closure__ or ()
    swapped = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            value = None
        swapped.append(twin(value) if isinstance(value, types.FunctionType) else None)
    if not any(swapped):
        return None
    closure = tuple(cell if new is None else types.CellType(new) for new, cell in zip(swapped, cells, strict=True))
    wrapper = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, closure)
    wrapper.__kwdefaults__ = func.__kwdefaults__
    return wrapper


def _call_overload(overload: Any, *args: Any, **kwargs: Any) -> Any:
    return torch._C._dispatch_call_boxed(overload._handle, *args, **kwargs)


def _call_packet(packet: Any, *args: Any, **kwargs: Any) -> Any:
    name = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    return _call_overload(getattr(packet, name), *args, **kwargs)


def _custom_op_twin(func: Any) -> Callable[..., Any] | None:
    if isinstance(func, torch._ops.OpOverload) and func.namespace != "aten":
        return functools.partial(_call_overload, func)
    if isinstance(func, torch._ops.OpOverloadPacket) and not func._qualified_op_name.startswith("aten::"):
        return functools.partial(_call_packet, func)
    return None


def _make_twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    port = _ports.ports().get(func)
    if port is not None:
        return port
    if not isinstance(func, types.FunctionType):
        return _custom_op_twin(func)
    code = func.__code__
    if not any(gate in code.co_names for gate in _GATES):
        _twins[func] = None  # a closure that refers to func itself ends here
        return _closure_twin(func)
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
    Ports are plain functions and trace as they are. Wrappers without a gate need
    no twin in a trace: dynamo inlines them, and the gated functions they call reach
    the mode themselves. Custom ops get none (see ``mixprec._mode._traced``).
    """
    port = _ports.ports().get(func)
    if port is not None:
        return port
    if not isinstance(func, types.FunctionType):
        return None
    code = func.__code__
    if not any(gate in code.co_names for gate in _GATES) or "super" in code.co_names:
        return None  # no gate, or super(), which dynamo cannot trace outside its class
    scope = {**func.__globals__, **{gate: _never for gate in _GATES}}
    traceable = types.FunctionType(code, scope, func.__name__, func.__defaults__, func.__closure__)
    traceable.__kwdefaults__ = func.__kwdefaults__
    if torch._dynamo.trace_rules.check_file(code.co_filename, True).skipped:  # torch.functional.norm
        return torch._dynamo.dont_skip_tracing(traceable)  # type: ignore[no-any-return]
    return traceable


def twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The gate-free twin of a Python composite, or None if it has no gate (eager mode)."""
    try:
        return _twins[func]
    except KeyError:
        made = _twins[func] = _make_twin(func)
        return made
    except TypeError:  # unhashable callable
        return None


def traced_twin(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The twin of ``func`` inside a torch.compile trace (built eagerly, once per callable)."""
    return _shelf.fetch(_shelved, func, _make_traceable_twin)


_shelved = _shelf.Shelf()
