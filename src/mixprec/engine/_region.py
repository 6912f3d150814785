"""A region's levels in eager code: what entering one saves and sets, and what leaving it restores, written once.

A level is torch's autocast state for one device (enabled, dtype, cache flag, nesting), set as
``torch.autocast.__enter__`` sets it, plus, where the region has one, mixprec's setting for the device
(``_state``). ``mixprec.autocast`` (its ``with`` and its decorator), module policies and checkpoint's
re-entered regions all open and close their levels here::

    open_level(state, device, setting, dtype, enabled, cache):
        setting: push it for the device (the one it replaces is kept; a checkpoint records it)
        frames += (device, pushed, previous setting, torch's state before)   (the thread now holds state)
        torch: enabled, dtype, nesting + 1, cache flag
    close_level(state):
        pop the frame; torch: nesting - 1 (at 0 its cast cache is cleared), enabled, dtype, cache flag back
        the setting it replaced back; with no frame left, the thread's cast cache cleared, its hold released

A level that the device's default policy opens while mixprec holds nothing anywhere takes no frame: its
region keeps torch's state before it (``torch_state``) and restores it (``restore_torch``). Under a
torch-function mode (non-strict export), a level's torch half is ``torch.autocast``'s own object, kept in
the frame in place of the saved state, so that the mode sees the region.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.engine import _cast, _recompute, _state

_is_enabled, _set_enabled = torch.is_autocast_enabled, torch.set_autocast_enabled
_get_dtype, _set_dtype = torch.get_autocast_dtype, torch.set_autocast_dtype
_is_cached, _set_cached = torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled
_increment_nesting, _decrement_nesting = torch.autocast_increment_nesting, torch.autocast_decrement_nesting
_clear_cache = _cast.clear_autocast_cache  # torch's, and mixprec's mirror of torch's cache

#: torch's autocast state for a device, as a level saves it: (enabled, dtype, cache flag).
TorchState = tuple[bool, torch.dtype, bool]


def torch_state(device: str) -> TorchState:
    """torch's autocast state for ``device`` now."""
    return (_is_enabled(device), _get_dtype(device), _is_cached())


def set_torch(device: str, enabled: bool, dtype: torch.dtype, cache_enabled: bool, before: TorchState) -> None:
    """Set torch's state for a level, as ``torch.autocast.__enter__`` does (``before``: the state now; a value
    that does not change is not set again)."""
    if before[0] is not enabled:
        _set_enabled(device, enabled)
    if before[1] is not dtype:
        _set_dtype(device, dtype)
    _increment_nesting()
    if before[2] is not cache_enabled:
        _set_cached(cache_enabled)


def restore_torch(device: str, before: TorchState) -> None:
    """Put torch's state back as ``torch.autocast.__exit__`` does: its cast cache goes at nesting 0."""
    if _decrement_nesting() == 0:
        _clear_cache()
    _set_enabled(device, before[0])
    _set_dtype(device, before[1])
    _set_cached(before[2])


def push_setting(state: _state.ThreadState, device: str, setting: _state.Setting) -> _state.Setting | None:
    """Make ``setting`` the thread's for ``device``; the one it replaces is returned (and recorded for a
    checkpoint's recompute, which needs the setting around a region it re-enters)."""
    previous = state.active.get(device)
    _recompute.record_around(device, previous)
    state.active[device] = setting
    state.pushes.append((device, _recompute.pushed_in()))
    return previous


def pop_setting(state: _state.ThreadState, device: str, previous: _state.Setting | None) -> None:
    """Give ``device`` back the setting ``push_setting`` replaced."""
    if state.pushes:
        state.pushes.pop()
    if previous is None:
        state.active.pop(device, None)
    else:
        state.active[device] = previous


def open_level(
    state: _state.ThreadState,
    device: str,
    setting: _state.Setting | None,
    dtype: torch.dtype,
    enabled: bool,
    cache_enabled: bool,
) -> None:
    """Open one level in eager code (``setting=None`` keeps the thread's setting: a level that only turns
    autocast off, or follows torch's). The setting's kernels must be registered already."""
    previous = push_setting(state, device, setting) if setting is not None else None
    before = torch_state(device)
    try:  # (a failed entry leaves no level behind: its __exit__ never runs)
        set_torch(device, enabled, dtype, cache_enabled, before)
    except BaseException:
        if setting is not None:
            pop_setting(state, device, previous)
        raise
    state.frames.append((device, setting is not None, previous, before))
    try:
        _cast.levels_changed(state)
        _state.hold(state)
    except BaseException:
        close_level(state)
        raise


def add_level(state: _state.ThreadState, device: str, setting: _state.Setting | None, previous: Any,
              entered: Any) -> None:
    """Record a level whose torch half ``entered`` (a ``torch.autocast`` object, entered) holds, after
    ``push_setting`` (where ``setting`` is not None) gave ``previous``."""
    state.frames.append((device, setting is not None, previous, entered))
    _cast.levels_changed(state)
    _state.hold(state)


def close_level(state: _state.ThreadState) -> None:
    """Close the thread's innermost level; with none left, its cast cache goes and its hold is released."""
    device, pushed, previous, before = state.frames.pop()
    if type(before) is tuple:
        restore_torch(device, before)
    else:  # torch.autocast's own object (a level opened under a torch-function mode)
        before.__exit__(None, None, None)
    if pushed:
        pop_setting(state, device, previous)
    _cast.levels_changed(state)  # (with none left, the thread's cast cache goes)
    if not state.frames:
        _state.release(state)
