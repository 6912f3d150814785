"""The public ``autocast`` context manager and decorator, and state queries."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec import _compute, _devices, _errors, _mode, _state
from mixprec.policies import Policy

F = TypeVar("F", bound=Callable[..., Any])


def _default_policy(device_type: str) -> Policy:
    import mixprec.policies as policies

    return getattr(policies, _devices.spec(device_type).policy)  # type: ignore[no-any-return]


class autocast:  # noqa: N801 - torch's name
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
        device_type: ``"cpu"``, ``"cuda"``, ``"xpu"``, ... (see ``mixprec._devices``).
        dtype: The lower-precision dtype; defaults to the device's
            (cpu: bfloat16, cuda: float16, xpu: bfloat16, others: float16).
        enabled: Whether autocast is on in the region.
        cache_enabled: Reuse the low-precision copy of each weight within the
            outermost region (default True).
        policy: The op table to apply; defaults to the device's policy. Any
            policy works on any device, e.g. ``policies.CUDA`` on CPU tensors.
        compute: How ``lower_precision_fp`` ops compute. ``"native"``: on the
            device's low-precision kernels, as torch autocast. ``"emulated"``:
            inputs rounded to ``dtype``, float32 kernels, outputs rounded to
            ``dtype`` (same result dtypes; low-precision saved tensors).
            ``"auto"`` (default): native where ``mixprec.kernel_support``
            finds native kernels for ``dtype``, emulated elsewhere.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu"):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

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
        spec = _devices.spec(device_type)
        _check_type("dtype", dtype, torch.dtype, optional=True)
        _check_type("enabled", enabled, bool)
        _check_type("cache_enabled", cache_enabled, bool, optional=True)
        _check_type("policy", policy, Policy, optional=True)
        self.device = device_type
        self.fast_dtype = spec.default_dtype if dtype is None else dtype
        self._cache_enabled = True if cache_enabled is None else cache_enabled
        self._policy = policy
        self._enabled = enabled and _usable(spec, self.fast_dtype)
        self._compute = _compute.check_compute(compute)
        self._emulate = self._enabled and _compute.emulates(self._compute, device_type, self.fast_dtype)
        self._setting: _state.DeviceSetting | None = None  # made on first entry, then reused

    def __enter__(self) -> autocast:
        state = _state.get()
        device = self.device
        if self._policy is None and state.module_policies:  # the innermost module policy (set_module_policy)
            inner = state.module_policies[-1]
            setting = _state.DeviceSetting(self._enabled, self.fast_dtype, inner, self._cache_enabled, self._emulate)
        else:
            cached = self._setting
            if cached is None:  # made on first entry, then reused
                policy = self._policy if self._policy is not None else _default_policy(device)
                cached = _state.DeviceSetting(
                    self._enabled, self.fast_dtype, policy, self._cache_enabled, self._emulate
                )
                self._setting = cached
            setting = cached
        enter(state, {device: setting})
        return self

    def __exit__(self, *exc_info: object) -> None:
        leave(_state.get(), 1)

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def decorate_autocast(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return decorate_autocast  # type: ignore[return-value]

    def _fresh(self) -> autocast:
        """A new region with these settings, checked already: torch.compile enters only
        context managers made inside the compiled code, and a decorator's instance is not."""
        region = autocast.__new__(autocast)
        region.device, region.fast_dtype, region._cache_enabled = self.device, self.fast_dtype, self._cache_enabled
        region._policy, region._enabled, region._emulate = self._policy, self._enabled, self._emulate
        region._compute = self._compute
        region._setting = self._setting
        return region

    def __repr__(self) -> str:
        return (
            f"autocast(device_type={self.device!r}, dtype={self.fast_dtype}, "
            f"enabled={self._enabled}, cache_enabled={self._cache_enabled}, compute={self._compute!r}"
            + ((" -> emulated" if self._emulate else " -> native") if self._compute == "auto" and self._enabled else "")
            + ")"
        )


