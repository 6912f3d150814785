"""mixprec's kernels at the Autocast dispatch keys: registered lazily, once per overload, and kept.

A region whose policy or compute differs from torch's native autocast needs a
kernel for each overload where they differ (``_tables.effective``), and under
emulated compute one for each overload cast to the region's dtype
(``lower_precision_fp``). ``ensure``
registers the missing ones through ``torch.library`` the first time a region
needs them; they stay for the life of the process, as a registration costs
about 0.1 ms and torch.compile caches graphs against the kernels it saw.

Each kernel serves every thread and every region::

    setting = this thread's innermost mixprec setting for the device
              or, in a checkpoint's recompute, the one its forward left (_recompute)
              or the one mixprec.install put in force (_install)
    in forward inside a checkpoint: leave setting on it for the recompute
    table   = the setting's categories, or torch's native ones if there is no setting
    rule    = table[op]
    if no rule: redispatch below the Autocast key with autocast still on (torch's fallthrough)
    else:       with the Autocast key excluded: rule(op, ...)  (casts, then the op below autocast)
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec.engine import _cast, _devices, _fastpath, _guard, _memo, _plan, _recompute, _rules, _state, _tables
from mixprec.engine import _installation as _install
from mixprec.policies import Category, Policy
from mixprec.policies._category import Action

Op = torch._ops.OpOverload
Entry = _rules.Runner  # what a kernel calls for its op (the op's rule, bound)
_REGION_CASTS = _plan.REGION_CASTS
#: Python numbers, and each one's dtype as a tensor, as torch wraps it (``scalar_to_tensor``).
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_NUMBERS = tuple(_NUMBER_DTYPES)

_lock = threading.Lock()
_libraries: dict[str, torch.library.Library] = {}  # namespace -> the Library holding mixprec's kernels
_registered: dict[str, set[Op]] = {}  # autocast key -> overloads with a mixprec kernel
#: Setting key -> the generation under which ``ensure`` registered what it needs.
_ensured: _memo.Memo[tuple[Any, ...], object] = _memo.Memo(1024, "kernels ensured")
#: Replaced by ``reset``: a region that ensured its kernels under this generation need not check again.
generation = object()
_reset_pending = False  # kernels were registered while a trace ran: dynamo's caches are to be reset


def registered(device_type: str) -> frozenset[Op]:
    """The overloads that have a mixprec kernel at the device's Autocast key."""
    key = _tables.autocast_key(device_type)
    return frozenset(_registered.get(key, ())) if key is not None else frozenset()


def needed(setting: _state.Setting) -> frozenset[Op]:
    """The overloads that need a mixprec kernel for ``setting``."""
    table, changed = _tables.effective(setting.policy, setting.device_type)
    needs = changed | {op for op, category in table.items() if category in _REGION_CASTS and _emulated(setting, op)}
    if _tables.transform_split(setting.policy, setting.device_type):  # (their kernels refuse under torch.func)
        needs |= set(_tables.transform_overloads(table, setting.device_type))
    return needs


def _emulated(setting: _state.Setting, op: Op) -> bool:
    return setting.emulate or (bool(setting.emulate_ops) and _tables.qualified(op) in setting.emulate_ops)


def ensure_installed(installation: _install.Installation) -> None:
    """Register the kernels ``installation`` needs on every device torch autocasts here (``mixprec.install``, and
    ``mixprec.engine.reset`` for an installation still in force)."""
    for device, spec in _devices.DEVICES.items():
        if _tables.autocast_key(device) is None or not spec.available():
            continue
        for dtype in spec.supported_dtypes:
            ensure(installation.setting_for(device, dtype))


def ensure(setting: _state.Setting) -> None:
    """Register the kernels ``setting`` needs and does not have yet (memoized per setting)."""
    global _reset_pending
    if _reset_pending and not _compat.tracing():
        _reset_pending = False
        _compat.reset_dynamo()  # kernels registered while tracing: graphs compiled before them carry no guard
    if _ensured.get(setting.key) is generation:
        setting.derived["ready"] = generation
        return
    _tables.check_native(setting.device_type)
    key = _tables.autocast_key(setting.device_type)
    native_only = key is None and setting.policy == _tables.default_policy(setting.device_type) and not setting.emulate
    ops = frozenset() if native_only else needed(setting)  # without a key, torch's (or the backend's) kernels run
    if ops:
        if key is None:
            raise RuntimeError(
                _errors.message(
                    f"Cannot apply this policy on {setting.device_type!r}",
                    "torch exposes no Autocast dispatch key for the device to Python, so only its native "
                    "autocast can run there",
                    received={"device_type": setting.device_type, "policy": setting.policy.name},
                    fix="Use the device's default policy with compute='native' there.",
                )
            )
        register(key, setting.device_type, ops)
    _ensured.put(setting.key, generation)
    setting.derived["ready"] = generation


