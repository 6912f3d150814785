"""The interception mode: one dict lookup per torch call, then the category's rule.

Algorithm for each intercepted call ``func(*args, **kwargs)``::

    for each enabled device context:
        rule = context.rules.get(func)          # compiled from the policy table
        if rule and the call touches that device: return rule(...)
    if func is a Python composite that can reach a listed op (mixprec._reach):
        run its twin with the mode pushed       # inner ops are intercepted
    else:
        return func(*args, **kwargs)            # mode is off here: runs natively

The mode sits above autograd, so the casts it makes are recorded and backward
runs each op in the dtype its forward used.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec import _cast, _compile, _emulate, _expand, _reach, _shelf, _state
from mixprec._state import Context, ThreadState
from mixprec.policies import Category, Policy

_float32 = torch.float32
_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_UNSEEN: Any = object()

_dtype = torch.dtype
Func = Callable[..., Any]
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Rule = Callable[[Context, ThreadState, Func, Args, Kwargs], Any]


def _explicit_dtype_or_out(args: Args, kwargs: Kwargs) -> bool:
    """In-place ``out=`` calls and calls given an explicit dtype are not autocast."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("dtype") is not None):
        return True
    return _dtype in map(type, args)


def _cast_to(to_lower: bool) -> Rule:
    def rule(ctx: Context, state: ThreadState, func: Func, args: Args, kwargs: Kwargs) -> Any:
        if kwargs and (kwargs.get("out") is not None or kwargs.get("dtype") is not None):
            return func(*args, **kwargs)
        dtype, device = (ctx.dtype, ctx.device_type) if to_lower else (_float32, ctx.device_type)
        # No cache under torch.compile: a graph computes each cast once anyway, and weakrefs cannot be traced.
        use_cache = to_lower and ctx.cache_enabled and torch.is_grad_enabled() and not _is_compiling()
        cache = state.cache if use_cache else None
        cast = _cast.cast_args(args, dtype, device, cache)
        if cast is None:  # an explicit dtype among the positional arguments
            return func(*args, **kwargs)
        cast_kwargs = {k: _cast.cast_value(v, dtype, device, cache) for k, v in kwargs.items()} if kwargs else kwargs
        if to_lower and ctx.emulate:
            return _emulate.call(dtype, func, cast, cast_kwargs, original=(args, kwargs))
        return func(*cast, **cast_kwargs)

    return rule


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


@_compile.constant
def _dtype_position(func: Callable[..., Any]) -> int | None:
    """Where a builtin takes ``dtype`` positionally (``softmax(input, dim, dtype)``), from its ATen schemas."""
    return _schema_dtype_position(func)


@functools.cache
def _schema_dtype_position(func: Callable[..., Any]) -> int | None:
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


def _with_fp32_dtype(ctx: Context, state: ThreadState, func: Func, args: Args, kwargs: Kwargs) -> Any:
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


def _promote(ctx: Context, state: ThreadState, func: Func, args: Args, kwargs: Kwargs) -> Any:
    if _explicit_dtype_or_out(args, kwargs):
        return func(*args, **kwargs)
    to = promote_dtype(ctx, args, kwargs)
    args, kwargs = _cast.cast_call(args, kwargs, to, ctx.device_type, None)
    return func(*args, **kwargs)


def _banned(advice: str) -> Rule:
    def rule(ctx: Context, state: ThreadState, func: Func, args: Args, kwargs: Kwargs) -> Any:
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

@dataclasses.dataclass(frozen=True)
class Compiled:
    """A policy compiled for the mode: ``{callable: rule}``, and which composites to expand."""

    rules: dict[Func, Rule]
    names: frozenset[str]
    twins: dict[Func, Func | None]

    def twin(self, func: Func) -> Func | None:
        """The twin to run ``func`` as, or None to run it natively (memoized per policy)."""
        try:
            return self.twins[func]
        except TypeError:  # an unhashable callable
            return None
        except KeyError:
            made = _expand.twin(func)
            custom_op = isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
            if made is not None and not custom_op and not _reach.reaches(func, self.names):  # custom ops: always
                made = None
            self.twins[func] = made
            return made


_compiled: dict[int, tuple[Policy, Compiled]] = {}
_shelved = _shelf.Shelf(limit=256)


def compile_policy(policy: Policy) -> Compiled:
    """The policy's table compiled for the mode (cached per policy object)."""
    hit = _compiled.get(id(policy))
    if hit is not None and hit[0] is policy:
        return hit[1]
    rules: dict[Func, Rule] = {}
    for func, category in policy._by_callable.items():
        if category is Category.BANNED:
            rules[func] = _banned(policy.advice(policy._banned_names[func]))
        else:
            rules[func] = _RULES[category]
    compiled = Compiled(rules, _reach.policy_names(dict(policy.table), rules), {})
    if len(_compiled) > 256:
        _compiled.clear()
    _compiled[id(policy)] = (policy, compiled)
    return compiled


