"""From an op's name to the Python callables through which it can be reached.

An op is named as in ATen or in torch's AMP docs: ``softmax``, ``linalg_inv``,
``fft_rfft``, ``__rtruediv__``. Every namespace that exposes it counts:
``torch.X``, ``torch.nn.functional.X`` / ``torch._C._nn.X``, ``torch.linalg``,
``torch.fft``, ``torch.special``, ``torch.Tensor`` methods, and ``torch.ops.aten.X``
with each of its overloads (native autocast sits in the dispatcher, so it also
casts calls made through ``torch.ops.aten``).

Algorithm::

    builtins = [getattr(ns, name) for each C namespace that has it]
    aten = [torch.ops.aten.name, *its overloads]      # if ATen has the op
    if builtins: return builtins + aten   # a Python wrapper reaches its builtins' ATen ops
    return [Python-level functions with that name] + aten   # e.g. F.cross_entropy, Tensor.__rpow__

Builtins map one to one onto ATen ops; a Python composite over them reaches the
Autocast key through the ATen ops it calls, so it needs no entry of its own.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch


def _c_namespaces() -> tuple[object, ...]:
    c: Any = torch._C
    return (c._VariableFunctions, c._nn, c._linalg, c._fft, c._special, c.TensorBase)


def _python_namespaces() -> tuple[tuple[str, object], ...]:
    return (
        ("", torch),
        ("", torch.nn.functional),
        ("", torch.functional),
        ("", torch.Tensor),
        ("linalg_", torch.linalg),
        ("fft_", torch.fft),
        ("special_", torch.special),
    )


_BUILTIN_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


def _unique(found: list[object]) -> tuple[Callable[..., object], ...]:
    out: list[Callable[..., object]] = []
    for obj in found:
        if callable(obj) and all(obj is not seen for seen in out):
            out.append(obj)
    return tuple(out)


def _aten(name: str) -> list[object]:
    """``torch.ops.aten.<name>`` and its overloads, or nothing if ATen has no such op."""
    if name.startswith("__"):
        return []
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return []
    return [packet, *(getattr(packet, overload) for overload in packet.overloads())]


def callables(name: str) -> tuple[Callable[..., object], ...]:
    """All callables that reach the op ``name`` (empty if torch has none).

    ``ns::op`` names a ``torch.ops`` packet with its overloads and
    ``ns::op.overload`` one overload; these are looked up afresh each time, as
    custom ops come and go with their ``torch.library.Library``.
    """
    name = name.strip()
    if "::" in name:
        return _qualified(name)
    return _named(name)


def _qualified(name: str) -> tuple[Callable[..., object], ...]:
    namespace, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return ()
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    if overload:
        return (getattr(packet, overload),) if overload in packet.overloads() else ()
    return (packet, *(getattr(packet, o) for o in packet.overloads()))


@functools.lru_cache(maxsize=4096)  # (bounded: any string asked about, invalid names too)
def _named(name: str) -> tuple[Callable[..., object], ...]:
    builtins = [getattr(ns, name, None) for ns in _c_namespaces()]
    builtins = [f for f in builtins if isinstance(f, _BUILTIN_TYPES)]
    aten = _aten(name)
    if builtins and not (name.startswith("__") and name.endswith("__")):
        return _unique(builtins + aten)
    wrappers = []
    for prefix, namespace in _python_namespaces():
        if name.startswith(prefix):
            wrappers.append(getattr(namespace, name[len(prefix):], None))
    wrappers = [f for f in wrappers if isinstance(f, types.FunctionType)]
    return _unique(builtins + wrappers + aten)


def _functional(op: torch._ops.OpOverload) -> bool:
    """Not an ``out=`` or in-place overload (autocast leaves those alone), and one that takes a tensor: the
    TorchScript-only scalar overloads (``aten::add(Scalar a, Scalar b) -> Scalar``, the packet's ``default``)
    never reach the dispatcher's Autocast keys, and a kernel registered under their name shadows nothing."""
    arguments = op._schema.arguments
    return not any(a.alias_info is not None and a.alias_info.is_write for a in arguments) and any(
        "Tensor" in str(a.type) for a in arguments
    )


def dispatcher_overloads(name: str) -> tuple[torch._ops.OpOverload, ...]:
    """The functional overloads a table entry covers at the dispatcher: all of an op's (``"mm"``), or one
    (``"aten::mm.default"``). Empty for an operator spelling (``"__matmul__"``) or a Python function over other
    ops (``"cross_entropy"``): native autocast, and mixprec's kernels, see only the ATen ops those call."""
    namespace, _, rest = name.rpartition("::")
    op_name, _, overload = rest.partition(".")
    if name.startswith("__") or not op_name:
        return ()
    try:
        packet = getattr(getattr(torch.ops, namespace or "aten"), op_name)
    except (AttributeError, RuntimeError):
        return ()
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    names = [overload] if overload else packet.overloads()
    found = (getattr(packet, n, None) for n in names if n in packet.overloads())
    return tuple(op for op in found if op is not None and _functional(op))


def name_of(func: Callable[..., object]) -> str:
    """The op name under which a callable is listed (its ATen-style name)."""
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    for prefix in ("linalg", "fft", "special"):
        if module.endswith("_" + prefix) and not name.startswith(prefix + "_"):
            return f"{prefix}_{name}"
    return name
