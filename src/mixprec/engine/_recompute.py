"""Which mixprec setting a checkpoint's recompute needs.

``torch.utils.checkpoint`` recomputes a forward inside backward, outside any
mixprec region, under a ``torch.autocast`` it re-enters with the enabled flag,
dtype and cache flag it captured. Torch has no slot for the policy and the
compute, so mixprec's kernels leave them on the checkpoint's own record of the
forward, and read them back during the recompute::

    forward, in a kernel running under a setting, or as a region opens (the setting around it):
        non-reentrant (grad on):  the _CheckpointFrame behind the innermost saved-tensor hooks
        reentrant (grad off):     the ctx of the enclosing CheckpointFunction.forward (also under hooks of
                                  the user's own, such as save_on_cpu)
        -> record[device] = setting          (once per checkpoint call: the first one)
    recompute, in a kernel with no setting of its own (backward, graph task >= 0):
        non-reentrant: the frame behind the recomputation hooks;  reentrant: CheckpointFunction.backward's ctx
        -> record[device]; if none was left, the installed setting or torch's native behaviour
    recompute inside a region (backward() called in one: ``backward_setting``): the record too (NATIVE if none),
        not the region's setting, unless a region the recomputed forward re-entered pushed it
        (``ThreadState.pushes`` says which recompute, if any, pushed each setting); a backward op: the region's

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


def _reentrant_ctx(code: Any) -> Any:
    """The ``ctx`` of the innermost ``CheckpointFunction`` frame running ``code``, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _hooks_frame() -> Any:
    """The non-reentrant checkpoint's frame behind the innermost saved-tensor hooks, or None (no hooks, or the
    user's own)."""
    hooks = _top_hooks(False)
    return _frame_of(hooks[0]) if hooks is not None else None


def _holder(forward: bool) -> Any:
    """The record of the checkpoint running this code: the non-reentrant one's frame behind the innermost
    saved-tensor hooks, else (hooks of the user's own on top, such as ``save_on_cpu``, or none) the reentrant
    one's ``ctx``, in its forward (grad off) or its backward."""
    frame = _hooks_frame()
    if frame is not None:
        return frame
    if forward and torch.is_grad_enabled():
        return None
    return _reentrant_ctx(_compat.checkpoint_function_code("forward" if forward else "backward"))


def recompute_holder() -> Any:
    """In backward: the record of the checkpoint whose forward is being recomputed now (under the non-reentrant
    one's recomputation hooks, or in the reentrant one's backward node), or None (a backward op, say)."""
    frame = _hooks_frame()
    if frame is not None:
        return frame
    if _compat.in_reentrant_recompute():
        return _reentrant_ctx(_compat.checkpoint_function_code("backward"))
    return None


def pushed_in() -> Any:
    """As a setting is pushed: the checkpoint whose recompute pushes it (a region re-entered there), or None."""
    return None if _task_id() < 0 else recompute_holder()


def backward_setting(state: _state.ThreadState, device_type: str, setting: _state.Setting) -> Any:
    """In backward, with the thread's ``setting`` in force (a region open around ``backward()``): what a kernel
    runs under. A backward op: ``setting``, as native autocast casts backward ops inside a region. A
    recompute: what its forward ran, as torch's re-entered ``torch.autocast`` restores the forward's state, so
    the setting its forward left (``NATIVE`` where it left none), unless a region the recomputed forward
    re-enters pushed ``setting`` (its innermost push for the device came in this recompute)."""
    holder = recompute_holder()
    if holder is None:
        return setting
    for device, pushed in reversed(state.pushes):
        if device == device_type:
            if pushed is holder:
                return setting
            break
    settings = getattr(holder, _ATTRIBUTE, None)
    found = settings.get(device_type) if settings is not None else None
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
    """As a region opens in forward, inside a checkpoint: leave the setting the code around it runs under
    (the thread's ``previous`` one, else the installed one, else torch's native behaviour). Module policies'
    too: a module around the checkpoint call runs no hook in the recompute."""
    if not in_forward():
        return
    around = previous or _install.installed_setting(device_type)
    _leave(device_type, NATIVE if around is None else around)


def record_native(device_type: str) -> None:
    """In forward: leave ``NATIVE`` on the checkpoint running this code, if any."""
    _leave(device_type, NATIVE)


def _leave(device_type: str, value: Any) -> None:
    if _compat.tracing():
        return
    holder = _holder(forward=True)
    if holder is None:
        return
    settings = getattr(holder, _ATTRIBUTE, None)
    if settings is None:
        settings = {}
        setattr(holder, _ATTRIBUTE, settings)
    settings.setdefault(device_type, value)


def recomputing() -> bool:
    """In backward: whether the code running is a checkpoint's recompute of its forward (under the non-reentrant
    checkpoint's recomputation hooks, or in the reentrant one's backward node), not a backward op."""
    return _hooks_frame() is not None or _compat.in_reentrant_recompute()


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
    holder = _holder(forward=False)
    settings = getattr(holder, _ATTRIBUTE, None) if holder is not None else None
    return None if settings is None else settings.get(device_type)
