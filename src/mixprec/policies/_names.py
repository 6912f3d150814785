"""Naming ops for a policy: docs spelling, torch callables, ``torch.ops`` packets and overloads.

A policy table is keyed by strings, so every way a user can name an op is
turned into one string first:

==========================================  =============================
given                                       table name
==========================================  =============================
``"softmax"``, ``"aten::softmax"``           ``"softmax"`` (docs spelling)
``torch.softmax``, ``torch.Tensor.softmax``  ``"softmax"``
``torch.linalg.inv``                         ``"linalg_inv"``
``torch.ops.aten.softmax``                   ``"softmax"``
``torch.ops.aten.softmax.int``               ``"aten::softmax.int"`` (that overload only)
``torch.ops.mylib.op`` / a ``custom_op``     ``"mylib::op"`` (all its overloads)
``torch.ops.mylib.op.default``               ``"mylib::op.default"``
==========================================  =============================

A name must reach at least one callable (``_resolve.callables``), or else be
already listed in the policy being changed; anything else is refused with the
closest names torch knows.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from collections.abc import Container, Iterable, Mapping
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec.policies import _resolve
from mixprec.policies._category import Action, Category

_EXPECTED = (
    "an op name in ATen or docs spelling (e.g. 'softmax', 'linalg_inv', 'mylib::op'), a torch callable "
    "(e.g. torch.softmax), or a torch.ops packet or overload (e.g. torch.ops.mylib.op)"
)


def _packet_name(packet: torch._ops.OpOverloadPacket) -> str:
    qualified: str = packet._qualified_op_name
    return qualified.removeprefix("aten::")


def table_key(op: object) -> str | None:
    """The table name ``op`` spells, before checking that it names anything."""
    if isinstance(op, str):
        name = op.strip()
        return name.removeprefix("aten::") if name.count(".") == 0 else name
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.overloadpacket._qualified_op_name}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _packet_name(op)
    qualname = getattr(op, "_qualname", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(qualname, str) and "::" in qualname:
        return qualname.removeprefix("aten::")
    module = getattr(op, "__module__", None)
    torch_function = isinstance(module, str) and module.split(".")[0] == "torch"
    if callable(op) and (torch_function or isinstance(op, _resolve._BUILTIN_TYPES)):
        return _resolve.name_of(op)
    return None


@functools.cache
def _known_names() -> tuple[str, ...]:
    """Names to suggest from: ATen ops, the C namespaces and the Python ones."""
    names = {n.removeprefix("aten::").split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
    names.update(n for n in dir(torch._C._VariableFunctions) if not n.startswith("_"))
    for prefix, namespace in _resolve._python_namespaces():
        names.update(prefix + n for n in dir(namespace) if not n.startswith("_"))
    return tuple(sorted(names))


def _unknown(op: object, name: str | None, listed: Iterable[str]) -> ValueError:
    namespace = name.split("::")[0] if name and "::" in name and not name.startswith("aten::") else None
    if namespace is not None:  # a custom op: suggest only that namespace's ops, registered or listed
        qualified = [n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(namespace + "::")]
        close = difflib.get_close_matches(name, [*qualified, *listed], n=5) if name else []
    else:
        close = difflib.get_close_matches(name, [*_known_names(), *listed], n=5) if name else []
    respelled = _respelled(name) if name else None
    if respelled is not None:
        close = [respelled]
    hint = f"Did you mean one of: {', '.join(close)}?" if close else None
    if namespace is not None and not close:
        hint = (
            f"No '{namespace}::' op is registered in this process: import the module that defines it before "
            "naming it (on the command line: --import MODULE)"
        )
    what = "not a torch op or op name" if name is None else "it names no op torch has and the policy does not list it"
    return ValueError(
        _errors.message(
            "Cannot name this op in a policy",
            what,
            received={"op": op},
            expected=_EXPECTED,
            fix=hint,
        )
    )


def _respelled(name: str) -> str | None:
    """The table name of a Python path written as a string (``"torch.linalg.inv"`` -> ``"linalg_inv"``) or of an
    ATen overload written without its namespace (``"mm.default"`` -> ``"aten::mm.default"``), else None."""
    if "::" in name or "." not in name:
        return None
    if name.startswith("torch."):
        found: object = torch
        for part in name.split(".")[1:]:
            found = getattr(found, part, None)
        key = table_key(found) if callable(found) else None
        return key if key is not None and _resolve.callables(key) else None
    return f"aten::{name}" if _resolve.callables(f"aten::{name}") else None


def op_name(op: object, listed: Mapping[str, object] | None = None) -> str:
    """The table name of ``op``; ValueError if it names nothing (and ``listed`` does not hold it).

    Examples:
        >>> op_name(torch.linalg.inv)
        'linalg_inv'
        >>> op_name(torch.ops.aten.softmax.int)
        'aten::softmax.int'
    """
    listed = {} if listed is None else listed
    name = table_key(op)
    if name is None:
        if isinstance(op, str) or callable(op):
            raise _unknown(op, None, listed)
        raise TypeError(
            _errors.message(
                "Cannot name this op in a policy",
                "ops are named by strings or torch callables",
                received={"op": op},
                expected=_EXPECTED,
            )
        )
    if name in listed or _resolve.callables(name):
        return name
    raise _unknown(op, name, listed)


def op_names(ops: object, listed: Mapping[str, object] | None = None, *, removing: bool = False) -> list[str]:
    """Table names for one op or an iterable of ops to edit, in order, without repeats (``edit_name``)."""
    items: Iterable[object] = [ops] if isinstance(ops, str) or callable(ops) else _iterable(ops)
    out: list[str] = []
    for op in items:
        name = edit_name(op, listed, removing=removing)
        if name not in out:
            out.append(name)
    return out


#: The ATen ops that Python's operator spellings call (a hint for the refusal below).
_OPERATORS = {
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
    "__rdiv__": "reciprocal and mul", "__rtruediv__": "reciprocal and mul", "__rsub__": "rsub",
}  # fmt: skip


def edit_name(
    op: object, listed: Mapping[str, object] | None = None, *, removing: bool = False, own: Container[str] = ()
) -> str:
    """The table name of an op to move or remove (``op_name``); ValueError where the edit could change nothing
    although torch has the op: an operator spelling or Python function that reaches no ATen op of its own
    (``__matmul__``, ``F.cross_entropy``), or an ``out=`` / in-place overload. Autocast, native and mixprec's,
    acts on the dispatcher's functional ATen overloads only. A name the table lists stays editable (a documented
    list's spellings, ``CUDA_DOCUMENTED``'s ``__matmul__``: its data round-trips), and so does one in ``own``
    (the names a base-less policy file lists itself), though it must still name an op torch has or ``listed``
    holds. ``removing``: kept for callers that tell a removal apart."""
    listed = {} if listed is None else listed
    name = op_name(op, listed)
    if _compat.dynamo_tracing():  # (a policy made in compiled code is refused as it is built: ``Policy``)
        return name
    if _resolve.dispatcher_overloads(name) or not _resolve.callables(name) or name in listed or name in own:
        return name
    if any(isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for f in _resolve.callables(name)):
        op = op_of_overload(name) or name
        found = [f for f in (op.removesuffix("_"), f"{op}_functional") if _resolve.dispatcher_overloads(f)]
        why = "its overloads are out= or in-place ones, which autocast leaves alone (as native autocast does)"
        fix = f"Name the functional op{f', {found[0]!r},' if found else ''} or one of its functional overloads."
    else:
        aten = [n for n in _known_names() if _resolve.dispatcher_overloads(n)]
        hint = _OPERATORS.get(name) or ", ".join(difflib.get_close_matches(name, aten, n=3))
        why = "autocast acts on ATen ops, and this Python-level name reaches none of its own: moving it changes nothing"
        fix = (
            f"Name the ATen ops it calls{f' (perhaps: {hint})' if hint else ''}; mixprec.explain(op, example=...) "
            "shows what a call reaches."
        )
    raise ValueError(
        _errors.message("Cannot edit this op in a policy", why, received={"op": op}, expected=_EXPECTED, fix=fix)
    )


def _iterable(ops: object) -> Iterable[object]:
    if isinstance(ops, Iterable) and not isinstance(ops, (bytes, Mapping)):
        return ops
    raise TypeError(
        _errors.message(
            "Cannot read the ops to change",
            "pass one op or an iterable of ops",
            received={"ops": ops},
            expected=_EXPECTED,
        )
    )



def op_of_overload(name: str) -> str | None:
    """The table name of the op an overload name belongs to (``aten::mm.default`` and ``mm.default`` -> ``mm``,
    ``mylib::op.default`` -> ``mylib::op``), else None."""
    if "." not in name:
        return None
    return name.split(".")[0].removeprefix("aten::")


def entry_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The table names that may decide an overload's category, first match wins: the overload's own entry
    (``"aten::mm.default"``, ``"mm.default"``) before its op's (``"mm"``, ``"aten::mm"``)."""
    packet = op.overloadpacket._qualified_op_name
    overload = f"{packet}.{op._overloadname}"
    return (overload.removeprefix("aten::"), overload, packet.removeprefix("aten::"), packet)


