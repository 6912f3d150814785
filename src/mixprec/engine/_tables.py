"""Policies as the dispatcher sees them: a category for each ATen op overload.

Native autocast registers a kernel at a device's Autocast key for some
overloads of the ops its table lists (``softmax.int`` but not
``softmax.Dimname``, ``_convolution.deprecated`` only). A policy names ops, so
for policy ``P`` on a device whose default table is ``D``, an overload ``o`` of
op ``X`` gets::

    P[o] if P[o] != D[o]       # the policy changes it
    native(o) otherwise        # D's category if torch has a kernel for o, else none (falls through)

where ``D`` and ``native`` are those of the policy's base device (``CUDA``'s
are cuda's, also when the policy runs on CPU; a documented or custom table
uses the device it runs on). ``P[o]`` is the overload's own entry if the table
has one, else its op's. Overloads whose category so differs from torch's
native one on the device need a mixprec kernel; the default policy needs none.
"""

from __future__ import annotations

import functools

import torch

from mixprec import _compat, _errors
from mixprec.engine import _devices, _memo
from mixprec.policies import Category, Policy, _names, _resolve

Op = torch._ops.OpOverload


_defaults: dict[str, Policy] = {}


def default_policy(device_type: str) -> Policy:
    """The device's default policy (built on first use)."""
    found = _defaults.get(device_type)
    if found is None:
        import mixprec.policies as policies

        found = _defaults[device_type] = getattr(policies, _devices.spec(device_type).policy)
    return found


def autocast_key(device_type: str) -> str | None:
    """The name of the device's Autocast dispatch key (``AutocastCPU``), or None if Python cannot reach it."""
    backend = _compat.backend_key(device_type)
    if backend is None:
        return None
    key = "Autocast" + backend
    return key if _compat.dispatch_key(key) is not None else None


def qualified(op: Op) -> str:
    """``aten::mm`` for a default overload, ``aten::softmax.int`` for others (as the dispatcher lists them)."""
    name: str = op.overloadpacket._qualified_op_name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def overloads(name: str) -> tuple[Op, ...]:
    """The functional overloads a table entry covers (``_resolve.dispatcher_overloads``, where the rule lives)."""
    return _resolve.dispatcher_overloads(name)


def categories(policy: Policy) -> dict[Op, Category]:
    """Every overload the policy's table reaches, with its category; an overload's own entry wins."""
    found: dict[Op, Category] = {}
    for name, category in sorted(policy.table.items(), key=_names.overloads_last):
        for op in overloads(name):
            found[op] = category
    return found


def entry_name(policy: Policy, op: Op) -> str:
    """The table entry that decides ``op``'s category: the overload's own (``"mm.default"``, ``"aten::mm.default"``)
    before its op's (``"mm"``, ``"aten::mm"``), as ``categories`` applies them; the op's name if none does."""
    names = _names.entry_names(op)  # (``qualified`` drops ``.default``; a table may spell it)
    return next((name for name in names if name in policy.table), names[2])


@functools.cache
def native_registrations(key: str) -> frozenset[str]:
    """The overloads torch itself has kernels for at ``key``, read before mixprec registers any there."""
    return frozenset(_compat.registrations(key))


def native(device_type: str) -> dict[Op, Category]:
    """What torch's own autocast does on the device, overload by overload."""
    key = autocast_key(device_type)
    registered = native_registrations(key) if key is not None else frozenset()
    return {op: c for op, c in _categories_of_default(device_type).items() if qualified(op) in registered}


#: (device type, policy) -> ``effective``'s answer (a policy's content is its key: an equal policy shares it).
_by_policy: _memo.Memo[tuple[str, Policy], tuple[dict[Op, Category], frozenset[Op]]] = _memo.Memo(256, "tables")


def effective(policy: Policy, device_type: str) -> tuple[dict[Op, Category], frozenset[Op]]:
    """``(categories, changed)``: the category of each overload under ``policy`` on the device, and
    the overloads where that differs from torch's native autocast there (they need mixprec kernels)."""
    hit = _by_policy.get((device_type, policy))
    if hit is not None:
        return hit
    reference = _reference_device(policy, device_type)
    mine = categories(policy)
    base = _categories_of_default(reference)
    out = dict(native(reference))
    for op in mine.keys() | base.keys():
        category = mine.get(op)
        if category is not base.get(op):
            if category is None:
                out.pop(op, None)
            else:
                out[op] = category
    here = native(device_type)
    changed = frozenset(op for op in out.keys() | here.keys() if out.get(op) is not here.get(op))
    return _by_policy.put((device_type, policy), (out, changed))


