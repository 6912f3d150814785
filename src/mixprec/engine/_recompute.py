"""Which mixprec setting a checkpoint's recompute needs.

``torch.utils.checkpoint`` recomputes a forward inside backward, outside any
mixprec region, under a ``torch.autocast`` it re-enters with the enabled flag,
dtype and cache flag it captured. Torch has no slot for the policy and the
compute, so mixprec's kernels leave them on the checkpoint's own record of the
forward, and read them back during the recompute::

    the checkpoints whose forward runs some code (innermost first):
        non-reentrant (grad on):  the _CheckpointFrame behind the innermost saved-tensor hooks (its pack hooks)
        reentrant (grad off):     the ctx of each CheckpointFunction.forward on the Python stack (also under
                                  hooks of the user's own, such as save_on_cpu)
    the checkpoint whose recompute runs it (in backward):
        non-reentrant: the frame behind the recomputation hooks, or whose unpack hook is on the Python stack;
        reentrant: the ctx of CheckpointFunction.backward (its node is the one autograd runs)
    forward, in a kernel running under a setting, or as a region opens (the setting around it):
        -> record[device] = setting on every checkpoint whose forward runs it (the first one each keeps)
    recompute, in a kernel with no setting of its own (backward, graph task >= 0):
        the record of the innermost checkpoint whose forward runs again inside it (a nested checkpoint: its
        record, or the recomputed one's, which it then takes), else the recomputed one's record;
        if none was left, the installed setting or torch's native behaviour
    recompute inside a region (backward() called in one: ``backward_setting``): the record too (NATIVE if none),
        not the region's setting, unless a region the recomputed forward re-entered pushed it
        (``ThreadState.pushes`` says which recompute, if any, pushed each setting); a backward op: the region's

A checkpoint nested in another runs its forward again in the outer one's recompute (a new ``ctx`` or frame,
whose own recompute comes later), and records there as in forward. Every checkpoint around the code takes the
record, not only the innermost: an outer one whose forward runs no kernel outside the inner one must still run
the inner one's forward again, in its recompute, under that setting.

The record is the setting of the code around the regions opened inside the
checkpointed function: a recompute re-enters those, and they set their own. So a
region opening in a checkpointed forward records the setting in force around it
before a kernel inside it can record the region's own. Otherwise kernels record,
which is enough: an op with no mixprec kernel runs the same in forward and in
recompute, and if no kernel ran in a checkpointed forward, none runs in its
recompute either. A module policy's setting is recorded like a region's: a
module inside the checkpoint leaves the setting around it as it enters (its
hook runs again in the recompute and sets its own); one holding the checkpoint
runs no hook there, and its kernels' record is what the recompute runs. Under ``install``, a module entered while
autocast was off puts its policy on the ``torch.autocast`` regions inside it
through the kernels (``record_module``: it may hold the checkpoint, and then
runs no hook in the recompute; one inside the checkpoint records the setting
around it as it enters, so its own never becomes the record). These are torch.utils.checkpoint's private
structures; tests/test_interop.py pins them.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from mixprec import _compat
from mixprec.engine import _installation as _install
from mixprec.engine import _state

_ATTRIBUTE = "_mixprec_settings"
_top_hooks = _compat.top_saved_tensors_hooks
_frame_of = _compat.checkpoint_frame_of


def _walk(first_forward: bool = False) -> tuple[list[Any], Any]:
    """This thread's Python frames, from the caller's caller outward: the ``ctx`` of each reentrant checkpoint
    whose forward runs this code, innermost first, up to the checkpoint whose recompute runs it (a reentrant one's
    ``ctx``, or the non-reentrant ``_CheckpointFrame`` whose unpack hook recomputes), and that one (or None).
    ``first_forward``: stop at the first forward."""
    kinds = _compat.checkpoint_codes()
    forwards: list[Any] = []
    frame = sys._getframe(2)
    while frame is not None:
        kind = kinds.get(frame.f_code)
        if kind is not None:
            holder = frame.f_locals.get("frame" if kind == "unpack" else "ctx")
            if kind != "forward":
                return forwards, holder
            forwards.append(holder)
            if first_forward:
                break
        frame = frame.f_back  # type: ignore[assignment]
    return forwards, None


def _context(backward: bool) -> tuple[list[Any], Any]:
    """``(forwards, recomputed)``: the checkpoints whose forward runs this code, innermost first, and in backward
    the one whose recompute runs it (None in forward, and for a backward op). A non-reentrant checkpoint's
    forward is the one behind the top saved-tensor hooks (its pack hooks); a reentrant one's runs with grad off,
    so under grad on the hooks' checkpoint is the innermost, under grad off the reentrant ones are."""
    hooks = _top_hooks(False)
    top = _frame_of(hooks[0]) if hooks is not None else None
    grad_on = torch.is_grad_enabled()
    if backward:
        if top is not None and top[1]:  # under a non-reentrant recompute's hooks
            return ([] if grad_on else _walk()[0]), top[0]
        if hooks is None and not _compat.in_reentrant_recompute():
            return [], None  # a backward op
    elif grad_on:
        return ([top[0]] if top is not None else []), None
    forwards, recomputed = _walk()
    if top is not None:
        forwards.insert(0 if grad_on else len(forwards), top[0])
    return forwards, (recomputed if backward else None)


