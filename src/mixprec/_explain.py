"""``explain``: why an op runs in the dtype it does under autocast.

Algorithm::

    entry    = the op's own name if the policy lists it, else its op's name
               (``aten::mm.default`` -> ``mm``), else none
    category = policy.table[entry]
    (the device's default policy: only if torch has an Autocast kernel for the op, as
     mixprec then leaves the op to torch; see _tables.check_native)
    runs_in  = the category's rule in _rules applied to the input dtypes:
               eligible inputs (floating, not float64) are cast, then torch's
               type promotion gives the dtype the op computes and returns in
    source   = "user change" if entry differs from the policy's base,
               else the base's kind: "default table" or "documented table"
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from mixprec import _autocast, _devices, _errors, _tables
from mixprec.policies import _names, _serial
from mixprec.policies._policy import Category, Policy

_float32 = torch.float32


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What autocast does with one op; ``str()`` reads as a sentence or two.

    Attributes:
        op: The op's table name (``"softmax"``, ``"mylib::op"``).
        entry: The table entry that decides it (the op's own or its op's for an
            overload), or None if the policy does not list it.
        category: The entry's category, or None (the op runs in its inputs' dtype).
        source: Where the entry comes from: ``"default table CPU"``,
            ``"documented table CUDA_DOCUMENTED"``, ``"user change (...)"``,
            ``"table of policy <name>"``, or for an unlisted op ``"<table> does not list it"``.
        policy: The policy's name.
        device_type: The autocast device; the inputs are taken to live on it.
        dtype: The autocast (lower-precision) dtype.
        input_dtypes: The dtypes of the op's tensor inputs, first input first.
        cast_inputs: The dtypes the inputs reach the op in, after autocast's casts.
        runs_in: The dtype the op computes and returns in, or None if it raises
            or if its kernel decides (an unlisted custom op, see ``note``).
        raises: The error text if the call raises under autocast, else None.
        note: Why ``runs_in`` is None without an error, else None.
    """

    op: str
    entry: str | None
    category: str | None
    source: str
    policy: str
    device_type: str
    dtype: torch.dtype
    input_dtypes: tuple[torch.dtype, ...]
    cast_inputs: tuple[torch.dtype, ...]
    runs_in: torch.dtype | None
    raises: str | None
    note: str | None = None

    def __str__(self) -> str:
        name = _devices.dtype_name
        listed = f"{self.category} (entry {self.entry!r}, {self.source})" if self.entry else f"unlisted ({self.source})"
        inputs = ", ".join(name(d) for d in self.input_dtypes)
        if self.runs_in is not None:
            outcome = f"runs in {name(self.runs_in)}"
        elif self.raises is not None:
            outcome = f"raises: {self.raises}".rstrip(".")
        else:
            outcome = f"runs as its kernel decides: {self.note}".rstrip(".")
        return (
            f"{self.op} under {self.device_type} autocast to {name(self.dtype)}, policy {self.policy}: {listed}. "
            f"With inputs ({inputs}) it {outcome}."
        )


