"""``explain``: why an op runs in the dtype it does under autocast.

Algorithm::

    call     = the ATen call the op makes (_explain_run): with the example given, or with arguments made
               from its schema; a Python callable is traced to the ATen op it reaches (torch.norm(x)
               reaches aten::linalg_vector_norm, which explain then explains)
    entry    = the overload's own name if the policy lists it, else its op's name, else none
    category = the category the kernels apply to the overload: the policy's effective table
               (_tables.effective: a default table counts only where torch has an Autocast kernel)
    outcome  = the call run on small real tensors of the input dtypes, through the rule the kernels apply
               (_kernels.rule_for): the dtype it runs in, or the error it raises. An op with no category
               whose decomposition reaches ops with one is not run: they are named instead.
    source   = "user change" if entry differs from the policy's base,
               else the base's kind: "default table" or "documented table"

Where no call can be made (an op whose arguments the schema does not tell, and no
example), the category's casts and torch's type promotion give the dtype, and
``note`` says so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Container
from typing import Any, overload

import torch
import torch.utils._pytree

from mixprec import _autocast, _call_sites, _errors, _explain_run
from mixprec.engine import _devices, _kernels, _plan, _tables
from mixprec.policies import Category, Policy, _names, _resolve, _serial
from mixprec.policies._category import Action

_float32 = torch.float32


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What autocast does with one op; ``str()`` reads as a sentence or two.

    Attributes:
        op: The op's table name (``"softmax"``, ``"mylib::op"``).
        entry: The table entry that decides it (the op's own or its op's for an
            overload), or None if the policy does not list it.
        category: The entry's category, or None (the op runs in its inputs' dtype).
        target: The category's target format: ``"region"`` (``dtype``), ``"float32"``, or None (no
            category, or one whose inputs decide: ``promote``; or ``banned``).
        source: Where the entry comes from: ``"default table CPU (torch 2.15)"``,
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
    target: str | None = None

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


@overload
def explain(  # type: ignore[overload-overlap]
    op: torch.nn.Module,
    device_type: str = ...,
    policy: Policy | None = ...,
    *,
    dtype: torch.dtype | None = ...,
    input_dtypes: tuple[torch.dtype, ...] | None = ...,
    example: tuple[Any, ...] | None = ...,
    example_kwargs: dict[str, Any] | None = ...,
) -> _call_sites.CallSites: ...


@overload
def explain(
    op: object,
    device_type: str = ...,
    policy: Policy | None = ...,
    *,
    dtype: torch.dtype | None = ...,
    input_dtypes: tuple[torch.dtype, ...] | None = ...,
    example: tuple[Any, ...] | None = ...,
    example_kwargs: dict[str, Any] | None = ...,
) -> Explanation: ...


def explain(
    op: object,
    device_type: str = "cpu",
    policy: Policy | None = None,
    *,
    dtype: torch.dtype | None = None,
    input_dtypes: tuple[torch.dtype, ...] | None = None,
    example: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> Explanation | _call_sites.CallSites:
    """Explain what autocast does with ``op``: its category, the dtype it runs in, and why.

    Given a model (an ``nn.Module``) and ``example``, it runs the model once without gradients under
    ``mixprec.autocast(device_type, dtype, policy)`` and lists each call of the matmul family (linear, mm,
    addmm, matmul) by module path, with the format it runs in and why (:class:`CallSites`): which calls run
    in fp8, and which a module policy, ``choose_fp8_layers`` or their shapes keep out.

    The answer comes from running the op on small tensors of ``input_dtypes``, through the rule mixprec's
    kernels apply (nothing is registered, and nothing changes in the process): with ``example``'s arguments
    if given, else with arguments made from the op's schema.

    Args:
        op: An op name, torch callable or ``torch.ops`` packet/overload. A Python callable is explained by
            the ATen op its call reaches (``torch.norm(x)`` reaches ``aten::linalg_vector_norm``). Or a model.
        device_type: The autocast device.
        policy: The policy to ask; defaults to the one in force for ``device_type``.
        dtype: The autocast dtype; defaults to the one in force for ``device_type``.
        input_dtypes: The dtypes of the op's floating tensor inputs, first input first (the last one repeats
            for the rest). Default: the example's, else float32.
        example: Positional arguments of a call of ``op`` (tensors, values), when its schema does not tell
            explain what to pass, or to ask about exactly that call.
        example_kwargs: Keyword arguments of that call.

    Examples:
        >>> why = mixprec.explain(torch.softmax, "cpu", mixprec.policies.CUDA)
        >>> why.category, why.runs_in, why.source.startswith("default table CUDA (torch 2.")
        ('fp32_set_opt_dtype', torch.float32, True)
    """
    _devices.spec(device_type)
    policy = _autocast.get_policy(device_type) if policy is None else policy
    _errors.check_type("policy", policy, Policy)
    _errors.check_type("dtype", dtype, torch.dtype, optional=True)
    _errors.check_type("example", example, tuple, optional=True, what="explain")
    _errors.check_type("example_kwargs", example_kwargs, dict, optional=True, what="explain")
    if dtype is not None:
        _devices.check_dtype("explain", device_type, dtype)
    dtype = _autocast.get_autocast_dtype(device_type) if dtype is None else dtype
    if isinstance(op, torch.nn.Module):
        if example is None:
            raise ValueError(
                _errors.message("explain: a model needs example=", "explain runs the model once to find its calls",
                                received={"example": None}, expected="a tuple of the model's positional inputs")
            )  # fmt: skip
        return _call_sites.call_sites(op, example, example_kwargs or {}, device_type, policy, dtype)
    asked = _names.dispatched(op)
    name = _names.op_name(asked, policy.table)
    args, kwargs = example or (), example_kwargs or {}
    if input_dtypes is None and example is not None:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        found = [t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        input_dtypes = tuple(found) or (_float32,)
    inputs = _input_dtypes((_float32,) if input_dtypes is None else input_dtypes)
    if isinstance(asked, str) and not _resolve.dispatcher_overloads(name):  # ("__matmul__": run what reaches it)
        asked = next((f for f in _resolve.callables(name) if not isinstance(f, torch._ops.OpOverload)), asked)
    call = _call(asked, name, len(inputs), example is not None, args, kwargs, _tables.effective(policy, device_type)[0])
    notes = []
    if call is not None and call.op.overloadpacket._qualified_op_name != _packet_of(name):
        notes.append(f"{_describe(asked)} reaches {_tables.qualified(call.op)} with these inputs")
        name = _names.op_name(call.op.overloadpacket, policy.table)
    # The call's overload decides as the kernels look it up (_tables.entry_name); a name that made no call
    # (or a docs spelling such as "__matmul__") by its own entry, then its op's.
    names = ([] if call is None else [_tables.entry_name(policy, call.op)]) + _entries(name)
    entry = next((n for n in names if n in policy.table), None)
    category = _category(policy, device_type, name, entry, call)
    if category is None:
        entry = None  # unlisted, or listed where torch applies no kernel (a default table: see _category)
    if category is None and "::" in name and not name.startswith("aten::"):
        cast, runs_in, raises = inputs, None, None
        notes.append(_CUSTOM_NOTE)
    elif call is None:
        cast, runs_in, raises = _run(category, dtype, inputs, policy, entry)
        notes.append(_UNRUN_NOTE)
    elif category is None and (reached := _explain_run.callees(call, _tables.effective(policy, device_type)[0])):
        cast, runs_in, raises = inputs, None, None
        listed = ", ".join(sorted({f"{_tables.qualified(o)} ({c.value})" for o, c in reached}))
        notes.append(_COMPOSITE_NOTE.format(callees=listed))
    else:
        rule = None if category is None else _kernels.rule_for(policy, call.op, category)
        outcome = _explain_run.run(call, _run_device(device_type), dtype, rule, inputs)
        cast, runs_in, raises = outcome.cast_inputs, outcome.runs_in, outcome.raises
    if category is not None and category.action is Action.SCALED_MM and raises is None:
        notes.append(_FP8_NOTE.format(target=category.target, dtype=str(dtype).removeprefix("torch.")))
    return Explanation(
        op=name,
        entry=entry,
        category=None if category is None else category.value,
        target=None if category is None else category.target,
        source=_source(policy, entry if entry is not None else name),
        policy=policy.name,
        device_type=device_type,
        dtype=dtype,
        input_dtypes=inputs,
        cast_inputs=tuple(cast),
        runs_in=runs_in,
        raises=raises,
        note="; ".join(notes) or None,
    )


_FP8_NOTE = (
    "fp8: where every tensor input is float32, bfloat16 or float16 on the device and the GEMM's sizes are "
    "multiples of 16, the GEMM and both backward GEMMs run in {target} through torch._scaled_mm with the "
    "policy's scaling recipe, the output in {dtype}; any other call runs in {dtype}"
)

_CUSTOM_NOTE = (
    "an unlisted custom op runs its kernel with autocast on, as native autocast falls through to it, "
    "so the ops the kernel calls are autocast by their own categories. Give the op a category with "
    "Policy.with_ops to fix its dtype."
)

_COMPOSITE_NOTE = (
    "an op with no category that decomposes into ops with one: under autocast those are cast by their own "
    "categories: {callees}. Explain them, or give this op a category with Policy.with_ops"
)

_UNRUN_NOTE = (
    "explain could not make a call of this op from its schema, so the dtype is the category's casts under "
    "torch's type promotion (an op that needs equal input dtypes raises instead); pass example= to run it"
)


def _packet_of(name: str) -> str:
    qualified = name if "::" in name else f"aten::{name}"
    return qualified.split(".")[0]


def _describe(op: object) -> str:
    if isinstance(op, str):
        return op
    module = getattr(op, "__module__", None) or ""
    return f"{module}.{getattr(op, '__qualname__', repr(op))}".lstrip(".")


def _call(
    asked: object, name: str, count: int, given: bool, args: tuple[Any, ...], kwargs: dict[str, Any],
    listed: Container[Any],
) -> _explain_run.Call | None:
    """The ATen call to run for ``asked`` (see ``_explain_run``; a callable's first ``listed`` one), or None."""
    if callable(asked) and not isinstance(asked, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if given:
            found = _explain_run.traced(asked, args, kwargs, listed)
            if found is not None:
                return found
            # (the trace raised with autocast off, as a call of mixed dtypes may: the example runs by the name)
        else:
            # As many tensors as input_dtypes gives, else one or two more, its last dtype repeated (``x @ y``
            # needs two), as ``_explain_run.run`` repeats it.
            counts = (count, count + 1, count + 2)
            for n, shape in ((n, s) for n in counts for s in _explain_run.SHAPES):
                tensors = tuple(_explain_run.Spec(shape, _float32, True) for _ in range(n))
                found = _explain_run.traced(asked, tensors, {}, listed)
                if found is not None:
                    return found
    qualified = name if "::" in name else f"aten::{name}"
    if given:
        return _explain_run.from_example(asked, qualified, args, kwargs)
    return _explain_run.synthesize(qualified)


def _category(
    policy: Policy, device_type: str, name: str, entry: str | None, call: _explain_run.Call | None
) -> Category | None:
    """The category the kernels apply: the effective table's for the call's overload where the device's
    Autocast key is reachable; otherwise the entry's (a default table's only where torch has a kernel)."""
    if call is not None and _tables.autocast_key(device_type) is not None:
        return _tables.effective(policy, device_type)[0].get(call.op)
    if entry is None or not _torch_applies(policy, device_type, name):
        return None
    return policy.table[entry]


def _run_device(device_type: str) -> str:
    """The device explain runs its tensors on: the autocast device where it is here, else the CPU standing in."""
    return device_type if _devices.spec(device_type).available() else "cpu"


def _torch_applies(policy: Policy, device_type: str, name: str) -> bool:
    """False for an entry of the device's own default table that this torch has no Autocast kernel for."""
    if policy != _tables.default_policy(device_type) or _tables.autocast_key(device_type) is None:
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


def _run(
    category: Category | None, dtype: torch.dtype, inputs: tuple[torch.dtype, ...], policy: Policy, entry: str | None
) -> tuple[tuple[torch.dtype, ...], torch.dtype | None, str | None]:
    """(input dtypes after the casts, the dtype the op runs in or None, the error text or None): the engine's
    cast plan on dtypes alone, for an op explain cannot call."""
    eligible = _plan.eligible_dtype
    plan = _plan.plan(
        category,
        dtype,
        (d for d in inputs if eligible(d)),
        first_eligible=eligible(inputs[0]),
        advice=policy.advice(entry or "") if category is not None and category.action is Action.BAN else "",
    )
    if plan.error is not None:
        return inputs, None, plan.error
    if plan.dtype_arg is not None:
        return inputs, plan.dtype_arg, None
    cast = tuple(plan.cast_to if plan.cast_to is not None and eligible(d) else d for d in inputs)
    return cast, functools.reduce(torch.promote_types, cast), None


def _source(policy: Policy, entry: str) -> str:
    base = _serial.base_table(policy.base)
    if policy.table.get(entry) is not base.get(entry):
        op = _names.op_of_overload(entry)  # an overload's own entry: its op's entry decided it before
        was = base.get(entry) or (base.get(op) if op is not None else None)
        before = "unlisted" if was is None else was.value
        return f"user change (was {before} in {policy.base})" if policy.base else f"table of policy {policy.name}"
    from mixprec.policies import DOCUMENTED, describes

    release = describes(policy)
    table = f"{'documented' if policy.base in DOCUMENTED else 'default'} table {policy.base}"
    if release is not None:  # a default table is per torch release
        table += f" ({release})"
    if policy.base is None:
        table = f"table of policy {policy.name}"
    return table if entry in policy.table else f"{table} does not list it"

