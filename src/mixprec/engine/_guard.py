"""Compiled code and mixprec's state: what a trace must know, guard and refuse.

The kernels at the Autocast keys bake their casts into a traced graph, and dynamo
does not see mixprec's thread-local state. Everything here runs eagerly while a
trace runs, from the places a trace meets mixprec (a region made in the compiled
code, a module policy, a kernel):

* ``contact``: the first time in a trace, keep mixprec's own functions out of
  dynamo's frame compilation (``keep_eager``), snapshot mixprec's state at the
  frame's entry, and put the thread's state back when the trace ends.
* ``guard_trace``: guard the frame on that snapshot, so a call under other
  settings recompiles. A trace that meets no mixprec kernel or region needs no
  guard: mixprec cannot change what it computes, and ``_kernels.register``
  resets dynamo when new kernels appear.
* ``refuse_export`` / ``refuse_installed_export``: torch.export keeps torch's
  autocast state only, so a policy it would drop is refused.

Dynamo's internals used here (``skip_code``, the instruction translator, the
tracing context's guards, inductor's custom-pass hook) are private: they are
reached through ``_compat``, which names the torch source of each and the
releases it was checked on.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from mixprec import _compat, _errors
from mixprec.engine import _installation as _install
from mixprec.engine import _memo, _state, _tables
from mixprec.policies import Policy

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # mixprec/, not engine/
_DYNAMO = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep + "_dynamo" + os.sep


def entry_key() -> tuple[Any, ...]:
    """This thread's mixprec state as a value compared by content: the installation, the settings per device and
    the module policies."""
    state = _state.get()
    return (
        _install.key(),
        tuple(sorted((device, setting.key) for device, setting in state.active.items())),
        tuple(state.module_policies),
    )


_fingerprints: _memo.Memo[Policy, str] = _memo.Memo(256, "policy fingerprints")


def fingerprint(policy: Policy) -> str:
    """A digest of what ``policy`` holds, the same in every process (``hash`` is not: str hashes are salted)."""
    found = _fingerprints.get(policy)
    if found is None:
        text = repr((policy.name, policy.base, sorted((op, c.value) for op, c in policy.table.items())))
        found = _fingerprints.put(policy, hashlib.sha256(text.encode()).hexdigest()[:16])
    return found


def _stable(value: Any) -> Any:
    """``value`` with every policy as its fingerprint and every set sorted: a repr that is the same in every
    process, for inductor's cache key (an on-disk cache shared between processes)."""
    if isinstance(value, Policy):
        return fingerprint(value)
    if isinstance(value, (tuple, list)):
        return tuple(_stable(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(map(str, value)))
    return value


# ---------------------------------------------------------------- the first contact of a trace with mixprec


def _code_objects(module: types.ModuleType) -> Iterator[types.CodeType]:
    """Every code object defined in ``module``: its functions, its classes' methods, their nested functions."""
    seen: set[int] = set()

    def walk(code: types.CodeType) -> Iterator[types.CodeType]:
        if id(code) not in seen:
            seen.add(id(code))
            yield code
            for const in code.co_consts:
                if isinstance(const, types.CodeType):
                    yield from walk(const)

    def functions(namespace: dict[str, Any], owner: str) -> Iterator[Any]:
        for value in list(namespace.values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                yield from (f for f in (value.fget, value.fset, value.fdel) if f is not None)
            elif isinstance(value, types.FunctionType) and value.__module__ == owner:
                yield value
            elif isinstance(value, type) and value.__module__ == owner:
                yield from functions(dict(vars(value)), owner)

    for function in functions(dict(vars(module)), module.__name__):
        yield from walk(function.__code__)


_kept: set[str] = set()
#: mixprec's frames that a user compiles as the root of a trace: the decorator's wrapper and AutocastModule's
#: forward (``torch.compile(decorated, fullgraph=True)``). Each opens a region that dynamo traces as it traces
#: one in the user's own code, so dynamo compiles them; every other mixprec frame runs eagerly.
_ROOTS = frozenset({("_autocast.py", "decorate_autocast"), ("_module.py", "forward")})


def _compiled_root(code: types.CodeType) -> bool:
    """Whether dynamo may compile ``code``, a mixprec frame, as a frame of its own (one of ``_ROOTS``)."""
    return (code.co_filename[len(_PACKAGE):], code.co_name) in _ROOTS and code.co_filename.startswith(_PACKAGE)


def keep_eager() -> None:
    """Never let dynamo compile one of mixprec's own functions as a frame of its own (it still inlines them).

    When dynamo gives up on a frame that holds a mixprec region (a graph break inside it), it runs the frame
    eagerly and compiles the frames that frame calls: mixprec's entry, exit and kernels must then run
    eagerly, as the region was opened, not be traced as frames of their own. Done once per loaded mixprec
    module, the first time a trace meets mixprec. ``contact`` covers a trace that began at a mixprec frame
    before this ran.
    """
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("mixprec.") and name not in _kept]
    for module in modules:
        for code in _code_objects(module):
            if not _compiled_root(code):
                _compat.skip_code(code)
        _kept.add(module.__name__)


def made_for_with() -> bool:
    """Whether the object whose ``__new__`` dynamo traces now goes straight into a ``with`` statement.

    Run eagerly from a constant function called by that ``__new__``: the innermost instruction translator on
    the Python stack traces ``__new__``; above it are dynamo's polyfill that makes user-defined objects and,
    for a subclass, the subclass's ``__new__``; the next instruction of the frame above those tells.
    Anything unexpected answers False (the region is then mixprec's object, which is right everywhere).
    """
    translator = _compat.translator_class()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), translator):
        frame = frame.f_back
    if frame is None:
        return False
    tx = frame.f_locals["self"]
    while tx is not None and (
        (tx.f_code.co_name == "__new__" and tx.f_code.co_filename.startswith(_PACKAGE))
        or tx.f_code.co_filename.startswith(_DYNAMO)  # its polyfill that makes user-defined objects
    ):
        tx = tx.parent
    if tx is None or tx.instruction_pointer is None or tx.instruction_pointer >= len(tx.instructions):
        return False
    return bool(tx.instructions[tx.instruction_pointer].opname in _compat.WITH_OPCODES)