def explain(
    op: object,
    device_type: str = "cpu",
    policy: Policy | None = None,
    *,
    dtype: torch.dtype | None = None,
    input_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> Explanation:
    """Explain what autocast does with ``op``: its category, the dtype it runs in, and why.

    Args:
        op: An op name, torch callable or ``torch.ops`` packet/overload.
        device_type: The autocast device.
        policy: The policy to ask; defaults to the one in force for ``device_type``.
        dtype: The autocast dtype; defaults to the one in force for ``device_type``.
        input_dtypes: The dtypes of the op's tensor inputs (all on ``device_type``).

    Example:
        >>> why = mixprec.explain(torch.softmax, "cpu", mixprec.policies.CUDA)
        >>> why.category, why.runs_in, why.source
        ('fp32_set_opt_dtype', torch.float32, 'default table CUDA')
    """
    _devices.spec(device_type)
    policy = _autocast.get_policy(device_type) if policy is None else policy
    _errors.check_type("policy", policy, Policy)
    _errors.check_type("dtype", dtype, torch.dtype, optional=True)
    if dtype is not None:
        _devices.check_dtype("explain", device_type, dtype)
    dtype = _autocast.get_autocast_dtype(device_type) if dtype is None else dtype
    inputs = _input_dtypes(input_dtypes)
    name = _names.op_name(_names.dispatched(op), policy.table)
    entry = next((n for n in _entries(name) if n in policy.table), None)
    category = None if entry is None else policy.table[entry]
    if category is not None and not _torch_applies(policy, device_type, name):
        entry, category = None, None
    cast, runs_in, raises = _run(category, dtype, inputs, policy, entry)
    note = None
    if category is None and "::" in name and not name.startswith("aten::"):
        runs_in, note = None, _CUSTOM_NOTE
    elif "." not in name and any(k.startswith((f"aten::{name}.", f"{name}.")) for k in policy.table):
        overloads = sorted(k for k in policy.table if k.startswith((f"aten::{name}.", f"{name}.")))
        runs_in, note = None, _OVERLOAD_NOTE.format(overloads=", ".join(overloads))
    return Explanation(
        op=name,
        entry=entry,
        category=None if category is None else category.value,
        source=_source(policy, entry if entry is not None else name),
        policy=policy.name,
        device_type=device_type,
        dtype=dtype,
        input_dtypes=inputs,
        cast_inputs=cast,
        runs_in=runs_in,
        raises=raises,
        note=note,
    )


_CUSTOM_NOTE = (
    "an unlisted custom op runs its kernel with autocast on, as native autocast falls through to it, "
    "so the ops the kernel calls are autocast by their own categories. Give the op a category with "
    "Policy.with_ops to fix its dtype."
)


_OVERLOAD_NOTE = (
    "the policy lists overloads of this op on their own ({overloads}); a call takes their category when it "
    "reaches one of them at the dispatcher (torch.softmax(x, -1) reaches aten::softmax.int), else this one."
)


def _torch_applies(policy: Policy, device_type: str, name: str) -> bool:
    """False for an entry of the device's own default table that this torch has no Autocast kernel for."""
    if policy is not _tables.default_policy(device_type) or _tables.autocast_key(device_type) is None:
        return True
    ops = _tables.overloads(name)
    return not ops or any(op in _tables.native(device_type) for op in ops)


def _input_dtypes(given: object) -> tuple[torch.dtype, ...]:
    if isinstance(given, torch.dtype):
        given = (given,)
    if isinstance(given, (tuple, list)) and given and all(isinstance(d, torch.dtype) for d in given):
        return tuple(given)
    raise TypeError(
        _errors.message("explain: input_dtypes is invalid", "it must list the dtypes of the op's tensor inputs",
                        received={"input_dtypes": given}, expected="a non-empty tuple of torch.dtype")
    )


def _entries(name: str) -> list[str]:
    """The table names that can decide ``name``: its own, then its op's for an overload."""
    op = _names.op_of_overload(name)
    return [name] if op is None else [name, op]


def _eligible(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype is not torch.float64


def _run(
    category: Category | None, dtype: torch.dtype, inputs: tuple[torch.dtype, ...], policy: Policy, entry: str | None
) -> tuple[tuple[torch.dtype, ...], torch.dtype | None, str | None]:
    """(input dtypes after the casts, the dtype the op runs in or None, the error text or None)."""
    to: torch.dtype | None = None
    if category is Category.LOWER_PRECISION_FP:
        to = dtype
    elif category is Category.FP32:
        to = _float32
    elif category in (Category.FP32_SET_OPT_DTYPE, Category.FP32_APPEND_DTYPE):
        if _eligible(inputs[0]):
            return inputs, _float32, None
    elif category is Category.PROMOTE:
        to = _promote(dtype, inputs)
        if to is None:
            return inputs, None, f"autocast promote: inputs mix dtypes other than float32 and {dtype}"
    elif category is Category.BANNED and any(_eligible(d) for d in inputs):
        return inputs, None, policy.advice(entry or "")
    cast = tuple(to if to is not None and _eligible(d) else d for d in inputs)
    return cast, functools.reduce(torch.promote_types, cast), None


def _promote(dtype: torch.dtype, inputs: tuple[torch.dtype, ...]) -> torch.dtype | None:
    """As ``_rules.promote_dtype``: float32 at the first float32, an error at another dtype first."""
    for d in inputs:
        if not _eligible(d) or d is dtype:
            continue
        return _float32 if d is _float32 else None
    return dtype


def _source(policy: Policy, entry: str) -> str:
    base = _serial.base_table(policy.base)
    if policy.table.get(entry) is not base.get(entry):
        before = base[entry].value if entry in base else "unlisted"
        return f"user change (was {before} in {policy.base})" if policy.base else f"table of policy {policy.name}"
    from mixprec.policies import DOCUMENTED

    table = f"{'documented' if policy.base in DOCUMENTED else 'default'} table {policy.base}"
    if policy.base is None:
        table = f"table of policy {policy.name}"
    return table if entry in policy.table else f"{table} does not list it"

