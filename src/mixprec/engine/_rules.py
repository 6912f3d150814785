"""The cast categories as rules on ATen calls, as ATen's ``autocast_mode.h`` defines them.

A rule gets the op overload and its arguments as the dispatcher hands them to
the Autocast key, casts, and calls the op with that key excluded (so the cast
op's own autocast kernel does not run again, and composites below it are not
autocast, as natively)::

    lower_precision_fp   cast eligible tensors to the autocast dtype (weights through a cache, _cast)
    fp32                 cast eligible tensors to float32
    fp32_set_opt_dtype   if the first tensor is eligible and dtype is None: dtype=float32
    fp32_append_dtype    if the first tensor is eligible: the sibling overload that adds dtype=float32
    promote              cast eligible tensors to the widest eligible dtype (float32 over the autocast one)
    banned               raise the policy's advice if an eligible tensor is among the inputs

Eligible: a floating tensor on the autocast device that is not float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec import _errors
from mixprec.engine import _cast, _emulate
from mixprec.policies import Category

_float32 = torch.float32
_Tensor = torch.Tensor
Op = Any  # torch._ops.OpOverload
Rule = Callable[[Op, str, torch.dtype, bool, tuple[Any, ...], dict[str, Any]], Any]


def lower_precision_fp(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
    cache = _cast.cache_for_call()
    cast, cast_kwargs = _cast.cast_call(args, kwargs, dtype, device, cache)
    if emulate:
        return _emulate.call(dtype, op, cast, cast_kwargs, original=(args, kwargs))
    return op(*cast, **cast_kwargs)


def fp32(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
    cast, cast_kwargs = _cast.cast_call(args, kwargs, _float32, device, None)
    return op(*cast, **cast_kwargs)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            return value
    return None


def _bind(op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    arguments = op._schema.arguments
    values = {**{a.name: v for a, v in zip(arguments, args, strict=False)}, **kwargs}
    values.update((a.name, a.default_value) for a in arguments if a.name not in values and a.has_default_value())
    return values


def _call_bound(op: Op, values: dict[str, Any]) -> Any:
    positional = [values.pop(a.name) for a in op._schema.arguments if not a.kwarg_only and a.name in values]
    return op(*positional, **values)


def fp32_set_opt_dtype(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
    first = _first_tensor(args, kwargs)
    if not (isinstance(first, _Tensor) and _cast.is_eligible(first, device)):
        return op(*args, **kwargs)
    values = _bind(op, args, kwargs)
    if "dtype" not in values:
        return op(*args, **kwargs)
    if values["dtype"] is None:
        values["dtype"] = _float32
    return _call_bound(op, values)


def _with_dtype(op: Op) -> Op | None:
    """The sibling overload that takes this one's arguments plus ``dtype`` (norm.Scalar -> norm.ScalarOpt_dtype)."""
    names = [a.name for a in op._schema.arguments]
    if "dtype" in names:
        return op
    packet = op.overloadpacket
    for name in packet.overloads():
        sibling = getattr(packet, name)
        if [a.name for a in sibling._schema.arguments] == [*names, "dtype"]:
            return sibling
    return None


def fp32_append_dtype(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
    first = _first_tensor(args, kwargs)
    target = _with_dtype(op)
    if target is None or not (isinstance(first, _Tensor) and _cast.is_eligible(first, device)):
        return op(*args, **kwargs)
    values = _bind(op, args, kwargs)
    values["dtype"] = _float32
    return _call_bound(target, values)


def promote_dtype(device: str, dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """The widest eligible input dtype: float32 if any eligible input is float32 (ATen's ``prioritize``)."""
    to = dtype
    for t in _cast.iter_tensors(args, kwargs):
        if not _cast.is_eligible(t, device):
            continue
        if t.dtype is _float32:
            return _float32
        if t.dtype is not dtype:
            raise RuntimeError(
                _errors.message(
                    "autocast promote",
                    f"inputs mix another lower-precision dtype with the autocast dtype {dtype}, and autocast "
                    "promotes only between float32 and the autocast dtype",
                    received={"dtype": t.dtype},
                    expected=["float32", str(dtype).removeprefix("torch.")],
                    fix="Cast the inputs to one dtype before the call.",
                )
            )
    return to


def promote(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
    to = promote_dtype(device, dtype, args, kwargs)
    args, kwargs = _cast.cast_call(args, kwargs, to, device, None)
    return op(*args, **kwargs)


def banned(advice: str) -> Rule:
    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        if any(_cast.is_eligible(t, device) for t in _cast.iter_tensors(args, kwargs)):
            raise RuntimeError(advice)
        return op(*args, **kwargs)

    return rule


RULES: dict[Category, Rule] = {
    Category.LOWER_PRECISION_FP: lower_precision_fp,
    Category.FP32: fp32,
    Category.FP32_SET_OPT_DTYPE: fp32_set_opt_dtype,
    Category.FP32_APPEND_DTYPE: fp32_append_dtype,
    Category.PROMOTE: promote,
}
