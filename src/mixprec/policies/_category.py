"""The autocast categories: ATen's cast policies, the values of a policy's table."""

from __future__ import annotations

import enum

from mixprec import _errors


class Category(str, enum.Enum):
    """How autocast treats an op; the names are ATen's cast policies."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # cast inputs to the autocast dtype
    FP32 = "fp32"  # cast inputs to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 if the first input is eligible
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # append dtype=float32 (norm)
    PROMOTE = "promote"  # cast all inputs to the widest input dtype
    BANNED = "banned"  # raise, naming the safe alternative

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Category:
        raise _unknown_category(value) from None


CATEGORIES = tuple(c.value for c in Category)


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
