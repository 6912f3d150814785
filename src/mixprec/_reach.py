"""Which Python composites can reach an op that a policy lists.

Running a composite as a twin (``mixprec._expand``) costs a mode push and pop
and an interception per inner call. A composite that cannot reach any listed op
(``F.relu``, ``F.dropout`` under the CPU policy) runs the same with or without
its twin, so it runs natively. The question is answered once per composite and
policy by reading code, never by running it.

Algorithm::

    reaches(func, names):                  # names: every spelling of the policy's ops
        code = func's code and the code objects nested in it (comprehensions, lambdas)
        if a name the code uses, or the name of a callable in its closure,
           is in names: True                                # torch.mm, x.softmax, F.linear
        if the code applies @, ** or / and the operator's dunder is in names: True
        for each Python function the code can name (a global, an attribute of a module
        it uses, of torch's namespaces, or a function in its closure):
            if reaches(that function, names): True
        False

The answer errs on the side of expanding: a name that matches by spelling only
(a local variable called ``mm``) makes the twin run, which is merely slower.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mixprec import _ports

#: Binary operators whose dunders a policy may list (``Tensor.__matmul__``, ``__pow__``, ...).
_OPERATORS = {
    "@": ("__matmul__", "__rmatmul__"),
    "**": ("__pow__", "__rpow__"),
    "/": ("__truediv__", "__rtruediv__", "__div__", "__rdiv__"),
    "*": ("__mul__", "__rmul__"),
    "+": ("__add__", "__radd__"),
    "-": ("__sub__", "__rsub__"),
}
_PREFIXES = ("linalg_", "fft_", "special_", "nn_")


def policy_names(table: dict[str, Any], callables: Any) -> frozenset[str]:
    """Every spelling under which code can call an op of the policy."""
    names = set()
    for name in table:
        names.add(name)
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                names.add(name.removeprefix(prefix))
    for func in callables:
        spelled = getattr(func, "__name__", None)
        if isinstance(spelled, str):
            names.add(spelled.split(".")[-1])
    names.update(getattr(port, "__name__", "") for port in _ports.ports())
    return frozenset(names)


@functools.cache
def _namespaces() -> tuple[Any, ...]:
    return (torch, torch.nn.functional, torch.Tensor, torch.linalg, torch.fft, torch.special, torch.functional)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _operators(code: types.CodeType) -> Iterator[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname == "BINARY_OP":
            yield instruction.argrepr


def _callees(func: types.FunctionType, names: set[str]) -> Iterator[types.FunctionType]:
    """The Python functions ``func`` can call by the names its code uses."""
    scope = func.__globals__
    modules = [scope[n] for n in names if isinstance(scope.get(n), types.ModuleType)]
    for name in names:
        for space in (scope, *modules, *_namespaces()):
            found = space.get(name) if isinstance(space, dict) else getattr(space, name, None)
            if isinstance(found, types.FunctionType):
                yield found
    yield from (value for value in _cells(func) if isinstance(value, types.FunctionType))


def _cells(func: types.FunctionType) -> Iterator[Any]:
    """The values in ``func``'s closure (a wrapper's wrapped callable: Tensor.__pow__ holds TensorBase.pow)."""
    for cell in func.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue


def reaches(func: Callable[..., Any], names: frozenset[str], _seen: set[int] | None = None) -> bool:
    """Whether ``func`` can call, directly or through Python helpers, an op named in ``names``."""
    if not isinstance(func, types.FunctionType):
        return func in _ports.ports()
    seen = set() if _seen is None else _seen
    if id(func.__code__) in seen:
        return False
    seen.add(id(func.__code__))
    used: set[str] = set()
    for code in _codes(func.__code__):
        used.update(code.co_names)
        for symbol in _operators(code):
            if any(dunder in names for dunder in _OPERATORS.get(symbol, ())):
                return True
    used.update(n for value in _cells(func) if isinstance(n := getattr(value, "__name__", None), str))
    if not used.isdisjoint(names):
        return True
    return any(reaches(callee, names, seen) for callee in _callees(func, used))
