"""The Policy: an immutable table from op to autocast category."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Iterable, Mapping

from mixprec import _errors
from mixprec.policies import _advice, _resolve


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


CATEGORIES = tuple(c.value for c in Category)


def category_of(value: object) -> Category:
    """Parse a category name, with mixprec's error for anything else."""
    try:
        return Category(value)
    except ValueError:
        raise ValueError(
            _errors.message(
                "Unknown autocast category",
                "a policy sorts ops into ATen's cast categories only",
                received={"category": value},
                expected=CATEGORIES,
            )
        ) from None


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """Which ops autocast casts, and to what.

    A policy is data: ``table`` maps each op name (ATen or docs spelling) to a
    :class:`Category`. Lookups by callable go through the same names, so
    ``torch.softmax``, ``torch.Tensor.softmax`` and ``"softmax"`` agree.

    Example:
        >>> import mixprec
        >>> mixprec.policies.CUDA.category("softmax")
        'fp32_set_opt_dtype'
        >>> mixprec.policies.CPU.category(torch.mm)
        'lower_precision_fp'
    """

    name: str
    table: Mapping[str, Category]

    @classmethod
    def from_lists(cls, name: str, lists: Mapping[str, Iterable[str]]) -> Policy:
        """Build a policy from ``{category: [op names]}`` (a data module's TABLE)."""
        table: dict[str, Category] = {}
        for category, ops in lists.items():
            parsed = category_of(category)
            for op in ops:
                table[op.strip()] = parsed
        return cls(name, types.MappingProxyType(table))

    def category(self, op: str | Callable[..., object]) -> str | None:
        """The category of ``op`` (a name or a torch callable), or None if unlisted."""
        found = self.table.get(op.strip()) if isinstance(op, str) else self._by_callable.get(op)
        return None if found is None else found.value

    def ops(self, category: str) -> tuple[str, ...]:
        """The op names in one category, sorted."""
        wanted = category_of(category)
        return tuple(sorted(op for op, c in self.table.items() if c is wanted))

    def advice(self, op: str) -> str:
        """The text a banned op raises."""
        return _advice.ADVICE.get(
            op,
            f"{op} is banned in autocast regions by the policy {self.name!r}.",
        )

    @functools.cached_property
    def _by_callable(self) -> Mapping[Callable[..., object], Category]:
        found: dict[Callable[..., object], Category] = {}
        for op, category in self.table.items():
            for func in _resolve.callables(op):
                found[func] = category
        return found

    @functools.cached_property
    def _banned_names(self) -> Mapping[Callable[..., object], str]:
        return {
            func: op
            for op, category in self.table.items()
            if category is Category.BANNED
            for func in _resolve.callables(op)
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self.name == other.name and dict(self.table) == dict(other.table)

    def __hash__(self) -> int:
        return hash((self.name, frozenset(self.table.items())))

    def __repr__(self) -> str:
        counts = ",".join(
            f"{c.value}={sum(1 for v in self.table.values() if v is c)}"
            for c in Category
            if any(v is c for v in self.table.values())
        )
        return f"Policy({self.name}: {counts})"