def register(key: str, device_type: str, ops: frozenset[Op] | set[Op]) -> None:
    """Give each overload in ``ops`` a mixprec kernel at ``key`` (those it has already keep theirs)."""
    grew = fast = False
    with _lock:
        _tables.native_registrations(key)  # read torch's own list before adding to it
        done = _registered.setdefault(key, set())
        if ops - done:
            # Before the first kernel serves a call: from then on, other threads' plain torch.autocast regions
            # may reach it and cast through the mirror of torch's cache, which must clear as torch's clears
            # (the extension may take minutes to build below, its first kernel already registered).
            _cast.follow_torch(True)
        for op in sorted(ops - done, key=_tables.qualified):
            namespace = op.overloadpacket._qualified_op_name.split("::")[0]
            library = _libraries.get(namespace)
            if library is None:
                library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")
            name = op.overloadpacket.__name__ + ("" if op._overloadname == "default" else f".{op._overloadname}")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
                warnings.filterwarnings("ignore", message=".*previously registered kernel.*")
                _compat.register_kernel(library, name, _kernel(op, device_type, key), key)
                fast |= _fastpath.attach(op, key, device_type)  # the C++ kernel on top of it
            done.add(op)
            grew = True
        if grew and key not in _jit_keys:
            _register_jit_casts(key, device_type)
        if grew:
            _state.set_kernels_registered(True)  # regions of the default policy must set their setting now
        if fast:
            _follow_settings(device_type)
    if grew and _compat.dynamo_loaded():
        # Graphs compiled before saw no kernel for these ops and carry no guard on mixprec's settings. While a
        # trace runs, dynamo cannot be reset: the next eager ``ensure`` does it (a new generation sends every
        # region there on its next entry).
        if _compat.tracing():
            global generation, _reset_pending
            _reset_pending, generation = True, object()
        else:
            _compat.reset_dynamo()


def reset() -> None:
    """Drop every mixprec kernel: torch's own kernels are back (for tests that need pristine native)."""
    global generation
    with _lock:
        generation = object()
        _state.on_change = None
        _install.on_change = None
        _fastpath.detach_all()  # the C++ kernels first: each calls the Python kernel below it
        for library in _libraries.values():
            _compat.destroy_library(library)
        _libraries.clear()
        _registered.clear()
        _jit_keys.clear()
        _ensured.clear()
        _state.set_kernels_registered(False)
        _cast.follow_torch(False)


#: Setting key -> ``{overload: runner}``; device type -> the same for torch's native table.
_compiled: _memo.Memo[tuple[Any, ...], dict[Op, Entry]] = _memo.Memo(256, "kernel entries")
_native: _memo.Memo[str, dict[Op, Entry]] = _memo.Memo(16, "native kernel entries")


def rule_for(policy: Policy, op: Op, category: Category) -> _rules.Rule:
    """The rule a kernel applies to ``op`` under ``policy`` (a banned op's carries the policy's advice, an fp8
    op's the policy's recipe)."""
    if category.action is Action.BAN:
        return _rules.banned(category, policy.advice(_tables.entry_name(policy, op)))
    if category.action is Action.SCALED_MM:
        return _rules.scaled(category, policy.fp8_recipe)
    return _rules.RULES[category]


def _entries(
    policy: Policy, device_type: str, table: dict[Op, Category], setting: _state.Setting | None,
    changed: frozenset[Op] = frozenset(),
) -> dict[Op, Entry]:
    """The runners of ``table``'s ops; an op the setting neither moves from torch's category (``changed``) nor
    emulates runs as native, with torch's cache rules: as it would if no region had registered its kernel."""
    out: dict[Op, Entry] = {}
    split = _tables.transform_split(policy, device_type) if setting is not None else {}
    for op, category in table.items():
        emulate = setting is not None and category in _REGION_CASTS and _emulated(setting, op)
        as_native = not emulate and op not in changed
        out[op] = _rules.runner(op, device_type, category, rule_for(policy, op, category), emulate, as_native)
        if split and op.overloadpacket.__name__ in split:
            out[op] = _rules.transform_guard(op, category, out[op], split)
    return out


