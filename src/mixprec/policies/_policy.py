"""The Policy: an immutable table from op to autocast category."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec.policies import _advice, _names, _resolve, _serial
from mixprec.policies._builtin import BUILTIN
from mixprec.policies._category import Category, category_of
from mixprec.policies._recipe import TENSORWISE, Fp8Recipe


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """Which ops autocast casts, and to what.

    A policy is data: ``table`` maps each op name (ATen or docs spelling) to a
    :class:`Category`. Lookups by callable go through the same names, so
    ``torch.softmax``, ``torch.Tensor.softmax`` and ``"softmax"`` agree.
    ``base`` names the built-in policy the table started from, so that what
    the user changed (:attr:`changes`) stays known.

    A policy is immutable: ``with_ops`` and ``without_ops`` return new ones.
    Ops are named by docs spelling (``"softmax"``), by torch callables
    (``torch.softmax``) or by ``torch.ops`` packets and overloads, which is how
    custom ops (``torch.library.custom_op``, ``torch.library.Library``) get a
    category. An overload's entry (``"aten::mm.default"``) wins over its op's
    (``"mm"``).

    Examples:
        >>> import mixprec
        >>> mixprec.policies.CUDA.category("softmax")
        'fp32_set_opt_dtype'
        >>> mixprec.policies.CPU.category(torch.mm)
        'lower_precision_fp'
        >>> mixprec.policies.CPU.target(torch.mm), mixprec.policies.CUDA.target("softmax")
        ('region', 'float32')
        >>> mine = mixprec.policies.CPU.with_ops(fp32=[torch.mm]).without_ops("cat")
        >>> mine.changes
        {'cat': None, 'mm': 'fp32'}
    """

    name: str
    table: Mapping[str, Category]
    base: str | None = None
    #: How the ops in the ``fp8`` category scale their tensors (``with_fp8_recipe``); None: the default,
    #: tensorwise (``fp8_recipe`` resolves it). None rather than the default object: dynamo before 2.13 cannot
    #: pass a recipe into a policy made while it traces, and refusing such a policy is mixprec's to say.
    fp8: Fp8Recipe | None = None
    #: What the policy holds, as one hashable value: policies compare and hash by content, so that caches
    #: keyed by a policy serve an equal one made later (set once, by ``__post_init__``).
    content: tuple[str, str | None, frozenset[tuple[str, Category]], Fp8Recipe | None] = dataclasses.field(
        init=False, repr=False, compare=False
    )
    _hash: int | None = dataclasses.field(init=False, repr=False, compare=False)  # None: made while dynamo traced

    def __post_init__(self) -> None:
        _check_fields(self.name, self.table, self.base)
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise TypeError(
                _errors.message("Policy fp8 is invalid", "it must be an fp8 recipe", received={"fp8": self.fp8},
                                expected="a mixprec.policies.Fp8Recipe")
            )  # fmt: skip
        if self.fp8 is not None and self.fp8 == TENSORWISE:
            object.__setattr__(self, "fp8", None)  # one spelling of the default, so that equal policies compare equal
        # A private copy, so that the caller's mapping cannot change the policy after the fact.
        object.__setattr__(self, "table", types.MappingProxyType(dict(self.table)))
        content = (self.name, self.base, frozenset(self.table.items()), self.fp8)
        object.__setattr__(self, "content", content)  # (a frozen dataclass sets its derived fields so)
        object.__setattr__(self, "_hash", None if _compat.dynamo_tracing() else hash(content))
        _compat.share(self)  # findable from compiled code on releases whose dynamo cannot pass it

    @classmethod
    def from_lists(cls, name: str, lists: Mapping[str, Iterable[str]], base: str | None = None) -> Policy:
        """Build a policy from ``{category: [op names]}`` (a data module's TABLE).

        Names are kept as given, also those the installed torch lacks (a documented list may hold them).
        """
        if not isinstance(lists, Mapping):
            raise TypeError(
                _errors.message(
                    "Policy.from_lists: lists is invalid",
                    "it must map category names to op names",
                    received={"lists": lists},
                    expected="a mapping such as {'fp32': ['softmax']}",
                )
            )
        table: dict[str, Category] = {}
        for category, ops in lists.items():
            parsed = category_of(category)
            for op in _serial._string_list("lists", str(category), ops):
                table[_names.table_key(op) or op] = parsed  # "aten::mm" -> "mm", as every other way in spells it
        return cls(name, types.MappingProxyType(table), base)

    def with_ops(self, **ops: Any) -> Policy:
        """A new policy with ``ops`` moved to their categories: ``with_ops(fp32=[torch.mm, "bmm"])``.

        Each keyword is a category; its value is one op or an iterable of ops.
        """
        table = dict(self.table)
        moved: dict[str, list[str]] = {}
        for category, given in ops.items():
            parsed = category_of(category)
            names = _names.op_names(given, self.table)
            _names.check_dtype_category(parsed, names)
            moved.setdefault(parsed.value, []).extend(names)
            table.update(dict.fromkeys(names, parsed))
        _serial.check_once("with_ops", moved, [])
        return self._derived(table)

    def without_ops(self, ops: Any) -> Policy:
        """A new policy in which ``ops`` are not autocast: they run in the dtype their inputs give.

        Removing an op also removes the entries of its overloads (``"mm"`` takes
        ``"aten::mm.default"`` with it).
        """
        return self._derived(_without(self.table, _names.op_names(ops, self.table, removing=True)))

    def _derived(self, table: Mapping[str, Category]) -> Policy:
        return Policy(self.name, types.MappingProxyType(dict(table)), self.base, self.fp8)

    @property
    def fp8_recipe(self) -> Fp8Recipe:
        """The recipe the ``fp8`` ops of this policy scale by (the default: tensorwise dynamic scaling)."""
        return TENSORWISE if self.fp8 is None else self.fp8

    def with_fp8_recipe(self, recipe: Fp8Recipe | None = None, **fields: Any) -> Policy:
        """A new policy whose ``fp8`` ops scale by ``recipe``, or by this policy's recipe with ``fields`` changed:
        ``with_fp8_recipe(scaling="rowwise", power_of_2=True)``."""
        if recipe is not None and not isinstance(recipe, Fp8Recipe):
            raise TypeError(
                _errors.message("with_fp8_recipe: recipe is invalid", "it must be an fp8 recipe",
                                received={"recipe": recipe}, expected="a mixprec.policies.Fp8Recipe, or fields")
            )  # fmt: skip
        unknown = [f for f in fields if f not in _RECIPE_FIELDS]
        if unknown:
            raise TypeError(
                _errors.message("with_fp8_recipe got an unknown field", "a recipe has these fields",
                                received={"field": unknown[0]}, expected=list(_RECIPE_FIELDS))
            )  # fmt: skip
        chosen = dataclasses.replace(recipe if recipe is not None else self.fp8_recipe, **fields)
        return Policy(self.name, self.table, self.base, chosen)

    @property
    def changes(self) -> dict[str, str | None]:
        """What differs from ``base``: ``{op: new category, or None if no longer listed}``, sorted."""
        return {op: new for op, (new, _old) in self._diff(_serial.base_table(self.base)).items()}

    def diff(self, other: Policy) -> dict[str, tuple[str | None, str | None]]:
        """``{op: (category here, category in other)}`` for every op the two treat differently, sorted."""
        if not isinstance(other, Policy):
            raise TypeError(
                _errors.message("Cannot diff policies", "the other must be a Policy", received={"other": other},
                                expected="a mixprec.Policy")
            )
        return self._diff(other.table)

    def _diff(self, other: Mapping[str, Category]) -> dict[str, tuple[str | None, str | None]]:
        names = sorted(set(self.table) | set(other))
        pairs = ((n, self.table.get(n), other.get(n)) for n in names)
        return {n: (_value(a), _value(b)) for n, a, b in pairs if a is not b}

    def to_dict(self) -> dict[str, Any]:
        """The policy as plain data (see ``from_dict``): name, base, ops moved, ops removed."""
        out: dict[str, Any] = {"name": self.name}
        if self.base is not None:
            out["base"] = self.base
        changes = self.changes
        removed = [n for n, c in changes.items() if c is None]
        if removed:
            out["without_ops"] = removed
        out["ops"] = {c.value: [n for n, m in changes.items() if m == c.value] for c in Category}
        out["ops"] = {c: names for c, names in out["ops"].items() if names}
        if self.fp8 is not None:  # the recipe's fields that differ from the default's
            fields = ((f, getattr(self.fp8, f)) for f in _RECIPE_FIELDS)
            out["fp8"] = {f: value for f, value in fields if value != getattr(TENSORWISE, f)}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Build a policy from ``to_dict``'s output: ``base``'s table, minus ``without_ops``, plus ``ops``."""
        return cls._from_checked(*_serial.check(data))

    @classmethod
    def _from_checked(
        cls, name: str, base: str | None, moved: dict[str, list[str]], removed: list[str], fp8: Fp8Recipe | None = None
    ) -> Policy:
        table = _without(_serial.base_table(base), removed)
        table.update((n, Category(c)) for c, names in moved.items() for n in names)
        return cls(name, types.MappingProxyType(table), base, fp8)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy from a TOML file laid out as ``to_dict`` (see ``to_toml``)."""
        return cls._from_checked(*_serial.check(_serial.read_toml(path), where=f"file {os.fspath(path)!r}"))

    def to_toml(self) -> str:
        """The policy as the TOML text ``from_file`` reads."""
        return _serial.to_toml(self.to_dict())

    def category(self, op: str | Callable[..., object]) -> str | None:
        """The category of ``op`` (a name, a torch callable or a custom op), or None if unlisted.

        A name is looked up as the table spells it. A callable is decided as its calls are: an overload by its own
        entry, else its op's; a builtin such as ``torch.mm`` by the entry of the overload a usual call reaches
        (``aten::mm.default``). ``mixprec.explain(op, example=...)`` answers for one call's arguments.

        Raises ValueError if ``op`` names nothing torch has and the table does not list it, as ``with_ops`` does.
        """
        target = _names.dispatched(op)  # a custom_op object: the overload its calls reach
        if callable(target) and not isinstance(target, str):
            found = self._by_callable.get(target)
            if found is not None:
                return found.value
        found = self.table.get(_names.op_name(target, self.table))
        return None if found is None else found.value

    def target(self, op: str | Callable[..., object]) -> str | None:
        """The format ``op`` runs in under this policy: ``"region"`` (the region's lower-precision dtype),
        ``"float32"``, or None where no format is fixed (``promote``: its widest input; ``banned``; unlisted).

        The target is the op's category's (``Category.target``); ``op`` is named as for :meth:`category`.
        """
        category = self.category(op)
        return None if category is None else Category(category).target

    def ops(self, category: str) -> tuple[str, ...]:
        """The op names in one category, sorted."""
        wanted = category_of(category)
        return tuple(sorted(op for op, c in self.table.items() if c is wanted))

    def advice(self, op: str) -> str:
        """The text a banned op raises: why, the safe alternative, and how to lift the ban."""
        if not isinstance(op, str):
            raise TypeError(
                _errors.message(
                    "Policy.advice: op is invalid", "it is the op's table name", received={"op": op}, expected="a str"
                )
            )
        why = _advice.ADVICE.get(
            op,
            f"{op} is banned in autocast regions by the policy {self.name!r}. The safe alternative is "
            "to call it outside the autocast region, on float32 inputs.",
        )
        ref = f"mixprec.policies.{self.name}" if self.name in BUILTIN and not self.changes else "policy"
        return (
            f"{why} To lift the ban, move the op to float32: pass "
            f"policy={ref}.with_ops(fp32=[{op!r}]) to mixprec.autocast."
        )

    @functools.cached_property
    def _by_callable(self) -> Mapping[Callable[..., object], Category]:
        found: dict[Callable[..., object], Category] = {}
        for op, category in sorted(self.table.items(), key=_names.overloads_last):
            for func in _resolve.callables(op):
                found[func] = category
        # An overload's own entry also decides the op's builtins and packet (``torch.mm``): the entry of the
        # overload a call with the op's usual arguments reaches (``default``, or the op's only functional one),
        # else the category all its functional overloads agree on.
        for op in sorted({o for o in map(_names.op_of_overload, self.table) if o is not None}):
            overloads = _resolve.dispatcher_overloads(op)
            usual = [o for o in overloads if o._overloadname == "default"] or list(overloads * (len(overloads) == 1))
            agreed = {self._overload_category(o) for o in usual or overloads}
            decided = agreed.pop() if len(agreed) == 1 else None
            if decided is not None:
                found.update((f, decided) for f in _resolve.callables(op) if not isinstance(f, torch._ops.OpOverload))
        return found

    def _overload_category(self, op: torch._ops.OpOverload) -> Category | None:
        return next((self.table[n] for n in _names.entry_names(op) if n in self.table), None)

    @functools.cached_property
    def _banned_names(self) -> Mapping[Callable[..., object], str]:
        return {
            func: op
            for op, category in sorted(self.table.items(), key=_names.overloads_last)
            if category is Category.BANNED
            for func in _resolve.callables(op)
        }

    def __copy__(self) -> Policy:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> Policy:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.name, dict(self.table), self.base, self.fp8))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        if self is other:
            return True
        if self._hash is not None and other._hash is not None and self._hash != other._hash:
            return False
        return self.content == other.content

    def __hash__(self) -> int:
        return self._hash if self._hash is not None else hash(self.content)

    def __repr__(self) -> str:
        counts = ",".join(
            f"{c.value}={sum(1 for v in self.table.values() if v is c)}"
            for c in Category
            if any(v is c for v in self.table.values())
        )
        changed = len(self.changes)
        origin = f", {changed} change{'s' * (changed != 1)} to {self.base}" if changed and self.base else ""
        return f"Policy({self.name}{origin}: {counts or 'empty'})"


_RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(Fp8Recipe))


def _check_fields(name: object, table: object, base: object) -> None:
    """TypeError / ValueError for a Policy built from anything but a name, ``{op name: Category}`` and a base."""
    fix = "Build a table from category names with Policy.from_lists(name, {'fp32': ['softmax']})."
    if not isinstance(name, str):
        raise TypeError(
            _errors.message("Policy name is invalid", "it must be a string", received={"name": name}, expected="a str")
        )
    if not isinstance(table, Mapping):
        raise TypeError(
            _errors.message("Policy table is invalid", "it must map op names to categories", received={"table": table},
                            expected="a mapping such as {'softmax': Category.FP32}", fix=fix)
        )
    for op, category in table.items():
        if not isinstance(op, str) or not isinstance(category, Category):
            raise TypeError(
                _errors.message("Policy table is invalid", "it must map op names (strings) to Category members",
                                received={"op": op, "category": category},
                                expected="Category members: " + ", ".join(f"Category.{c.name}" for c in Category),
                                fix=fix)
            )
    if base is not None and (not isinstance(base, str) or base not in BUILTIN):
        raise (ValueError if isinstance(base, str) else TypeError)(
            _errors.message("Policy base is invalid", "it must name a built-in policy", received={"base": base},
                            expected=list(BUILTIN))
        )


def _without(table: Mapping[str, Category], names: list[str]) -> dict[str, Category]:
    """``table`` without the entries of ``names``, an op's taking its overloads' entries with it (``without_ops``
    and a policy file's ``without_ops`` both come here)."""
    prefixes = tuple(p for n in names for p in ((f"{n}.",) if "::" in n else (f"{n}.", f"aten::{n}.")))
    kept = {k: v for k, v in table.items() if k not in names and not k.startswith(prefixes)}
    for name in names:
        op = _names.op_of_overload(name)
        if op is not None and op in kept:
            raise ValueError(
                _errors.message(
                    "Cannot take an overload out of autocast on its own",
                    f"its op is listed as {kept[op].value}, and that entry covers every overload",
                    received={"op": name},
                    expected=f"the op itself, {op!r}",
                    fix=f"Use without_ops({op!r}), then with_ops to list the overloads you want autocast.",
                )
            )
    return kept


def _rebuild(name: str, table: dict[str, Category], base: str | None, fp8: Fp8Recipe | None = None) -> Policy:
    return Policy(name, types.MappingProxyType(table), base, fp8)


def _value(category: Category | None) -> str | None:
    return None if category is None else category.value