def contact() -> None:
    """Run (eagerly) wherever a trace meets mixprec: a region, a module policy, a kernel.

    The first time in a trace: keep mixprec's frames eager; refuse to trace a frame of mixprec's own (dynamo
    then runs it eagerly, as its caller did); snapshot mixprec's state at the frame's entry for the guards;
    and put the thread's state back when the trace ends, since ``push`` runs while tracing.
    """
    context = _compat.tracing_context()
    if context is None or getattr(context, "_mixprec_entry", None) is not None:
        return
    keep_eager()
    tx = _compat.current_translator()
    root = tx.output.root_tx.f_code if tx is not None else None
    if root is not None and root.co_filename.startswith(_PACKAGE) and not _compiled_root(root):
        raise _compat.skip_frame("mixprec's own functions run eagerly")
    setattr(context, "_mixprec_entry", entry_key())  # noqa: B010 - a private mark on torch's object
    if tx is None:  # AOTAutograd or export without dynamo: no trace of ours to restore after
        return
    state = _state.get()
    saved = (dict(state.active), list(state.module_policies), list(state.pushes))

    def restore() -> None:
        state.active.clear()
        state.active.update(saved[0])
        state.module_policies[:] = saved[1]
        state.pushes[:] = saved[2]
        _state.release(state)

    _compat.add_cleanup(tx, restore)


# ---------------------------------------------------------------- guards


def guard_trace() -> None:
    """Guard the frame being compiled on mixprec's state at its entry (run eagerly, once a trace).

    The kernels' casts are baked into the graph, so a call under other settings must recompile. Dynamo has no
    public way to add a guard: this adds a lambda guard through the tracing context, as torch's functorch-stack
    guard does, and puts the state into inductor's cache key through a custom pass's ``uuid`` (the
    AOTAutograd cache keys a graph on autocast's enabled flag and dtype only).
    """
    context = _compat.tracing_context()
    if context is None:
        return
    contact()
    if getattr(context, "_mixprec_guarded", False):
        return
    setattr(context, "_mixprec_guarded", True)  # noqa: B010 - a private mark on torch's object
    key = getattr(context, "_mixprec_entry")  # noqa: B009 - set by contact above
    state = _state.get()
    described = ", ".join(f"{d}: {s.policy.name}" for d, s in state.active.items()) or "none"
    _compat.add_global_guard(context, lambda: entry_key() == key, f"mixprec settings == ({described})")
    _compat.key_inductor(_stable(key))


# ---------------------------------------------------------------- export


_RECORDED = "torch.export records an autocast region as torch's autocast (device, dtype, enabled, cache), so "
_APPLY = "export the float32 model and apply the policy to the program with mixprec.graph.apply_policy"


def _refuse(setting: _state.Setting, what: str, loses: str, fix: str) -> None:
    """Refuse, while torch.export traces, a setting whose policy changes a category: the program would lose it.

    Emulated compute is not refused: it has native's casts and dtypes, and the exported program runs its
    low-precision ops on the kernels of the device it is deployed on.
    """
    if not _compat.exporting() or not _tables.effective(setting.policy, setting.device_type)[1]:
        return
    raise RuntimeError(_errors.message(what, _RECORDED + loses, received={"policy": setting.policy}, fix=fix))


def refuse_export(setting: _state.Setting) -> None:
    """A mixprec region with this setting while torch.export traces."""
    _refuse(setting, "This mixprec.autocast region cannot be exported",
            "the exported program would apply torch's native categories, not this policy's",
            f"{_APPLY[0].upper()}{_APPLY[1:]}, or keep the device's default policy inside exported code.")


def refuse_installed_export(setting: _state.Setting) -> None:
    """A kernel serving ``mixprec.install`` while torch.export traces."""
    _refuse(setting, "This program cannot be exported under mixprec.install",
            "the exported program would follow whatever is installed when it runs, not this policy",
            f"Remove the installation before exporting: {_APPLY}.")