#: Ops that torch.func breaks into one another above the Autocast keys, which then never see the op made:
#: ``linear`` into ``matmul`` or ``addmm`` (grad, jvp; vmap without a bias), ``matmul`` into ``mm``, ``bmm``, ``mv``
#: or ``dot`` (grad, jvp), vmap's ``mm`` and ``bmm`` into ``matmul``. Under a transform a call of one of them may
#: stand for another (tests/test_interop.py probes which ops the transforms bypass, on each release).
TRANSFORM_GROUP = ("linear", "matmul", "mm", "bmm", "addmm", "mv", "dot")


def transform_split(policy: Policy, device_type: str) -> dict[str, str]:
    """The category ``policy`` gives each ``TRANSFORM_GROUP`` op with a kernel on the device (``"unlisted"``: none
    of its own), by op name, where they are not all one and not those of its base device's default policy
    (which the transforms treat as torch's native autocast treats them: ``dot`` is ``promote`` on CUDA); else
    ``{}``."""
    mine = _group(effective(policy, device_type)[0], device_type)
    if len(set(mine.values())) < 2:
        return {}
    default, _ = effective(default_policy(_reference_device(policy, device_type)), device_type)
    return {} if mine == _group(default, device_type) else mine


def transform_overloads(table: dict[Op, Category], device_type: str) -> list[Op]:
    """The ``TRANSFORM_GROUP`` overloads with a kernel on the device under ``table`` (its own, or torch's)."""
    ops = table.keys() | native(device_type).keys()
    return sorted((op for op in ops if op.overloadpacket.__name__ in TRANSFORM_GROUP), key=qualified)


def _group(table: dict[Op, Category], device_type: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for op in transform_overloads(table, device_type):
        category = table.get(op)
        found.setdefault(op.overloadpacket.__name__, "unlisted" if category is None else category.value)
    return found


def _reference_device(policy: Policy, device_type: str) -> str:
    """The device whose native kernels a policy's unchanged entries follow: its base's (CUDA -> cuda)."""
    for name, spec in _devices.DEVICES.items():
        if spec.policy == policy.base and policy.base not in _documented():
            return name
    return device_type


def _documented() -> tuple[str, ...]:
    from mixprec.policies import DOCUMENTED

    return DOCUMENTED


@functools.cache
def _categories_of_default(device_type: str) -> dict[Op, Category]:
    """``categories`` of the device's default policy (built once per device)."""
    return categories(default_policy(device_type))


_checked: set[str] = set()


def check_native(device_type: str) -> None:
    """Warn once per device if its default table and torch's Autocast kernels name different ops.

    The default tables hold one table per supported release, so this warns only on a torch newer than the
    tested range whose kernels moved (``tests/test_compat.py`` checks each supported release's table).
    """
    if device_type in _checked:
        return
    _checked.add(device_type)
    key = autocast_key(device_type)
    if key is None or default_policy(device_type).name != _devices.spec(device_type).policy:
        return
    torch_ops, table = native_difference(device_type, key)
    if torch_ops == table or device_type not in ("cpu", "cuda"):
        return
    _errors.warn(
        _errors.message(
            f"mixprec's default {device_type} policy does not match this torch's autocast kernels",
            f"torch {torch.__version__} is newer than the releases mixprec is tested on, and its Autocast kernels "
            f"cover other ops than torch {_compat.table_release()}'s table",
            received={"only_in_torch": sorted(torch_ops - table), "only_in_table": sorted(table - torch_ops)},
            fix="mixprec follows torch's kernels for the default policy; explain() reports what torch applies.",
        ),
        _errors.MixprecWarning,
    )


def native_difference(device_type: str, key: str) -> tuple[set[str], set[str]]:
    """``(ops torch registers at key, ops the default table lists)``, by op name; ops only some builds
    register (cuDNN's) count as the table's when torch lacks them."""
    import importlib

    from mixprec.policies import BUILTIN

    torch_ops = {r.split("::")[1].split(".")[0] for r in native_registrations(key) if r.startswith("aten::")}
    table = {name.split("::")[-1].split(".")[0] for name in default_policy(device_type).table}
    module = importlib.import_module(f"mixprec.policies.{BUILTIN[_devices.spec(device_type).policy]}")
    optional = set(getattr(module, "BUILD_DEPENDENT", ()))
    return torch_ops | (optional & table), table
