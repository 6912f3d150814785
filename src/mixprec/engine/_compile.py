"""mixprec regions inside code that torch.compile traces.

A region made inside compiled code is decided once, eagerly, while dynamo traces
it (``plan``, a constant function):

* A region torch's own kernels serve exactly (the device's default policy, native
  compute, no mixprec setting, module policy or installation that differs in force
  around it; or ``enabled=False``) *is* a ``torch.autocast``: ``autocast.__new__``
  returns one. Dynamo knows it natively, so graph breaks inside it, nesting in
  ``torch.autocast`` and guards work as for native code, with one compiled frame.
* Any other region keeps its setting in mixprec's thread state. Its entry and exit
  put ``push(token)``/``pop`` calls in the graph: dynamo writes them in unexamined
  (``allow_in_graph``) and runs them on each pass over the graph (its own
  fake-tensor pass, AOTAutograd's trace, an eager backend's run), so the
  Autocast-key kernels see the policy wherever they run; their casts end up in
  the ATen graph, which holds no ``push``. Torch's half of the region is entered
  through ``torch_region``, a generator context whose body is a ``with
  torch.autocast`` block: dynamo traces it, strict export records it as
  ``wrap_with_autocast``, and it nests inside ``torch.autocast`` (explicit
  ``_enter_autocast``/``_exit_autocast`` calls there break dynamo's state check).
  Dynamo cannot carry such a region across a graph break: it runs the frame that
  holds it eagerly instead, where the region is an eager region, and compiles the
  frames it calls (``_guard.keep_eager`` keeps mixprec's own frames eager).

Module policies (``_module``) use the same pieces: ``module_token`` for the
setting, ``push_module`` for the policy regions opened inside inherit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec._compat import constant
from mixprec.engine import _compute, _devices, _guard, _kernels, _recompute, _state, _tables
from mixprec.engine import _installation as _install
from mixprec.policies import Policy

_lock = threading.Lock()
#: token -> what it stands for in a graph: a setting (0: none), or a module policy. A compiled graph holds the
#: int, so an entry must live as long as the process may run that graph: these two are not bounded, but keyed
#: by content they hold one entry per distinct setting or policy compiled, however often an equal one is made.
_tokens: dict[int, Any] = {0: None}
_token_of: dict[tuple[Any, ...], int] = {}

#: What ``plan`` returns: (native, dtype, enabled, cache_enabled, token).
Plan = tuple[bool, torch.dtype, bool, bool, int]


def _token(key: tuple[Any, ...], value: Any) -> int:
    found = _token_of.get(key)
    if found is None:
        with _lock:
            found = _token_of.get(key)
            if found is None:
                found = _token_of[key] = len(_tokens)
                _tokens[found] = value
    return found


def token_of(setting: _state.Setting | None) -> int:
    """The int that stands for ``setting`` in a graph (0: none)."""
    if setting is None:
        return 0
    return _token(setting.key, setting)


@constant
def setting_token(setting: _state.Setting | None) -> int:
    """``token_of`` run eagerly by the trace (a setting made outside it: custom_bwd's)."""
    return token_of(_compat.passed(setting))


@constant
def policy_token(policy: Policy) -> int:
    """The int that stands for a module policy in a graph (``push_module``)."""
    policy = _compat.passed(policy)
    return _token(("module policy", policy), policy)


def push(token: int) -> None:
    """Make the setting behind ``token`` this thread's setting for its device (in the graph: every pass runs it)."""
    setting = _tokens[token]
    if setting is not None:
        state = _state.get()
        state.active[setting.device_type] = setting
        _state.hold(state)


def pop(device_type: str, token: int) -> None:
    """Put back the setting behind ``token`` (0: none) as the thread's setting for ``device_type``."""
    state = _state.get()
    setting = _tokens[token]
    if setting is None:
        state.active.pop(device_type, None)
        _state.release(state)
    else:
        state.active[device_type] = setting


def push_module(token: int) -> None:
    """Enter the module policy behind ``token``: regions opened inside with no policy of their own take it."""
    state = _state.get()
    state.module_policies.append(_tokens[token])
    _state.hold(state)


def pop_module() -> None:
    state = _state.get()
    state.module_policies.pop()
    _state.release(state)


def _allow_in_graph() -> None:
    for function in (push, pop, push_module, pop_module):
        _compat.allow_in_graph(function)


def _native_equivalent(setting: _state.Setting | None) -> bool:
    """Whether torch's own kernels serve ``setting`` exactly (none, or the default policy with native compute)."""
    return setting is None or (
        setting.policy == _tables.default_policy(setting.device_type)  # by content, as the regions decide
        and not setting.emulate
        and not setting.emulate_ops
    )


@constant
def plan(
    device_type: str,
    dtype: torch.dtype | None,
    enabled: bool,
    cache_enabled: bool,
    policy: Policy | None,
    compute: str,
    entered: bool | None = None,
) -> Plan:
    """Decide (eagerly, while dynamo traces) what a region made in compiled code is.

    Returns ``(native, dtype, enabled, cache_enabled, token)``: ``native`` when a ``torch.autocast`` with
    those arguments is the region exactly (``token`` is then 0), else the token of the region's setting.
    The arguments are checked as ``autocast`` checks them; a region that cannot run warns and is disabled.

    A region whose policy is torch's is ``native`` only if it is entered where it is made (``entered``; None:
    if ``autocast.__new__``'s caller puts it straight into a ``with``): a region kept and entered later, say
    inside a region with another policy, must set the default policy there, which a ``torch.autocast`` does not.
    """
    _guard.contact()
    policy = _compat.passed(policy)
    if entered is None:
        entered = _guard.made_for_with()
    spec = _devices.spec(device_type)
    _errors.check_type("dtype", dtype, torch.dtype, optional=True)
    _errors.check_type("enabled", enabled, bool)
    _errors.check_type("cache_enabled", cache_enabled, bool)
    _errors.check_type("policy", policy, Policy, optional=True)
    _compute.check_compute(compute)
    if policy is not None and "table" not in vars(policy):
        # Dynamo hands a constant function an object made during the trace without its attributes.
        raise RuntimeError(
            _errors.message(
                "mixprec.autocast got a policy made inside the compiled function",
                "torch.compile passes an object built while tracing to mixprec without its table",
                fix="Build the policy outside the compiled function (e.g. at module level) and pass it in.",
            )
        )
    fast = _devices.dtype_in_force(device_type) if dtype is None else dtype
    if not (enabled and _devices.usable(spec, fast)):
        return (_compat.returns_torch_autocast(), fast, False, cache_enabled, 0)
    state = _state.get()
    if policy is None:  # the innermost module policy, else the installed one, else the device's default
        policy = (state.module_policies[-1] if state.module_policies else None) or _install.policy()
    if policy is None:
        policy = _tables.default_policy(device_type)
    emulate = _compute.emulates(compute, device_type, fast)
    setting = _state.Setting(device_type, policy, emulate, _compute.emulated_ops(compute, device_type, fast))
    if _state.kernels_registered:  # what the region is depends on the state around the frame
        _guard.guard_trace()
    installed = None if _install.current is None else _install.current.setting_for(device_type, fast)
    around = (state.active.get(device_type), installed)
    if _native_equivalent(setting):
        if entered and all(_native_equivalent(s) for s in around) and _compat.returns_torch_autocast():
            return (True, fast, True, cache_enabled, 0)
    else:
        _guard.refuse_export(setting)
        _kernels.ensure(setting)
        _guard.guard_trace()
    _allow_in_graph()
    return (False, fast, True, cache_enabled, token_of(setting))


@constant
def current(device_type: str) -> int:
    """The token of this thread's setting for ``device_type`` as the trace stands (run eagerly)."""
    return token_of(_state.get().active.get(device_type))


@constant
def module_token(device_type: str, policy: Policy) -> int:
    """The token of a module policy's setting on ``device_type`` (the setting around it, with its policy)."""
    _guard.contact()
    policy = _compat.passed(policy)
    setting = _state.module_setting(device_type, policy, _recompute.around(device_type))
    if not _native_equivalent(setting):  # (as plan(): strict export would write torch's native categories)
        _guard.refuse_export(setting)
    _kernels.ensure(setting)
    _guard.guard_trace()
    _allow_in_graph()
    return token_of(setting)


@constant
def enabled_devices() -> tuple[str, ...]:
    """The device types whose autocast is on as the trace stands (torch's state, which dynamo guards)."""
    _guard.contact()
    _allow_in_graph()
    return tuple(_devices.enabled())


@contextlib.contextmanager
def torch_region(device: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool) -> Iterator[None]:
    """Torch's autocast as a ``with`` block that dynamo traces from an explicit ``__enter__``/``__exit__``."""
    with torch.autocast(device, dtype, enabled, cache_enabled):
        yield