def entries(setting: _state.Setting) -> dict[Op, Entry]:
    """``{overload: runner}`` for a setting (memoized by the setting's content)."""
    found = _compiled.get(setting.key)
    if found is None:
        table, changed = _tables.effective(setting.policy, setting.device_type)
        found = _compiled.put(setting.key, _entries(setting.policy, setting.device_type, table, setting, changed))
    setting.derived["entries"] = found  # the kernels' fast path
    return found


def native_entries(device_type: str) -> dict[Op, Entry]:
    """``{overload: runner}`` reproducing torch's native autocast on the device."""
    found = _native.get(device_type)
    if found is None:
        policy = _tables.default_policy(device_type)
        found = _native.put(device_type, _entries(policy, device_type, _tables.native(device_type), None))
    return found


def _follow_settings(device_type: str) -> None:
    """Give the C++ kernels (``_fastpath``) the device's native table and this thread's setting's, and keep
    them told of every thread's settings and of ``mixprec.install``."""
    _fastpath.set_native(device_type, _fastpath.table(native_entries(device_type)))
    _state.on_change = _setting_changed
    _install.on_change = _fastpath.native_allowed
    _fastpath.native_allowed(_install.current is None)
    _setting_changed(device_type, _state.get().active.get(device_type))  # this thread's (other threads': as
    # each next changes its setting; until then their calls go to Python if they hold mixprec state now)
    _fastpath.set_holders(set(_state.holders))


def _setting_changed(device_type: str, setting: _state.Setting | None) -> None:
    """This thread's setting for ``device_type`` is now ``setting``: its plans go to the C++ kernels."""
    if device_type in _fastpath.known_devices():
        _fastpath.set_active(device_type, None if setting is None else _setting_table(setting))


def _setting_table(setting: _state.Setting) -> Any:
    """The C++ table of ``setting``'s runners, made again when more overloads have kernels."""
    made = setting.derived.get("fast")
    if made is None or made[0] != _fastpath.count():
        made = setting.derived["fast"] = (_fastpath.count(), _fastpath.table(entries(setting)))
    return made[1]


#: The casts TorchScript's own autocast pass writes into a scripted graph, by torch's lists, as it optimises
#: the graph (from the eager autocast state then, and the graph's own ``with torch.autocast`` blocks).
_JIT_CASTS = ("_autocast_to_reduced_precision", "_autocast_to_full_precision")
_jit_keys: set[str] = set()  # the Autocast keys where mixprec's kernels for them are registered


def _register_jit_casts(key: str, device_type: str) -> None:
    """Give TorchScript's casts a kernel at ``key`` (with the first mixprec kernels there, under ``_lock``)."""
    library = _libraries.get("aten")
    if library is None:
        library = _libraries["aten"] = torch.library.Library("aten", "IMPL")
    for name in _JIT_CASTS:
        op = getattr(torch.ops.aten, name).default
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*previously registered kernel.*")
            _compat.register_kernel(library, name, _jit_cast_kernel(op, device_type, key), key)
    _jit_keys.add(key)


def _jit_cast_kernel(op: Op, device_type: str, key: str) -> Callable[..., Any]:
    """A cast TorchScript's autocast pass wrote: where mixprec's rules differ from torch's for the call (the
    thread's region, or the setting ``mixprec.install`` puts in force, has its own policy or compute), the tensor
    as it is, so that the scripted graph computes as the same region does eagerly (torch's cast ahead of an op
    would round a tensor the policy keeps in float32, or cast up one the policy keeps low); elsewhere, a default
    region included, torch's cast, so the graph computes as under torch.autocast (the pass also casts up ahead of
    ops no Autocast kernel casts, such as ``add``, and its casts decide their dtype). So TorchScript's pass stays
    on, and a scripted graph optimised in one kind of region runs right in the other."""
    after = _compat.keyset_after(_compat.dispatch_key(key))
    state = _state.get()

    def own_rules() -> bool:
        setting = state.active.get(device_type)
        if setting is None and _install.current is not None:
            setting = _install.installed_setting(
                device_type, state.module_policies[-1] if state.module_policies else None
            )
        return setting is not None and (
            setting.emulate or bool(setting.emulate_ops) or setting.policy != _tables.default_policy(device_type)
        )

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(args[0], torch.Tensor):
            # A traced ``x + 1``: torch unboxed the wrapped number, which neither redispatch nor a call takes
            # for a Tensor; torch's kernel returns it as it came, the number's tensor (no cast applies to it).
            return torch.tensor(args[0], dtype=_NUMBER_DTYPES[type(args[0])])
        if own_rules():
            return args[0]
        return op.redispatch(keyset & after, *args, **kwargs)

    kernel.__name__ = f"mixprec_autocast_{op.overloadpacket.__name__}"
    return kernel


