"""The interception mode: one dict lookup per torch call, then the category's rule.

Algorithm for each intercepted call ``func(*args, **kwargs)``::

    for each enabled device context:
        rule = context.rules.get(func)          # compiled from the policy table
        if rule and the call touches that device: return rule(...)
    if func is a Python composite with a torch-function gate:
        run its twin with the mode pushed       # inner ops are intercepted
    else:
        return func(*args, **kwargs)            # mode is off here: runs natively

The mode sits above autograd, so the casts it makes are recorded and backward
runs each op in the dtype its forward used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec import _cast, _emulate, _expand
from mixprec._state import Context, ThreadState
from mixprec.policies import Category, Policy

_float32 = torch.float32
_Tensor = torch.Tensor

Rule = Callable[[Context, ThreadState, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _explicit_dtype_or_out(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """In-place ``out=`` calls and calls given an explicit dtype are not autocast."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("dtype") is not None):
        return True
    return any(isinstance(a, torch.dtype) for a in args)


def _cache(ctx: Context, state: ThreadState) -> _cast.Cache | None:
    return state.cache if ctx.cache_enabled and torch.is_grad_enabled() else None


def _cast_to(to_lower: bool) -> Rule:
    def rule(ctx: Context, state: ThreadState, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _explicit_dtype_or_out(args, kwargs):
            return func(*args, **kwargs)
        if to_lower:
            cast = _cast.cast_call(args, kwargs, ctx.dtype, ctx.device_type, _cache(ctx, state))
            if ctx.emulate:
                return _emulate.call(ctx.dtype, func, *cast, original=(args, kwargs))
            args, kwargs = cast
        else:
            args, kwargs = _cast.cast_call(args, kwargs, _float32, ctx.device_type, None)
        return func(*args, **kwargs)

    return rule


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


@functools.cache
def _dtype_position(func: Callable[..., Any]) -> int | None:
    """Where a builtin takes ``dtype`` positionally (``softmax(input, dim, dtype)``), from its ATen schemas."""
    name = getattr(func, "__name__", "")
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
    if packet is None:
        return None
    positions = set()
    for overload in packet.overloads():
        positional = [a.name for a in getattr(packet, overload)._schema.arguments if not a.kwarg_only]
        if "dtype" in positional:
            positions.add(positional.index("dtype"))
    return positions.pop() if len(positions) == 1 else None


def _aten_with_fp32_dtype(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call an op reached through ``torch.ops.aten`` with dtype=float32.

    The overload is the one the call resolves to or, when that one has no
    ``dtype`` (``norm.Scalar``), its sibling that adds it (``norm.ScalarOpt_dtype``),
    as ATen's ``fp32_append_dtype`` redispatches.
    """
    packet = func.overloadpacket if isinstance(func, torch._ops.OpOverload) else func
    if func is packet:
        func = getattr(packet, torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs))
    arguments = func._schema.arguments
    names = [a.name for a in arguments]
    values = {**dict(zip(names, args, strict=False)), **kwargs}
    values.update((a.name, a.default_value) for a in arguments if a.name not in values and a.has_default_value())
    if "dtype" not in names:
        siblings = (getattr(packet, o) for o in packet.overloads())
        func = next((o for o in siblings if [a.name for a in o._schema.arguments] == [*names, "dtype"]), None)
        if func is None:
            raise RuntimeError(f"autocast: {packet} has no overload that takes dtype to run in float32.")
    values["dtype"] = _float32
    positional = [values.pop(a.name) for a in func._schema.arguments if not a.kwarg_only]
    return func(*positional, **values)


def _with_fp32_dtype(ctx: Context, state: ThreadState, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """fp32_set_opt_dtype and fp32_append_dtype: run with dtype=float32 if the first input is eligible.

    As ATen's ``set_opt_dtype``, a ``dtype`` passed as None, also positionally, is replaced.
    """
    first = _first_tensor(args, kwargs)
    if _explicit_dtype_or_out(args, kwargs) or not (
        isinstance(first, _Tensor) and _cast.is_eligible(first, ctx.device_type)
    ):
        return func(*args, **kwargs)
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _aten_with_fp32_dtype(func, args, kwargs)
    at = _dtype_position(func)
    if at is not None and len(args) > at and args[at] is None:
        return func(*args[:at], _float32, *args[at + 1 :], **kwargs)
    return func(*args, **{**kwargs, "dtype": _float32})


def promote_dtype(ctx: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype:
    """The widest eligible input dtype: float32 if any eligible input is float32."""
    to = ctx.dtype
    for t in _cast.iter_tensors(args, kwargs):
        if not _cast.is_eligible(t, ctx.device_type):
            continue
        if t.dtype is _float32:
            return _float32
        if t.dtype is not ctx.dtype:
            raise RuntimeError(
                f"autocast promote: inputs mix {t.dtype} with the autocast dtype {ctx.dtype}, "
                "and autocast promotes only between float32 and the autocast dtype. "
                "Cast the inputs to one dtype before the call."
            )
    return to


def _promote(ctx: Context, state: ThreadState, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if _explicit_dtype_or_out(args, kwargs):
        return func(*args, **kwargs)
    to = promote_dtype(ctx, args, kwargs)
    args, kwargs = _cast.cast_call(args, kwargs, to, ctx.device_type, None)
    return func(*args, **kwargs)


def _banned(advice: str) -> Rule:
    def rule(ctx: Context, state: ThreadState, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any(_cast.is_eligible(t, ctx.device_type) for t in _cast.iter_tensors(args, kwargs)):
            raise RuntimeError(advice)
        return func(*args, **kwargs)

    return rule


_RULES: dict[Category, Rule] = {
    Category.LOWER_PRECISION_FP: _cast_to(to_lower=True),
    Category.FP32: _cast_to(to_lower=False),
    Category.FP32_SET_OPT_DTYPE: _with_fp32_dtype,
    Category.FP32_APPEND_DTYPE: _with_fp32_dtype,
    Category.PROMOTE: _promote,
}

_compiled: dict[int, tuple[Policy, dict[Callable[..., Any], Rule]]] = {}


def rules_for(policy: Policy) -> dict[Callable[..., Any], Rule]:
    """The policy's table compiled to ``{callable: rule}`` (cached per policy object)."""
    hit = _compiled.get(id(policy))
    if hit is not None and hit[0] is policy:
        return hit[1]
    rules: dict[Callable[..., Any], Rule] = {}
    for func, category in policy._by_callable.items():
        if category is Category.BANNED:
            rules[func] = _banned(policy.advice(policy._banned_names[func]))
        else:
            rules[func] = _RULES[category]
    if len(_compiled) > 256:
        _compiled.clear()
    _compiled[id(policy)] = (policy, rules)
    return rules


def _touches(ctx: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(t.device.type == ctx.device_type for t in _cast.iter_tensors(args, kwargs))


class AutocastMode(TorchFunctionMode):
    """Routes every torch call made in an autocast region through the policy."""

    def __init__(self, state: ThreadState) -> None:
        super().__init__()
        self._state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        state = self._state
        contexts = state.contexts
        if kwargs is None:
            kwargs = {}
        if not contexts:
            return func(*args, **kwargs)
        try:
            for ctx in contexts:
                rule = ctx.rules.get(func)
                if rule is not None and (len(contexts) == 1 or _touches(ctx, args, kwargs)):
                    return rule(ctx, state, func, args, kwargs)
        except TypeError:
            if not _is_unhashable(func):
                raise
        twin = _expand.twin(func)
        if twin is None or (state.expanding and state.expanding[-1] is func):
            return func(*args, **kwargs)
        if any(t is not _Tensor for t in types):
            return func(*args, **kwargs)  # a tensor subclass handles this composite itself
        state.expanding.append(func)
        torch._C._push_on_torch_function_stack(self)
        try:
            return twin(*args, **kwargs)
        finally:
            torch._C._pop_torch_function_stack()
            state.expanding.pop()


def _is_unhashable(func: object) -> bool:
    try:
        hash(func)
    except TypeError:
        return True
    return False


def push(mode: AutocastMode) -> None:
    torch._C._push_on_torch_function_stack(mode)


def remove(mode: AutocastMode) -> None:
    """Take ``mode`` off the stack, keeping any modes pushed above it in order."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)
