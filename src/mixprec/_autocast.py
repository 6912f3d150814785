"""The public ``autocast`` context manager and decorator, and state queries."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from mixprec import _compat, _errors
from mixprec.engine import (
    _compile,
    _compute,
    _devices,
    _guard,
    _kernels,
    _memo,
    _region,
    _state,
    _tables,
)
from mixprec.engine import (
    _installation as _install,
)
from mixprec.policies import Policy

F = TypeVar("F", bound=Callable[..., Any])

# torch's state functions, bound once: a region's entry and exit run on every step.
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # one Python frame, where is_compiling has two
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_is_cached = torch.is_autocast_cache_enabled
_holders = _state.holders
_SCRIPT_UNSUPPORTED = (
    "@mixprec.autocast() as a decorator is not supported in script mode (its region would be lost): open the "
    "region around the call of the scripted function, or trace the function instead (docs/graph_modes.md)"
)
_DEVICES, _in_force = _devices.DEVICES, _devices.dtype_in_force
_NO_OPS: frozenset[str] = frozenset()


class _Made(type):
    """autocast's metaclass: a call with the arguments of an enabled region made before returns that region.

    A region is made and entered on every step, and with the caches cold (after a compiled model's call)
    making an object costs more than entering it. A region keeps nothing from one entry to the next (its
    levels live in the thread's state, or for the level that takes none, on ``_unframed``, which a second
    entry never shares: see ``__enter__``), so one object serves every ``with`` of its arguments, in any
    thread. ``cache_enabled=None`` is torch's flag at the call, as ``torch.autocast`` reads it. Under
    torch.compile each call makes a region, as dynamo must see it made. A subclass (``mixprec.cpu.amp``'s,
    with torch.cpu.amp's arguments, or a user's) gets ``_Subclass`` and makes its objects as any class does.
    """

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> Any:
        if any(isinstance(base, _Made) for base in bases):
            mcls = _Subclass
        return super().__new__(mcls, name, bases, namespace, **kwargs)

    def __call__(  # autocast's own parameters, repeated: bound directly, a call costs least
        cls,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | None = None,
        compute: str = "auto",
    ) -> Any:
        if enabled is True and not _dynamo_compiling():  # (True == 1: only a bool passes ``is True``)
            cache = _is_cached() if cache_enabled is None else cache_enabled
            if type(cache) is bool:
                try:
                    # (dtype=None: the dtype in force now, as __init__ reads it; an unknown device: __init__'s error)
                    fast = dtype if dtype is not None or device_type not in _DEVICES else _in_force(device_type)
                    found = _made.get((device_type, fast, cache, compute, policy))
                except TypeError:  # an unhashable argument: refused by __init__
                    found = None
                if found is not None:
                    return found
        return super().__call__(device_type, dtype, enabled, cache_enabled, policy=policy, compute=compute)


def _parameters(
    device_type: str,
    dtype: torch.dtype | None = None,
    enabled: bool = True,
    cache_enabled: bool | None = None,
    *,
    policy: Policy | None = None,
    compute: str = "auto",
) -> tuple[str, torch.dtype | None, bool, bool | None, Policy | None, str]:
    """autocast's arguments, bound to its parameters (a TypeError where they are not its own)."""
    return device_type, dtype, enabled, cache_enabled, policy, compute


class _Subclass(_Made):
    """The metaclass of autocast's subclasses: objects made as any class makes them."""

    __call__ = type.__call__


class autocast(metaclass=_Made):  # noqa: N801 - torch's name
    """Run a region of code in mixed precision.

    Inside the region each torch op runs in the dtype its policy category asks
    for: ``lower_precision_fp`` ops (matmuls, convolutions) in ``dtype``,
    ``fp32`` ops in float32, ``promote`` ops in the widest input dtype. Only
    floating tensors on ``device_type`` that are not float64 are cast; in-place
    ops, ``out=`` calls and calls with an explicit ``dtype=`` run unchanged.

    Works as a context manager and as a decorator; regions nest, and
    ``enabled=False`` opens a full-precision sub-region. State is thread-local
    and restored when the region exits, also on an exception.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ``"xpu"``, ... (see ``mixprec.engine._devices``).
        dtype: The lower-precision dtype. None (default): the autocast dtype
            in force when the region is made, as ``torch.autocast`` reads it
            (an enclosing region's, or ``torch.set_autocast_dtype``'s); outside
            any region the device's default (cpu: bfloat16, cuda: float16,
            xpu: bfloat16, others: torch's).
        enabled: Whether autocast is on in the region.
        cache_enabled: Reuse the low-precision copy of each weight within the
            outermost region. None (default): torch's current setting, as
            ``torch.autocast`` reads it (True unless a region or
            ``torch.set_autocast_cache_enabled`` turned it off).
        policy: The op table to apply; defaults to the device's policy. Any
            policy works on any device, e.g. ``policies.CUDA`` on CPU tensors.
        compute: How ``lower_precision_fp`` ops compute. ``"native"``: on the
            device's low-precision kernels, as torch autocast. ``"emulated"``:
            inputs rounded to ``dtype``, float32 kernels, outputs rounded to
            ``dtype`` (same result dtypes; low-precision saved tensors).
            ``"auto"`` (default): native where ``mixprec.kernel_support``
            finds native kernels for ``dtype``, emulated elsewhere.

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu"):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    _setting: _state.Setting | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # (a subclass's __init__ may take other parameters)
        if _dynamo_compiling():
            # Made in compiled code: a region torch's kernels serve exactly is a torch.autocast, which dynamo
            # knows natively (graph breaks, nesting, guards); any other is this class (see mixprec.engine._compile).
            if cls.__init__ is not autocast.__init__:  # a subclass's own parameters: its __init__ makes the region
                return object.__new__(cls)
            device_type, dtype, enabled, cache_enabled, policy, compute = _parameters(*args, **kwargs)
            cache = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
            native, fast, usable, cache, _ = _compile.plan(
                device_type, dtype, enabled, cache, _compat.to_constant(policy), compute
            )
            if native:
                return torch.autocast(device_type, fast, usable, cache)
        return object.__new__(cls)

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | None = None,
        compute: str = "auto",
    ) -> None:
        self._policy, self._compute, self.device = policy, compute, device_type
        self._args = (enabled, cache_enabled)  # as given: a pickled region is made again from enabled (__reduce__)
        self._setting = None
        self._plain = self._native_only = False
        self._unframed: dict[int, tuple[bool, torch.dtype, bool]] = {}  # {0: torch's state} while a level is open
        if _dynamo_compiling():  # a region that needs mixprec's setting (``__new__`` returned the others)
            cache = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
            _, self.fast_dtype, self._enabled, self._cache_enabled, self._token = _compile.plan(
                device_type, dtype, enabled, cache, _compat.to_constant(policy), compute, False
            )
            self._decide_compute()  # (the token's setting computes here; these serve the object if it escapes)
            self._traced: list[tuple[int, Any]] = []  # per open level: the token around it, torch's region
            return
        spec = _devices.spec(device_type)
        _errors.check_type("dtype", dtype, torch.dtype, optional=True)
        _errors.check_type("enabled", enabled, bool)
        _errors.check_type("cache_enabled", cache_enabled, bool, optional=True)
        _errors.check_type("policy", policy, Policy, optional=True)
        self.fast_dtype = _devices.dtype_in_force(device_type) if dtype is None else dtype
        self._cache_enabled = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
        self._enabled = enabled and _devices.usable(spec, self.fast_dtype)
        _compute.check_compute(compute)
        self._decide_compute()
        # _setting: made here for an enabled region, else on first entry; _native_only: the device's default
        # policy with native compute (no kernel needed); _plain: that, once torch's tables were checked.
        if self._enabled:  # no warning was given
            default = _tables.default_policy(device_type)
            chosen = self._policy if self._policy is not None else default
            self._setting = _state.make_setting(device_type, chosen, self._emulate, self._emulate_ops)
            # The default policy is torch's table for the device (``_tables.effective`` changes nothing).
            self._native_only = chosen == default and not self._emulate and not self._emulate_ops
            self._plain = self._native_only and self._setting.derived.get("ready") is _kernels.generation
            if type(self) is autocast:  # (a subclass makes its own: _Subclass)
                _made.put((device_type, self.fast_dtype, self._cache_enabled, compute, policy), self)

    def _decide_compute(self) -> None:
        """Whether the region emulates its lower_precision_fp ops, and which ones it emulates regardless."""
        enabled, compute, device, dtype = self._enabled, self._compute, self.device, self.fast_dtype
        self._emulate = enabled and _compute.emulates(compute, device, dtype)
        self._emulate_ops = _compute.emulated_ops(compute, device, dtype) if enabled else _NO_OPS

    def __enter__(self) -> autocast:
        if self._plain and not _holders and not _state.kernels_registered and not _function_mode_enabled():
            # The default policy with native compute, no mixprec kernel registered (``_state.kernels_registered``)
            # and no mixprec level or setting open in any thread (``_state.holders``): torch's kernels do all the
            # work, so the level is torch's state alone, set as torch.autocast sets it. What to restore is kept on
            # the region; if the region is open already (nested, or in another thread), this level takes a frame.
            saved = _region.torch_state(self.device)
            if self._unframed.setdefault(0, saved) is saved:  # one atomic claim (regions are shared: _Made)
                _region.set_torch(self.device, True, self.fast_dtype, self._cache_enabled, saved)
                return self
        if _dynamo_compiling():
            around = _compile.current(self.device)
            _compile.push(self._token)
            entered = _compile.torch_region(self.device, self.fast_dtype, self._enabled, self._cache_enabled)
            entered.__enter__()
            self._traced.append((around, entered))
            return self
        setting = self._setting
        state = _state._state
        inherits = state.module_policies or (self._policy is None and _install.current)  # a policy from outside
        if setting is None or inherits or _function_mode_enabled():
            if not self._enabled:
                setting = None
            elif setting is None or inherits:
                setting = self._setting_for(state)
            enter(self.device, setting, self.fast_dtype, self._enabled, self._cache_enabled)
            return self
        # The common case: a region made in eager code (only those hold a setting), entered in eager code
        # (dynamo refuses to enter a context manager made outside the function it compiles, and the
        # decorator's copy made under compile holds none): its kernels were checked at its last entry.
        if setting.derived.get("ready") is not _kernels.generation:
            _kernels.ensure(setting)  # on first use, this checks torch's tables too (_tables.check_native)
        if self._native_only:
            self._plain = True
        _region.open_level(state, self.device, setting, self.fast_dtype, True, self._cache_enabled)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._plain and (not _holders or not _state._state.frames):  # this level took no frame (__enter__)
            saved = self._unframed.pop(0, None)
            if saved is not None:
                _region.restore_torch(self.device, saved)
                return
        if _dynamo_compiling():
            around, entered = self._traced.pop()
            entered.__exit__(*exc_info)
            _compile.pop(self.device, around)
            return
        state = _state._state
        if not state.frames:
            raise RuntimeError(
                _errors.message(
                    "autocast.__exit__ called out of order",
                    "no autocast region is open in this thread",
                    received={"region": self},
                    fix="Use the region in a with statement, which enters it before it exits.",
                )
            )
        _region.close_level(state)

    def _setting_for(self, state: _state.ThreadState) -> _state.Setting:
        if self._policy is None:  # the innermost module policy (set_module_policy), else the installed one
            inner = state.module_policies[-1] if state.module_policies else _install.policy()
            if inner is not None:
                return _state.make_setting(self.device, inner, self._emulate, self._emulate_ops)
        setting = self._setting
        if setting is None:  # made on first entry, then reused in eager code (see __enter__)
            policy = self._policy if self._policy is not None else _tables.default_policy(self.device)
            setting = _state.make_setting(self.device, policy, self._emulate, self._emulate_ops)
            if not _dynamo_compiling():
                self._setting = setting
        return setting

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                _errors.message(
                    "autocast cannot decorate this object",
                    "as a decorator it wraps a function",
                    received={"func": func},
                    expected="a callable",
                )
            )

        @functools.wraps(func)
        def decorate_autocast(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        # torch.jit.script refuses an object carrying this (as it refuses torch.autocast's decorator): scripted,
        # the wrapper would be skipped and the region silently lost. (setattr: a name with two underscores
        # written in a class body is mangled.)
        setattr(decorate_autocast, "__script_unsupported", _SCRIPT_UNSUPPORTED)
        return decorate_autocast  # type: ignore[return-value]

    def _fresh(self) -> Any:
        """A new region with these settings (the decorator's and AutocastModule's, entered once per call).

        Dynamo enters only context managers made in the code it traces, so there it is made anew (a
        ``torch.autocast`` where that is the region, see ``__new__``); in eager code it is copied, checked
        already.
        """
        if _dynamo_compiling():
            native, fast, usable, cache, _ = _compile.plan(
                self.device, self.fast_dtype, self._enabled, self._cache_enabled, _compat.to_constant(self._policy),
                self._compute, True,
            )
            if native:
                return torch.autocast(self.device, fast, usable, cache)
            return autocast(
                self.device, self.fast_dtype, self._enabled, self._cache_enabled, policy=self._policy,
                compute=self._compute,
            )
        region = object.__new__(autocast)
        region.device, region.fast_dtype, region._cache_enabled = self.device, self.fast_dtype, self._cache_enabled
        region._policy, region._enabled, region._emulate = self._policy, self._enabled, self._emulate
        region._emulate_ops = self._emulate_ops
        region._compute, region._args = self._compute, self._args
        region._setting = self._setting
        region._native_only = self._native_only and region._setting is not None
        region._plain = self._plain and region._native_only
        region._unframed = {}
        return region

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the arguments it was made with (a region holds no state between entries), its cache flag
        as it was read when made, as a pickled ``torch.autocast`` keeps it (one object serves the calls that
        read ``cache_enabled=None`` as a flag and those that passed the same flag, ``_Made``)."""
        enabled = self._args[0]
        arguments = (self.device, self.fast_dtype, enabled, self._cache_enabled, self._policy, self._compute)
        return (_remake, (type(self), *arguments))

    def __repr__(self) -> str:
        return (
            f"autocast(device_type={self.device!r}, dtype={self.fast_dtype}, "
            f"enabled={self._enabled}, cache_enabled={self._cache_enabled}, compute={self._compute!r}"
            + ((" -> emulated" if self._emulate else " -> native") if self._compute == "auto" and self._enabled else "")
            + ")"
        )


def _remake(
    cls: type[autocast],
    device_type: str,
    dtype: torch.dtype,
    enabled: bool,
    cache_enabled: bool | None,
    policy: Policy | None,
    compute: str,
) -> autocast:
    """A region made again from its arguments (unpickling): a subclass's by the base class's ``__init__``."""
    if cls is autocast:
        return autocast(device_type, dtype, enabled, cache_enabled, policy=policy, compute=compute)
    region = object.__new__(cls)
    autocast.__init__(region, device_type, dtype, enabled, cache_enabled, policy=policy, compute=compute)
    return region


#: ``(device_type, dtype, cache_enabled, compute, policy)`` -> the enabled region made for them (an equal policy
#: made later gets the same region).
_made: _memo.Memo[tuple[Any, ...], autocast] = _memo.Memo(256, "regions")


def enter(
    device: str, setting: _state.Setting | None, dtype: torch.dtype, enabled: bool, cache_enabled: bool
) -> None:
    """Open one nesting level in eager code: torch's autocast state for ``device``, mixprec's setting beside it.

    ``setting=None`` keeps the thread's current mixprec setting (a level that only turns autocast off). Code
    that dynamo traces opens levels through ``level`` instead.
    """
    if torch._C._is_torch_function_mode_enabled():
        _enter_function_mode(device, setting, dtype, enabled, cache_enabled)
        return
    if setting is not None:
        _kernels.ensure(setting)
    _region.open_level(_state._state, device, setting, dtype, enabled, cache_enabled)


def _enter_function_mode(
    device: str, setting: _state.Setting | None, dtype: torch.dtype, enabled: bool, cache_enabled: bool
) -> None:
    """``enter`` under a torch-function mode (non-strict export's tracer): torch.autocast's own object sets the
    state and reports the region to the mode, so a nested region's exit restores the state export traces."""
    state = _state.get()
    previous = None
    if setting is not None:
        _guard.refuse_export(setting)
        _kernels.ensure(setting)
        previous = _region.push_setting(state, device, setting)
    entered = torch.autocast(device, dtype, enabled, cache_enabled)
    try:
        entered.__enter__()
    except BaseException:
        if setting is not None:
            _region.pop_setting(state, device, previous)
        raise
    _region.add_level(state, device, setting, previous, entered)


def leave(state: _state.ThreadState, levels: int) -> None:
    """Close ``levels`` nesting levels opened by ``enter``; the cast cache goes when the last one closes."""
    for _ in range(levels):
        _region.close_level(state)


@contextlib.contextmanager
def level(device: str, setting: _state.Setting | None, dtype: torch.dtype, enabled: bool, cache_enabled: bool,
          token: int = 0) -> Iterator[None]:
    """One nesting level as a ``with`` block, in eager code and in code dynamo traces (``token``: the setting's
    under the trace, from ``_compile``). The level closes on any exception, KeyboardInterrupt included."""
    if _dynamo_compiling():
        if setting is not None and not token:
            token = _compile.setting_token(_compat.to_constant(setting))
        around = _compile.current(device) if token else 0
        if token:
            _compile.push(token)
        try:
            with _compile.torch_region(device, dtype, enabled, cache_enabled):
                yield
        finally:
            if token:
                _compile.pop(device, around)
        return
    enter(device, setting, dtype, enabled, cache_enabled)
    try:
        yield
    finally:
        leave(_state._state, 1)


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast is on for ``device_type`` in this thread (torch's state: any region turns it on); with
    no argument, CUDA's, as ``torch.is_autocast_enabled()``."""
    _devices.spec(device_type)
    return bool(torch.is_autocast_enabled(device_type))


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The autocast dtype in force for ``device_type`` (torch's state), which a region made now with no ``dtype``
    takes."""
    return _devices.dtype_in_force(device_type)


def get_policy(device_type: str) -> Policy:
    """The policy in force for ``device_type``: the region's, else the installed one, else the device's default."""
    _devices.spec(device_type)
    setting = _state.get().active.get(device_type)
    if setting is not None:
        return setting.policy
    return _install.policy() or _tables.default_policy(device_type)
