"""The cast categories as kernels' rules on ATen calls: each asks ``_plan`` what to do, then does it.

One rule per action (``policies._category.Action``), made for each category
with its target; a category's rule is ``RULES[category]`` (``banned`` with
the policy's advice).

A rule gets the op overload and its arguments as the dispatcher hands them to
the Autocast key, takes the call's ``_plan.CastPlan``, casts, and calls the op
with that key excluded (so the cast op's own autocast kernel does not run
again, and composites below it are not autocast, as natively). Weights cast
to a format that keeps them (the region's dtype) go through the cast cache
(``_cast``), and an emulated region computes the ops cast to its dtype
(``lower_precision_fp``) through ``_emulate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec.engine import _cast, _emulate, _fp8, _plan, _recompute, _tables
from mixprec.policies import Category
from mixprec.policies._category import Action
from mixprec.policies._recipe import TENSORWISE, Fp8Recipe

_Tensor = torch.Tensor
_eligible = _plan.eligible_tensor
Op = Any  # torch._ops.OpOverload
Rule = Callable[[Op, str, torch.dtype, bool, tuple[Any, ...], dict[str, Any]], Any]


def _eligible_dtypes(device: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.dtype]:
    return [t.dtype for t in _cast.iter_tensors(args, kwargs) if _eligible(t, device)]


def _first_eligible(device: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            return _eligible(value, device)
    return False


def _casting(category: Category) -> Rule:
    """The rule of a ``cast`` category: the eligible tensors cast to its target (through the cast cache where
    the target format keeps weights' casts); emulated where the kernel says so."""
    cached = _plan.keeps_weights(category)
    decide = _plan.decider(category)

    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        to = decide(dtype, (), False, "").cast_to  # (a cast category's plan always casts)
        cast, cast_kwargs = _cast.cast_call(args, kwargs, to, device, cached)  # type: ignore[arg-type]
        if emulate:
            return _emulate.call(dtype, op, cast, cast_kwargs, original=(args, kwargs))
        return op(*cast, **cast_kwargs)

    rule.__name__ = category.value
    return rule


def _bind(op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    arguments = op._schema.arguments
    values = {**{a.name: v for a, v in zip(arguments, args, strict=False)}, **kwargs}
    values.update((a.name, a.default_value) for a in arguments if a.name not in values and a.has_default_value())
    return values


def with_dtype(op: Op) -> Op | None:
    """The sibling overload that takes this one's arguments plus ``dtype`` (norm.Scalar -> norm.ScalarOpt_dtype),
    or the op itself if it takes ``dtype``; None if there is none."""
    names = [a.name for a in op._schema.arguments]
    if "dtype" in names:
        return op
    packet = op.overloadpacket
    for name in packet.overloads():
        sibling = getattr(packet, name)
        if [a.name for a in sibling._schema.arguments] == [*names, "dtype"]:
            return sibling
    return None


def with_dtype_arg(op: Op, args: tuple[Any, ...], kwargs: dict[str, Any], plan: _plan.CastPlan) -> tuple[Any, ...]:
    """``(overload, args, kwargs)``: the call with ``dtype=plan.dtype_arg``, on the overload itself (where a
    dtype the call passes wins) or on the sibling that appends ``dtype``; the call as it is where no overload
    takes one. The eager kernels call the result; the FX pass writes it into the graph."""
    if plan.sibling:
        target = with_dtype(op)
        if target is None:
            return op, args, kwargs
        values = _bind(op, args, kwargs)
    else:
        target, values = op, _bind(op, args, kwargs)
        if "dtype" not in values or values["dtype"] is not None:
            return op, args, kwargs
    values["dtype"] = plan.dtype_arg
    positional = tuple(values.pop(a.name) for a in target._schema.arguments if not a.kwarg_only and a.name in values)
    return target, positional, values


def _with_dtype(category: Category) -> Rule:
    """The rule of a ``set_dtype`` or ``append_dtype`` category: the call with the plan's ``dtype=``."""

    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        plan = _plan.plan(category, dtype, first_eligible=_first_eligible(device, args, kwargs))
        if plan.dtype_arg is None:
            return op(*args, **kwargs)
        target, args, kwargs = with_dtype_arg(op, args, kwargs, plan)
        return target(*args, **kwargs)

    rule.__name__ = category.value
    return rule


def _promoting(category: Category) -> Rule:
    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        plan = _plan.plan(category, dtype, _eligible_dtypes(device, args, kwargs))
        if plan.error is not None:
            raise RuntimeError(plan.error)
        args, kwargs = _cast.cast_call(args, kwargs, plan.cast_to, device, False)  # type: ignore[arg-type]
        return op(*args, **kwargs)

    rule.__name__ = category.value
    return rule


def banned(category: Category, advice: str) -> Rule:
    """The rule of a ``ban`` category, raising ``advice``."""

    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        plan = _plan.plan(category, dtype, _eligible_dtypes(device, args, kwargs), advice=advice)
        if plan.error is not None:
            raise RuntimeError(plan.error)
        return op(*args, **kwargs)

    return rule


def scaled(category: Category, recipe: Fp8Recipe) -> Rule:
    """The rule of a ``scaled_mm`` category (``fp8``) under ``recipe``: a GEMM that fp8 can run (``_fp8.as_linear``)
    runs in the plan's format with its output in the region's dtype; any other call is cast to the region's
    dtype, as ``lower_precision_fp`` casts it. So is every call in backward but a checkpoint's recompute (a
    backward run inside the region, or the one AOTAutograd traces under the forward's state): an fp8 op's own
    backward GEMMs are its Function's, and a GEMM met there is another op's gradient (a layer a module policy
    keeps out of fp8), which must not be quantised."""
    decide = _plan.decider(category)
    task_id = _compat.graph_task_id

    def rule(op: Op, device: str, dtype: torch.dtype, emulate: bool, args: Any, kwargs: Any) -> Any:
        plan = decide(dtype, (), False, "")
        if task_id() >= 0 and not _recompute.recomputing():
            cast, cast_kwargs = _cast.cast_call(args, kwargs, plan.cast_to, device, True)  # type: ignore[arg-type]
            if emulate:
                return _emulate.call(dtype, op, cast, cast_kwargs, original=(args, kwargs))
            return op(*cast, **cast_kwargs)
        to: torch.dtype = plan.cast_to  # type: ignore[assignment]
        return run_scaled(op, device, to, recipe, args, kwargs, cached=True, emulate=emulate)

    rule.__name__ = category.value
    return rule


def run_scaled(
    op: Op, device: str, dtype: torch.dtype, recipe: Fp8Recipe, args: Any, kwargs: Any, *, cached: bool,
    emulate: bool = False,
) -> Any:
    """A call of an fp8 category's op: in fp8 under ``recipe`` with its output in ``dtype`` (the region's) where
    fp8 can run it, else as ``lower_precision_fp`` runs it: its eligible tensors cast to ``dtype`` (weights
    through the cast cache if ``cached``), computed through ``_emulate`` in an emulated region. The eager
    kernels call it, and so do the fp8 nodes the FX pass writes (``graph._fp8``), which decide at run time as
    the kernels do."""
    found = _fp8.as_linear(op, args, kwargs, device)
    if found is not None:
        unavailable = _compat.no_autograd_function()
        if unavailable is not None:
            raise NotImplementedError(
                _errors.message(
                    f"{op.name()} cannot run in fp8 under {unavailable}",
                    "fp8's GEMMs are an autograd Function, which torch.func runs only at its own layer, above the "
                    "autocast kernels, and which has no forward-mode derivative",
                    fix="Call the transform or the forward-mode AD outside the fp8 region, or run these ops in the "
                    "region's dtype for it (policy.with_ops(lower_precision_fp=[...]) or a module policy).",
                )
            )
        x, weight, bias, source = found
        return _fp8.linear(x, weight, bias, recipe, dtype, source)
    cast, cast_kwargs = _cast.cast_call(args, kwargs, dtype, device, cached)
    if emulate:
        return _emulate.call(dtype, op, cast, cast_kwargs, original=(args, kwargs))
    return op(*cast, **cast_kwargs)


#: What a kernel calls for its op: ``runner(args, kwargs)``, with the Autocast key excluded.
Runner = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def runner(op: Op, device_type: str, category: Category, rule: Rule, emulate: bool, as_native: bool = False) -> Runner:
    """``rule`` bound to ``op`` and the device, called with the region's dtype; a cast without emulated compute
    written out (``_casting``'s rule less its frame and plan lookup: the kernels' commonest call). ``as_native``:
    the op runs as torch's own autocast kernel runs it (its native category, native compute), so its weights'
    casts follow torch's cache rules (``_cast.cache_for_call``) whatever region it runs in."""
    get_dtype = torch.get_autocast_dtype
    if category.action is not Action.CAST or emulate:
        return lambda args, kwargs: rule(op, device_type, get_dtype(device_type), emulate, args, kwargs)
    fixed = _plan.cast_dtype(category)
    cached = _plan.keeps_weights(category)
    call = _compat.raw_op(op)
    cast_call = _cast.cast_call

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cast, cast_kwargs = cast_call(args, kwargs, fixed or get_dtype(device_type), device_type, cached, as_native)
        return call(*cast, **cast_kwargs)

    run.cast_plan = (fixed, cached, as_native)  # type: ignore[attr-defined]  # what the C++ kernels do (_fastpath)
    return run


def transform_guard(op: Op, category: Category, run: Runner, split: dict[str, str]) -> Runner:
    """``run``, refused under a torch.func transform: ``split`` (``_tables.transform_split``) gives the ops
    torch.func breaks into one another different categories, so the call may stand for another op whose
    category it would not follow. ``linear`` is no op's piece, and an fp8 op refuses transforms itself; the C++
    kernels send every call under a transform here."""
    if op.overloadpacket.__name__ == "linear" or category.action is Action.SCALED_MM:
        return run
    active = _compat.functorch_active

    def guarded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if active():
            raise NotImplementedError(
                _errors.message(
                    f"{op.name()} cannot follow this policy under a torch.func transform",
                    f"torch.func breaks {', '.join(_tables.TRANSFORM_GROUP)} into one another before autocast sees "
                    "them, so this call may be another op's piece, and the policy gives those ops different "
                    "categories",
                    received={"categories": split},
                    fix="Give them one category (policy.with_ops(fp32=[...]) with all of them), or call the "
                    "transform outside the region.",
                )
            )
        return run(args, kwargs)

    guarded.cast_plan = getattr(run, "cast_plan", None)  # type: ignore[attr-defined]  # (None: no plain cast)
    return guarded


#: How the kernels carry out each action (a ``ban`` needs the policy's advice: ``banned``).
_MAKE: dict[Action, Callable[[Category], Rule]] = {
    Action.CAST: _casting,
    Action.SET_DTYPE: _with_dtype,
    Action.APPEND_DTYPE: _with_dtype,
    Action.PROMOTE: _promoting,
}

#: Each category's rule, but banned ones (and ``scaled_mm``'s with the default recipe: a policy's own recipe
#: makes its own, ``_kernels.rule_for``).
RULES: dict[Category, Rule] = {c: _MAKE[c.action](c) for c in Category if c.action in _MAKE}
RULES.update({c: scaled(c, TENSORWISE) for c in Category if c.action is Action.SCALED_MM})