def enter(state: _state.ThreadState, settings: dict[str, _state.DeviceSetting]) -> None:
    """Open one nesting level per device in ``settings``; the mode goes on the stack with the first."""
    for device, setting in settings.items():
        state.saved.append((device, state.devices.get(device)))
        state.devices[device] = setting
    _refresh(state)
    if settings and len(state.saved) == len(settings):
        if state.mode is None:
            state.mode = _mode.AutocastMode(state)
        _mode.push(state.mode)


def leave(state: _state.ThreadState, levels: int) -> None:
    """Close ``levels`` nesting levels; the cache and the mode go when the last one closes."""
    for _ in range(levels):
        device, previous = state.saved.pop()
        if previous is None:
            del state.devices[device]
        else:
            state.devices[device] = previous
    _refresh(state)
    if levels and not state.saved:
        state.cache.clear()
        _mode.remove(state.mode)


def _check_type(name: str, value: object, expected: type, *, optional: bool = False) -> None:
    if (optional and value is None) or isinstance(value, expected):
        return
    label = f"{expected.__module__}.{expected.__qualname__}" if expected.__module__ != "builtins" else expected.__name__
    raise TypeError(
        _errors.message(
            f"autocast argument {name!r} has the wrong type",
            f"it must be a {label}" + (" or None" if optional else ""),
            received={name: value},
            expected=f"a {label}",
        )
    )


def _usable(spec: _devices.DeviceSpec, dtype: torch.dtype) -> bool:
    """Whether a region can run; warns (and the region is disabled) if not."""
    if not spec.available():
        _errors.warn(
            _errors.message(
                "autocast disabled",
                f"device_type {spec.name!r} is not available on this machine",
                fix=f"Use a device type that is available, e.g. 'cpu', or run where {spec.name} is present.",
            ),
            _errors.AutocastDisabledWarning,
        )
        return False
    if dtype not in spec.supported_dtypes:
        _errors.warn(
            _errors.message(
                "autocast disabled",
                f"{spec.name} autocast does not support this dtype",
                received={"dtype": dtype},
                expected=[_devices.dtype_name(d) for d in spec.supported_dtypes],
            ),
            _errors.AutocastDisabledWarning,
        )
        return False
    return True


def _refresh(state: _state.ThreadState) -> None:
    if torch.compiler.is_compiling():
        state.contexts = tuple(_traced_context(device, s) for device, s in state.devices.items() if s.enabled)
    else:
        state.contexts = tuple(_context(device, s) for device, s in state.devices.items() if s.enabled)


def _traced_context(device: str, setting: _state.DeviceSetting) -> _state.Context:
    """``_context`` inside a torch.compile trace: the compiled policy comes from a shelf."""
    compiled = _mode.traced_policy(setting.policy)
    return _state.Context(
        device, setting.dtype, setting.policy, compiled.rules, setting.cache_enabled, compiled, setting.emulate
    )


_contexts: dict[tuple[str, torch.dtype, int, bool, bool], _state.Context] = {}


def _context(device: str, setting: _state.DeviceSetting) -> _state.Context:
    """The mode's view of one enabled device (memoized: regions are entered once per step)."""
    key = (device, setting.dtype, id(setting.policy), setting.cache_enabled, setting.emulate)
    found = _contexts.get(key)
    if found is None or found.policy is not setting.policy:
        compiled = _mode.compile_policy(setting.policy)
        found = _state.Context(
            device, setting.dtype, setting.policy, compiled.rules, setting.cache_enabled, compiled, setting.emulate
        )
        if len(_contexts) > 256:
            _contexts.clear()
        _contexts[key] = found
    return found


def is_autocast_enabled(device_type: str) -> bool:
    """Whether a mixprec autocast region is enabled for ``device_type`` in this thread."""
    _devices.spec(device_type)
    setting = _state.get().devices.get(device_type)
    return setting is not None and setting.enabled


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The autocast dtype in force for ``device_type`` (its default outside any region)."""
    spec = _devices.spec(device_type)
    setting = _state.get().devices.get(device_type)
    return spec.default_dtype if setting is None else setting.dtype


def get_policy(device_type: str) -> Policy:
    """The policy in force for ``device_type`` (the device's default outside any region)."""
    setting = _state.get().devices.get(device_type)
    return _default_policy(device_type) if setting is None else setting.policy