def traced_policy(policy: Policy) -> Compiled:
    """``compile_policy(policy)`` as torch.compile can trace it: built eagerly, read as a guarded attribute."""
    return _shelf.fetch(_shelved, policy, _compile_for_trace)  # type: ignore[no-any-return]


def _compile_for_trace(policy: Policy) -> Compiled:
    _compile.register_policy(policy)
    return compile_policy(policy)


def _touches(ctx: Context, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(t.device.type == ctx.device_type for t in _cast.iter_tensors(args, kwargs))


class AutocastMode(TorchFunctionMode):
    """Routes every torch call made in an autocast region through the policy."""

    def __init__(self, state: ThreadState) -> None:
        super().__init__()
        self._state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _is_compiling():
            return _traced(self, func, types, args, kwargs or {})
        state = self._state
        contexts = state.contexts
        if kwargs is None:
            kwargs = {}
        if len(contexts) == 1:
            ctx = contexts[0]
            try:
                rule = ctx.rules.get(func)
            except TypeError:  # an unhashable callable: not in any table
                return func(*args, **kwargs)
            if rule is not None:
                return rule(ctx, state, func, args, kwargs)
            twin = ctx.compiled.twins.get(func, _UNSEEN)  # inlined Compiled.twin: most calls end here
            if twin is _UNSEEN:
                twin = ctx.compiled.twin(func)
        elif contexts:
            rule, ctx = self._route(contexts, func, args, kwargs)
            if rule is not None:
                return rule(ctx, state, func, args, kwargs)
            twin = next((t for c in contexts if (t := c.compiled.twin(func)) is not None), None)
        else:
            return func(*args, **kwargs)
        if twin is None or (state.expanding and state.expanding[-1] is func):
            return func(*args, **kwargs)
        return _run_twin(self, state, func, twin, types, args, kwargs)

    @staticmethod
    def _route(contexts: tuple[Context, ...], func: Func, args: Args, kwargs: Kwargs) -> tuple[Rule | None, Any]:
        """With several devices enabled: the rule of the first device whose tensors the call touches."""
        for ctx in contexts:
            try:
                rule = ctx.rules.get(func)
            except TypeError:
                return None, None
            if rule is not None and _touches(ctx, args, kwargs):
                return rule, ctx
        return None, None


def _traced(mode: AutocastMode, func: Func, types: Any, args: Args, kwargs: Kwargs) -> Any:
    """The mode under torch.compile and torch.export: what the trace sees is constant.

    The state is read through its global (dynamo tracks a region entered inside the
    trace on that object, not on the mode's reference to it); the category of ``func``
    and whether to expand it are computed eagerly (``assume_constant_result``), so the
    graph guards on the policy object, not on every key of its rule table. Custom ops
    that no policy lists run as one op, as under native autocast in a compiled graph.
    """
    state = _state.get()
    contexts = state.contexts
    if not contexts:
        return func(*args, **kwargs)
    for ctx in contexts:
        rule = _traced_rule(ctx.policy, func)
        if rule is not None and (len(contexts) == 1 or _touches(ctx, args, kwargs)):
            return rule(ctx, state, func, args, kwargs)
    expands = any(_compile.expands(ctx.policy, func) for ctx in contexts)
    twin = _expand.traced_twin(func) if expands else None
    if twin is None or (state.expanding and state.expanding[-1] is func):
        return _compile.call(func, args, kwargs)
    return _run_twin(mode, state, func, twin, types, args, kwargs)


def _run_twin(
    mode: AutocastMode, state: ThreadState, func: Func, twin: Func, types: Any, args: Args, kwargs: Kwargs
) -> Any:
    """Run ``func`` as its twin with the mode pushed, so that the ops inside it reach the mode."""
    for t in types:
        if t is not _Tensor:
            return func(*args, **kwargs)  # a tensor subclass handles this composite itself
    state.expanding.append(func)
    torch._C._push_on_torch_function_stack(mode)
    try:
        return twin(*args, **kwargs)
    finally:
        torch._C._pop_torch_function_stack()
        state.expanding.pop()


_RULES_BY_NAME = {category.value: rule for category, rule in _RULES.items()}


def _traced_rule(policy: Policy, func: Func) -> Rule | None:
    """The rule for ``func`` under torch.compile, from a constant category."""
    category = _compile.category(policy, func)
    if category is None:
        return None
    if category == "banned":
        return _banned(_compile.advice(policy, func))
    return _RULES_BY_NAME[category]


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
