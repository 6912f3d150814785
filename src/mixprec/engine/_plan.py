"""What each category does to an op's arguments, written once: eligibility and the cast plan.

Every consumer decides through this module and only executes the answer:

* the eager kernels (``_rules``), on the tensors the dispatcher hands them;
* the FX pass (``mixprec.graph.apply_policy``), on the fake values its nodes carry;
* ``mixprec.explain``, on the dtypes it is asked about;
* the tests' reference interpreter, which derives the same from ATen's ``autocast_mode.h`` independently and
  is compared with mixprec op by op (``tests/reference.py``).

A category is an action and a target format (``policies._category.TREATMENTS``); the
target resolves to a dtype in the region (``"region"``: the region's dtype).
The actions, as ATen's ``autocast_mode.h`` defines its categories::

    eligible(tensor)  floating, not float64, on the region's device
    cast              cast eligible tensors to the target
                      (lower_precision_fp: the region's dtype; fp32: float32)
    set_dtype         if the first tensor argument is eligible: dtype=target, unless the call passes one
                      (fp32_set_opt_dtype)
    append_dtype      if the first tensor argument is eligible: the sibling overload that adds dtype=target
                      (fp32_append_dtype)
    promote           cast eligible tensors to the widest eligible dtype: float32 if any is float32, else
                      the region's dtype; another low-precision dtype among them is an error
    ban               an error (the policy's advice) if any tensor argument is eligible (banned)
    scaled_mm         the GEMM in the target fp8 format with scales, the output in the region's dtype, where
                      every tensor argument is eligible and the GEMM's sizes are multiples of 16 (the rule
                      checks the call); otherwise cast eligible tensors to the region's dtype (fp8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from mixprec import _errors
from mixprec.policies import Category
from mixprec.policies._category import Action
from mixprec.policies._format import REGION, Format

_float32 = torch.float32
_float64 = torch.float64


@dataclasses.dataclass(frozen=True)
class CastPlan:
    """What a call becomes under a category: its eligible tensors cast to ``cast_to`` (None: left as they are),
    ``dtype=dtype_arg`` passed (None: not), through the sibling overload that takes ``dtype`` if ``sibling``;
    or, if ``error`` is set, a RuntimeError with that text instead of the call. With ``scaled`` (an fp8
    format's name), the GEMM runs in that format with scales and returns ``cast_to``; ``cast_to`` is also what
    the call is cast to where it cannot run in fp8."""

    cast_to: torch.dtype | None = None
    dtype_arg: torch.dtype | None = None
    sibling: bool = False
    error: str | None = None
    scaled: str | None = None


#: The call as it is (no category, or a conditional category whose condition does not hold).
AS_IS = CastPlan()
_TO: dict[torch.dtype, CastPlan] = {}


def eligible_dtype(dtype: torch.dtype) -> bool:
    """Whether autocast may cast a tensor of ``dtype`` (on the region's device): floating and not float64."""
    return dtype.is_floating_point and dtype is not _float64


def eligible_tensor(t: torch.Tensor, device_type: str) -> bool:
    """``eligible`` for a tensor (the kernels' hot path: ``is_cpu`` is cheaper than ``device.type``)."""
    dtype = t.dtype
    if not dtype.is_floating_point or dtype is _float64:
        return False
    return t.is_cpu if device_type == "cpu" else t.device.type == device_type


def eligible(dtype: torch.dtype, on: str, device_type: str | None) -> bool:
    """Whether autocast may cast a tensor of ``dtype`` on device type ``on`` in a region on ``device_type``
    (None: any device, as a device-agnostic graph pass asks)."""
    return dtype.is_floating_point and dtype is not _float64 and (device_type is None or on == device_type)


def cast_to(dtype: torch.dtype) -> CastPlan:
    """The plan that casts every eligible tensor to ``dtype`` (one object per dtype)."""
    found = _TO.get(dtype)
    if found is None:
        found = _TO[dtype] = CastPlan(cast_to=dtype)
    return found


def plan(
    category: Category | None,
    region_dtype: torch.dtype,
    eligible_dtypes: Iterable[torch.dtype] = (),
    first_eligible: bool = False,
    advice: str = "",
) -> CastPlan:
    """The cast plan of a call under ``category`` in a region of ``region_dtype``.

    Args:
        category: The op's category under the policy in force, or None (not autocast).
        region_dtype: The region's lower-precision dtype.
        eligible_dtypes: The dtypes of the call's eligible tensor arguments, in argument order (read by
            ``promote`` and ``banned`` only, so it may be a lazy iterable).
        first_eligible: Whether the call's first tensor argument is eligible (read by the ``fp32_*_dtype``
            categories only).
        advice: The text a ``banned`` op raises (``Policy.advice``).
    """
    decide = _DECIDE.get(category)  # type: ignore[arg-type]
    return AS_IS if decide is None else decide(region_dtype, eligible_dtypes, first_eligible, advice)


def decider(category: Category) -> Callable[[torch.dtype, Iterable[torch.dtype], bool, str], CastPlan]:
    """``plan`` for one category, as a function of ``plan``'s other arguments, positional (a kernel's rule
    calls it on every call: one frame less than ``plan``)."""
    return _DECIDE[category]


def _promote(region_dtype: torch.dtype, eligible_dtypes: Iterable[torch.dtype]) -> CastPlan:
    """float32 at the first float32 input, an error at the first other dtype that is not the region's
    (ATen's ``promote_type``, which meets the inputs in order)."""
    for dtype in eligible_dtypes:
        if dtype is _float32:
            return cast_to(_float32)
        if dtype is not region_dtype:
            return CastPlan(
                error=_errors.message(
                    "autocast promote",
                    f"inputs mix another lower-precision dtype with the autocast dtype {region_dtype}, and "
                    "autocast promotes only between float32 and the autocast dtype",
                    received={"dtype": dtype},
                    expected=["float32", str(region_dtype).removeprefix("torch.")],
                    fix="Cast the inputs to one dtype before the call.",
                )
            )
    return cast_to(region_dtype)


_Decide = Callable[[torch.dtype, Iterable[torch.dtype], bool, str], CastPlan]


def _needed(target: Format | None) -> Format:
    """The target of an action that has one (``Treatment`` already refuses such an action without one)."""
    if target is None:
        raise ValueError(_errors.message("A cast or dtype action has no target format", "every such action needs one"))
    return target


def cast_dtype(category: Category) -> torch.dtype | None:
    """The dtype a ``cast`` category's plan casts to whatever the region's dtype, or None where it is the
    region's (the kernels' cast runner binds it once, instead of asking ``plan`` on every call)."""
    if category.action is not Action.CAST:
        raise ValueError(
            _errors.message("No cast dtype", "only a cast category has one", received={"category": category.value})
        )
    return _needed(category.target_format).dtype


def _cast(target: Format | None) -> _Decide:
    dtype = _needed(target).dtype
    if dtype is None:
        return lambda region_dtype, eligible_dtypes, first, advice: cast_to(region_dtype)
    fixed = cast_to(dtype)
    return lambda region_dtype, eligible_dtypes, first, advice: fixed


def _with_dtype(sibling: bool) -> Callable[[Format | None], _Decide]:
    def make(target: Format | None) -> _Decide:
        dtype = _needed(target).dtype
        if dtype is None:
            return lambda region_dtype, eligible_dtypes, first, advice: (
                CastPlan(dtype_arg=region_dtype, sibling=sibling) if first else AS_IS
            )
        fixed = CastPlan(dtype_arg=dtype, sibling=sibling)
        return lambda region_dtype, eligible_dtypes, first, advice: fixed if first else AS_IS

    return make


def _scaled(target: Format | None) -> _Decide:
    name = _needed(target).name
    plans: dict[torch.dtype, CastPlan] = {}

    def decide(region_dtype: torch.dtype, eligible_dtypes: Iterable[torch.dtype], first: bool, advice: str) -> CastPlan:
        found = plans.get(region_dtype)
        if found is None:
            found = plans[region_dtype] = CastPlan(cast_to=region_dtype, scaled=name)
        return found

    return decide


def _banned(region_dtype: torch.dtype, eligible_dtypes: Iterable[torch.dtype], first: bool, advice: str) -> CastPlan:
    return CastPlan(error=advice) if any(True for _ in eligible_dtypes) else AS_IS


#: Each action's rule, made for a target format (the module docstring's table).
_ACTIONS: dict[Action, Callable[[Format | None], _Decide]] = {
    Action.CAST: _cast,
    Action.SET_DTYPE: _with_dtype(sibling=False),
    Action.APPEND_DTYPE: _with_dtype(sibling=True),
    Action.PROMOTE: lambda target: lambda region_dtype, eligible_dtypes, first, advice: _promote(
        region_dtype, eligible_dtypes
    ),
    Action.BAN: lambda target: _banned,
    Action.SCALED_MM: _scaled,
}

#: Each category's rule: its action made for its target, once.
_DECIDE: dict[Category, _Decide] = {c: _ACTIONS[c.action](c.target_format) for c in Category}


def keeps_weights(category: Category) -> bool:
    """Whether a category's casts keep a weight's cast for reuse (the cast cache; the graph pass shares one cast
    node): where its target format keeps them (``Format.cached``: the region's dtype), and an fp8 op's, whose
    calls that cannot run in fp8 cast to the region's dtype. Any other cast is made afresh at each use, as is
    any cast of a tensor that is not a weight (``_cast.is_weight``)."""
    target = category.target_format
    return category.action is Action.SCALED_MM or (target is not None and target.cached)


#: The categories whose compute in the region's dtype emulated compute takes over: those that cast to it
#: (``lower_precision_fp``), and fp8's, whose calls fp8 cannot run run as ``lower_precision_fp`` does.
REGION_CASTS = frozenset(
    c for c in Category if (c.action is Action.CAST and c.target == REGION) or c.action is Action.SCALED_MM
)