def _innermost_forward() -> Any:
    """``_context(False)[0][0]`` (or None), at less cost: under grad off, the walk stops at the first forward."""
    if not torch.is_grad_enabled():
        forwards = _walk(first_forward=True)[0]
        if forwards:
            return forwards[0]
    hooks = _top_hooks(False)
    top = _frame_of(hooks[0]) if hooks is not None else None
    return top[0] if top is not None and not top[1] else None


def _record_of(holder: Any, device_type: str) -> Any:
    settings = getattr(holder, _ATTRIBUTE, None)
    return settings.get(device_type) if settings is not None else None


def _put(holders: list[Any], device_type: str, value: Any) -> None:
    """Leave ``value`` on each of ``holders`` that has none for ``device_type``."""
    for holder in holders:
        settings = getattr(holder, _ATTRIBUTE, None)
        if settings is None:
            settings = {}
            setattr(holder, _ATTRIBUTE, settings)
        settings.setdefault(device_type, value)


def _found(forwards: list[Any], recomputed: Any, device_type: str) -> Any:
    """In a recompute: the setting the code runs under, from the innermost of ``forwards`` (checkpoints run again
    inside it) that has a record, else the recomputed checkpoint's record (or None: none left); the
    ``forwards`` without one take it, as their forward runs under the code around them."""
    for holder in (*forwards, recomputed):
        found = _record_of(holder, device_type)
        if found is not None:
            _put(forwards, device_type, found)
            return found
    return None


def _pushed_here(state: _state.ThreadState, device_type: str, recomputed: Any) -> bool:
    """Whether the thread's innermost setting for ``device_type`` was pushed in ``recomputed``'s recompute (by a
    region its forward re-enters)."""
    for device, pushed in reversed(state.pushes):
        if device == device_type:
            return pushed is recomputed
    return False


def pushed_in() -> Any:
    """As a setting is pushed: the checkpoint whose recompute pushes it (a region re-entered there), or None."""
    return None if _task_id() < 0 else _context(backward=True)[1]


def backward_setting(state: _state.ThreadState, device_type: str, setting: _state.Setting) -> Any:
    """In backward, with the thread's ``setting`` in force (a region open around ``backward()``): what a kernel
    runs under. A backward op: ``setting``, as native autocast casts backward ops inside a region. A
    recompute: what its forward ran, as torch's re-entered ``torch.autocast`` restores the forward's state, so
    the setting its forward left (``NATIVE`` where it left none), unless a region the recomputed forward
    re-enters pushed ``setting`` (its innermost push for the device came in this recompute)."""
    forwards, recomputed = _context(backward=True)
    if recomputed is None or _pushed_here(state, device_type, recomputed):
        return setting
    found = _found(forwards, recomputed, device_type)
    return NATIVE if found is None else found