def dispatched(op: object) -> object:
    """What a call of ``op`` reaches the dispatcher as: a ``custom_op`` object calls its default overload."""
    overload = getattr(op, "_opoverload", None)
    return overload if isinstance(overload, torch._ops.OpOverload) else op


#: The actions that pass ``dtype=<target>`` to the op instead of casting its inputs.
_PASSES_DTYPE = (Action.SET_DTYPE, Action.APPEND_DTYPE)


def takes_dtype(name: str) -> bool:
    """Whether a callable that reaches ``name`` has a ``dtype`` argument (ATen schema or Python signature).

    A name that reaches nothing (kept from an older torch) is given the benefit of the doubt.
    """
    found = _resolve.callables(name)
    for func in found:
        if isinstance(func, torch._ops.OpOverload) and any(a.name == "dtype" for a in func._schema.arguments):
            return True
        if isinstance(func, types.FunctionType) and "dtype" in inspect.signature(func).parameters:
            return True
    return not found


#: The ops an fp8 category can run (their calls that are 2-D GEMMs after flattening: ``engine._fp8.as_linear``).
FP8_OPS = ("linear", "mm", "addmm", "matmul")


def check_dtype_category(category: Category, names: list[str]) -> None:
    """ValueError if ``category`` passes dtype= and one of ``names`` takes no dtype argument, or if it runs GEMMs
    in fp8 and one of ``names`` is not such a GEMM."""
    if category.action is Action.SCALED_MM:
        for name in names:
            if name.removeprefix("aten::").split(".")[0] not in FP8_OPS:
                raise ValueError(
                    _errors.message(
                        f"Cannot put this op in {category.value}",
                        "fp8 runs the GEMMs of linear, mm, addmm and matmul through torch._scaled_mm only",
                        received={"op": name},
                        expected=list(FP8_OPS),
                        fix="Leave the op in its category; its inputs still arrive in the region's dtype.",
                    )
                )
        return
    if category.action not in _PASSES_DTYPE:
        return
    for name in names:
        if not takes_dtype(name):
            raise ValueError(
                _errors.message(
                    f"Cannot put this op in {category.value}",
                    f"that category passes dtype={category.target} to the op, and the op takes no dtype argument",
                    received={"op": name},
                    expected="an op with a dtype argument (e.g. softmax, log_softmax, sum, cumsum, prod, norm)",
                    fix="To run the op in float32, use the fp32 category, which casts its inputs.",
                )
            )


def overloads_last(item: tuple[str, Any]) -> bool:
    """Sort key over ``(name, category)`` table items: an overload's entry (``"mm.out"``) comes after its op's
    (``"mm"``), so that applied in order, the overload's own entry wins. The one place this rule lives: the
    policy's callable lookup and the engine's overload tables both sort by it."""
    return "." in item[0]
