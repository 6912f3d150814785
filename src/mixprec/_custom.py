"""custom_fwd / custom_bwd: autocast for custom autograd Functions.

``custom_fwd`` records whether forward ran under autocast (torch's state: any
region counts), in which dtype, and mixprec's setting (policy and compute);
``custom_bwd`` runs backward in the same state. With
``cast_inputs``, forward runs with autocast off on inputs cast to that dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from mixprec import _autocast, _errors
from mixprec.engine import _cast, _devices, _installation, _recompute, _state


def _check_callable(where: str, name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(
            _errors.message(f"{where}: {name} is invalid", "it decorates a custom Function's staticmethod",
                            received={name: value}, expected="a callable")
        )


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Any:
    """Decorate the ``forward`` of a custom ``torch.autograd.Function``.

    Args:
        fwd: The forward staticmethod (omit it to use ``@custom_fwd(...)``).
        device_type: The autocast device the Function is used on.
        cast_inputs: If given and forward runs in an enabled region, floating
            inputs on ``device_type`` are cast to it and forward runs with
            autocast off. If None, forward runs in the surrounding state.
    """
    _devices.spec(device_type)
    if cast_inputs is not None and not isinstance(cast_inputs, torch.dtype):
        raise TypeError(
            _errors.message("custom_fwd: cast_inputs is invalid", "it is the dtype forward's inputs are cast to",
                            received={"cast_inputs": cast_inputs}, expected="a torch.dtype or None")
        )
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    _check_callable("custom_fwd", "fwd", fwd)

    @functools.wraps(fwd)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        enabled = torch.is_autocast_enabled(device_type)
        ctx._dtype = torch.get_autocast_dtype(device_type)
        ctx._mixprec_setting = _setting_here(device_type)
        if cast_inputs is None:
            ctx._fwd_used_autocast = enabled
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        if not enabled:
            return fwd(*args, **kwargs)
        with _autocast.level(device_type, None, ctx._dtype, False, torch.is_autocast_cache_enabled()):
            args = _cast.cast_tree(args, device_type, cast_inputs)
            kwargs = _cast.cast_tree(kwargs, device_type, cast_inputs)
            return fwd(*args, **kwargs)

    return decorate_fwd


def _setting_here(device_type: str) -> Any:
    """The setting the kernels run ops on ``device_type`` under here: the thread's; under ``install``, inside a
    module under a module policy, that policy's installed setting; else a recompute's or the installed one (None:
    torch's native behaviour). ``custom_bwd`` brings it back in backward, which may run after the region, or
    the installation, is gone."""
    state = _state.get()
    modules = state.module_policies
    if state.active.get(device_type) is None and modules and _installation.current is not None:
        return _installation.installed_setting(device_type, modules[-1])
    return _recompute.around(device_type)


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Any:
    """Decorate the ``backward`` of a custom Function: it runs in forward's autocast state."""
    _devices.spec(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)
    _check_callable("custom_bwd", "bwd", bwd)

    @functools.wraps(bwd)
    def decorate_bwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        setting = ctx._mixprec_setting if ctx._fwd_used_autocast else None
        cache = torch.is_autocast_cache_enabled()
        with _autocast.level(device_type, setting, ctx._dtype, ctx._fwd_used_autocast, cache):
            return bwd(*args, **kwargs)

    return decorate_bwd