#: Left by a forward that ran torch's native behaviour, so that its recompute does too (even if
#: ``mixprec.install`` came in between).
NATIVE: Any = object()


def record(setting: _state.Setting) -> None:
    """In forward: leave ``setting`` on the checkpoint running this code, if any and if none was left."""
    _leave(setting.device_type, setting)


def record_module(setting: _state.Setting) -> None:
    """In forward, under ``install``: leave a module policy's ``setting``, which a ``torch.autocast`` region
    inside the module runs under, on the checkpoint running this code, if any and if none was left: the module
    holds the checkpoint (a module inside it left the setting around it first, ``record_around``)."""
    _leave(setting.device_type, setting)


_task_id = _compat.graph_task_id
_grad_enabled = torch.is_grad_enabled


def in_forward() -> bool:
    """Forward, and possibly inside a checkpoint: saved-tensor hooks, or no_grad for the reentrant one."""
    return _task_id() < 0 and (not _grad_enabled() or _top_hooks(False) is not None)


def record_around(device_type: str, previous: _state.Setting | None) -> None:
    """As a region opens inside a checkpoint's forward (or a checkpoint run again in a recompute): leave the
    setting the code around it runs under (the thread's ``previous`` one, else the installed one, else torch's
    native behaviour; in a recompute, ``previous`` if a region re-entered there pushed it, else what the
    recompute runs). Module policies' too: a module around the checkpoint call runs no hook in the recompute."""
    if _task_id() < 0:
        if in_forward():
            around = previous or _install.installed_setting(device_type)
            _leave(device_type, NATIVE if around is None else around)
        return
    if _compat.tracing():
        return
    forwards, recomputed = _context(backward=True)
    if not forwards or recomputed is None:
        return
    if previous is not None and _pushed_here(_state.get(), device_type, recomputed):
        around = previous
    else:
        around = _found(forwards, recomputed, device_type) or _install.installed_setting(device_type)
    _put(forwards, device_type, NATIVE if around is None else around)


def record_native(device_type: str) -> None:
    """In forward: leave ``NATIVE`` on the checkpoint running this code, if any."""
    _leave(device_type, NATIVE)


def _leave(device_type: str, value: Any) -> None:
    """In forward: leave ``value`` on every checkpoint whose forward runs this code and has none for
    ``device_type`` (an inner one's record comes with its outer ones': if the innermost has one, all have)."""
    if _compat.tracing():
        return
    innermost = _innermost_forward()
    if innermost is None or _record_of(innermost, device_type) is not None:
        return
    _put(_context(backward=False)[0], device_type, value)


def recomputing() -> bool:
    """In backward: whether the code running is a checkpoint's recompute of its forward (under the non-reentrant
    checkpoint's recomputation hooks, or in the reentrant one's backward node), not a backward op."""
    return _context(backward=True)[1] is not None


def around(device_type: str) -> _state.Setting | None:
    """The setting ops on ``device_type`` run under here: the thread's, else a recompute's, else the installed one
    (None: torch's native behaviour, also where a recompute's forward left ``NATIVE``)."""
    found = _state.get().active.get(device_type) or recompute_setting(device_type)
    if found is NATIVE:
        return None
    return found or _install.installed_setting(device_type)


def recompute_setting(device_type: str) -> Any:
    """In a recompute: the setting its forward left for ``device_type``, ``NATIVE``, or None (none was left)."""
    if _task_id() < 0 or _compat.tracing():  # (forward first: the cheaper test, and the kernels' common case)
        return None
    forwards, recomputed = _context(backward=True)
    return None if recomputed is None else _found(forwards, recomputed, device_type)
