"""The autocast categories: ATen's cast policies, the values of a policy's table.

A category is two pieces of data (``TREATMENTS``): the action its rule takes on
a call's arguments (``Action``, carried out by ``engine._plan``) and the target
format it runs in (``_format.FORMATS``). ATen's six cast policies are the
categories of torch's autocast, with ``fp16`` (float16 whatever the region's dtype: what torch's
cuDNN RNN kernel does, so a policy can say it); ``fp8`` is mixprec's own (``Action.SCALED_MM``
aimed at ``float8_e4m3fn``: the GEMMs of ``linear``, ``mm``, ``addmm`` and
``matmul`` in fp8 with an ``Fp8Recipe``'s scales, the output in the region's
dtype). ``lower_precision_fp`` and ``fp32`` are
one action, casting, aimed at two formats. A new category is a member here, its
line in ``TREATMENTS`` and its ops in a policy's table; a new action is also one
rule in ``engine._plan`` (and what the eager kernels do with it, ``engine._rules``).
"""

from __future__ import annotations

import dataclasses
import enum

from mixprec import _errors
from mixprec.policies._format import E4M3, FLOAT16, FLOAT32, REGION, Format, format_of


class Category(str, enum.Enum):
    """How autocast treats an op; the names are ATen's cast policies."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # cast inputs to the autocast dtype
    FP32 = "fp32"  # cast inputs to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 if the first input is eligible
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # append dtype=float32 (norm)
    PROMOTE = "promote"  # cast all inputs to the widest input dtype
    BANNED = "banned"  # raise, naming the safe alternative
    FP8 = "fp8"  # mixprec's own: the GEMMs in fp8 with scales, the output in the autocast dtype
    FP16 = "fp16"  # cast inputs to float16 whatever the autocast dtype: torch's cuDNN RNN kernel (AutocastRNN.cpp)

    def __str__(self) -> str:
        return self.value

    @property
    def action(self) -> Action:
        """What the category's rule does to a call's arguments."""
        return TREATMENTS[self].action

    @property
    def target(self) -> str | None:
        """The name of the format the category runs its ops in, or None: ``promote`` (the widest input
        decides) and ``banned`` (the op raises on eligible inputs and runs as it is otherwise)."""
        return TREATMENTS[self].target

    @property
    def target_format(self) -> Format | None:
        """The ``Format`` that ``target`` names, or None."""
        return TREATMENTS[self].format

    @classmethod
    def _missing_(cls, value: object) -> Category:
        raise _unknown_category(value) from None


CATEGORIES = tuple(c.value for c in Category)


class Action(str, enum.Enum):
    """What a category's rule does with a call (``engine._plan`` decides each from the call's dtypes)."""

    CAST = "cast"  # cast the eligible tensor arguments to the target
    SET_DTYPE = "set_dtype"  # if the first tensor argument is eligible, dtype=target (unless one is passed)
    APPEND_DTYPE = "append_dtype"  # if the first tensor argument is eligible, the overload that adds dtype=target
    PROMOTE = "promote"  # cast the eligible tensor arguments to the widest of them
    BAN = "ban"  # raise if any tensor argument is eligible
    SCALED_MM = "scaled_mm"  # quantise the GEMM's operands to the target with scales, run torch._scaled_mm

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Treatment:
    """A category as data: its action and the name of its target format (None where the action has none)."""

    action: Action
    target: str | None

    def __post_init__(self) -> None:
        if (self.target is None) != (self.action in _UNTARGETED):
            raise ValueError(
                _errors.message(
                    "Treatment is invalid",
                    "promote and ban take no target format, every other action takes one",
                    received={"action": self.action.value, "target": self.target},
                )
            )
        if self.target is not None:
            format_of(self.target)

    @property
    def format(self) -> Format | None:
        return None if self.target is None else format_of(self.target)


_UNTARGETED = (Action.PROMOTE, Action.BAN)

#: Each category's action and target: ATen's cast policies, read as data.
TREATMENTS: dict[Category, Treatment] = {
    Category.LOWER_PRECISION_FP: Treatment(Action.CAST, REGION),
    Category.FP32: Treatment(Action.CAST, FLOAT32),
    Category.FP32_SET_OPT_DTYPE: Treatment(Action.SET_DTYPE, FLOAT32),
    Category.FP32_APPEND_DTYPE: Treatment(Action.APPEND_DTYPE, FLOAT32),
    Category.PROMOTE: Treatment(Action.PROMOTE, None),
    Category.BANNED: Treatment(Action.BAN, None),
    Category.FP8: Treatment(Action.SCALED_MM, E4M3),
    Category.FP16: Treatment(Action.CAST, FLOAT16),
}

#: The categories of ATen's autocast (``autocast_mode.h``'s cast policies); ``fp8`` is mixprec's own, and
#: ``fp16`` the rule of one hand-written CUDA kernel (cuDNN's RNN casts to float16 in a bfloat16 region too).
ATEN_CATEGORIES = tuple(c for c in Category if c not in (Category.FP8, Category.FP16))


def _unknown_category(value: object) -> Exception:
    named = isinstance(value, str)
    return (ValueError if named else TypeError)(
        _errors.message(
            "Unknown autocast category",
            "a policy sorts ops into ATen's cast categories only" if named else "a category is named by a string",
            received={"category": value},
            expected=CATEGORIES,
        )
    )


def category_of(value: object) -> Category:
    """Parse a category name, with mixprec's error for anything else (TypeError for a non-string)."""
    return Category(value)