def _kernel(op: Op, device_type: str, key: str) -> Callable[..., Any]:
    dispatch_key = _compat.dispatch_key(key)
    exclude = torch._C.DispatchKeySet(dispatch_key)
    after = _compat.keyset_after(dispatch_key)
    is_compiling = _compat.tracing
    exclude_guard = _compat.ExcludeDispatchKeyGuard
    in_checkpointed_forward = _recompute.in_forward
    state = _state.get()
    # Positions of Tensor parameters after the first: a Python number there reached the kernel as torch
    # unboxes a wrapped number (``x + 1``), and ``redispatch`` refuses it for a Tensor parameter.
    maybe_scalar = tuple(i for i, a in enumerate(op._schema.arguments) if i and str(a.type) == "Tensor")

    task_id = _compat.graph_task_id
    grad_enabled = torch.is_grad_enabled
    top_hooks = _compat.top_saved_tensors_hooks
    installation = _install
    native: list[Entry | None] = []  # torch's category for the op, as an entry (looked up on first use)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            _guard.guard_trace()
        setting = state.active.get(device_type)
        if setting is None:
            if task_id() < 0 and installation.current is None:  # forward, nothing installed: torch's category
                if not grad_enabled() or top_hooks(False) is not None:  # perhaps in a checkpoint (in_forward)
                    _recompute.record_native(device_type)
                entry = native[0] if native else _native_entry()
            else:
                entry = _without_region()
        elif task_id() < 0:
            # In forward, inside a checkpoint (``_recompute.in_forward``, written out): leave the setting for
            # its recompute, which may run after the region is gone.
            if not grad_enabled() or top_hooks(False) is not None:
                _recompute.record(setting)
            entry = (setting.derived.get("entries") or entries(setting)).get(op)
        else:  # in backward inside a region: a backward op, or a recompute (which runs what its forward ran)
            found = _recompute.backward_setting(state, device_type, setting)
            if found is _recompute.NATIVE:
                entry = _native_entry()
            else:
                entry = (found.derived.get("entries") or entries(found)).get(op)
        if entry is None:
            if maybe_scalar and any(i < len(args) and type(args[i]) in _NUMBERS for i in maybe_scalar):
                # Below autocast by another route: the op with the Autocast key excluded (it has a kernel of
                # its own there, not a decomposition that autocast would meet).
                with exclude_guard(exclude):
                    return op(*args, **kwargs)
            return op.redispatch(keyset & after, *args, **kwargs)
        with exclude_guard(exclude):
            return entry(args, kwargs)

    def _without_region() -> Entry | None:
        """The entry for a call with no mixprec region on this thread: under ``mixprec.install``, inside a module
        under a module policy (its hook found autocast off, and a ``torch.autocast`` opened inside), that policy's;
        in a checkpoint's recompute, the one its forward left; under ``mixprec.install``, the installed setting's;
        else torch's native one."""
        setting = None
        modules = state.module_policies
        if modules and installation.current is not None:
            setting = _install.installed_setting(device_type, modules[-1])
            if setting is not None:
                if in_checkpointed_forward():  # (the module may hold the checkpoint, and run no hook in its recompute)
                    _recompute.record_module(setting)
                return (setting.derived.get("entries") or entries(setting)).get(op)
        if task_id() >= 0:  # in backward: perhaps a checkpoint's recompute
            setting = _recompute.recompute_setting(device_type)
            if setting is _recompute.NATIVE:
                return _native_entry()
        if setting is None and _install.current is not None:
            setting = _install.installed_setting(device_type)
            if setting is not None:
                if is_compiling():
                    _guard.refuse_installed_export(setting)
                if in_checkpointed_forward():  # leave the installed setting for the recompute
                    _recompute.record(setting)
        if setting is None:
            if in_checkpointed_forward():
                _recompute.record_native(device_type)
            return native[0] if native else _native_entry()
        return (setting.derived.get("entries") or entries(setting)).get(op)

    def _native_entry() -> Entry | None:
        if not native:
            native.append(native_entries(device_type).get(op))
        return native[0]

    kernel.__name__ = f"mixprec_autocast_{op.overloadpacket.__name__}"
    return kernel
