"""The C++ fast path of mixprec's kernels: the commonest call decided without entering Python.

A Python kernel at an Autocast key costs 5-6 µs a call over torch's own (docs/design.md, "What a kernel
costs"); most of it is the dispatcher's call into Python, which no Python kernel avoids. So each overload that
``_kernels`` gives a Python kernel also gets a C++ kernel on top of it (``_fastpath.cpp``), which handles the
commonest call itself and hands every other call to the Python kernel below it::

    plans   = this thread's table for the device: its mixprec setting's (pushed by _state.ActiveSettings),
              or, with no setting, torch's native categories (while nothing is installed); a thread not
              told of its setting since the kernels came (or came back after a reset) takes the native
              table if it held no mixprec state then (``set_holders``), else goes to Python
    fast    = plans[op] is a plain cast or none, in forward, no saved-tensor hooks, grad on, inference_mode
              or a no_grad outside any custom Function's forward (so no checkpoint records the call), and
              no tracer, Python mode or functorch key in the call's key set, no torch.func transform running
    fast:   with the Autocast key excluded, cast the eligible tensors (weights through the cast caches, as
            ``_cast.cast_weight``) and call the op; or, without a plan, redispatch below the key
    else:   the Python kernel, as if the C++ kernel were not there

The weights' cast caches live in the extension too, for both kinds of kernel (``_cast.use_extension``): a
cached cast costs no trip into Python, and a cast made by either kind is the one the other finds.

A table holds, per overload numbered here, the runner's plan (``_rules.runner``'s ``cast_plan``: the target
dtype or the region's, whether weights are cached, and whether by torch's cache rules): the rules stay in
Python and the C++ repeats only the cast of a plain runner and the eligibility test; ``tests/test_fastpath.py``
holds it to the Python kernel.

The extension is built on first use against the torch installed (``torch.utils.cpp_extension.load``: about
16 s with g++ 12, once per torch release, Python and source, under ``build_directory()``). Where it cannot be
built (no compiler: a warning says so once) or is not wanted (``MIXPREC_CPP=0``), the Python kernels do all
the work, with the same results.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mixprec import _compat
from mixprec.engine import _state

Op = torch._ops.OpOverload

_SOURCE = Path(__file__).with_name("_fastpath.cpp")
_SLOW, _THROUGH, _CAST = 0, 1, 2  # a plan's kind (_fastpath.cpp's Kind)
_log = logging.getLogger("mixprec")

_lock = threading.Lock()
_loaded: list[Any] = []  # [the extension module, or None where it could not be built]
_failure: list[str] = []  # why it could not be built
_numbers: dict[Op, int] = {}  # overload -> its number in every table (never reused)
_slots: dict[str, int] = {}  # device type -> its slot in the C++ thread-local tables
_registrations: list[Any] = []  # the C++ kernels (dropping one unregisters it)
_native: dict[str, Any] = {}  # device type -> the table of torch's native categories (None: nothing yet)
_native_on = True  # False while mixprec.install is in force: then a call with no setting goes to Python
_MAX_SLOTS = 8  # _fastpath.cpp's kDevices


def _not_wanted() -> bool:
    """``MIXPREC_CPP`` says no: ``0``, ``false``, ``off`` or ``no``, in any case."""
    return os.environ.get("MIXPREC_CPP", "1").strip().lower() in ("0", "false", "off", "no")


def disabled_reason() -> str | None:
    """Why the C++ kernels are not in use (``MIXPREC_CPP=0``, or the build failed), or None once they are."""
    if (not _loaded or _loaded[0] is None) and _not_wanted():
        return "MIXPREC_CPP=0"
    return _failure[0] if _failure else None


def extension() -> Any:
    """The built extension, or None where it cannot be had (``disabled_reason`` says why)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:  # (never traced: under a frame dynamo runs eagerly it would compile the build's frames)
            _loaded.append(_compat.without_dynamo(_build)())
    return _loaded[0]


def _build() -> Any:
    if _not_wanted():
        return None
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode() + sys.version.encode()).hexdigest()[:12]
    name = f"mixprec_fastpath_{tag}"
    _log.info("mixprec: building its C++ kernels for torch %s (once per torch release)", torch.__version__)
    try:
        module = _compat.load_extension(name, str(_SOURCE), build_directory() / name)
    except Exception as error:
        _failure.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error) else ''}")
        _log.warning(
            "mixprec: C++ kernels unavailable (%s); the Python kernels run instead. They are built in %s "
            "(MIXPREC_CACHE_DIR names another directory); MIXPREC_CPP=0 skips the build.",
            _failure[0], build_directory(),
        )
        return None
    from mixprec.engine import _cast, _plan

    _cast.use_extension(module)  # the weights' casts kept in C++, for both kinds of kernel
    module.set_eligible([d for d in dtypes() if _plan.eligible(d, "any", "any")])  # the rule stays _plan's
    module.set_reversed(_compat.native_casts_reversed())  # the casts in torch's kernels' order
    return module


def dtypes() -> list[torch.dtype]:
    """Every dtype this torch has."""
    return sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)


def build_directory() -> Path:
    """Where the builds go: ``$MIXPREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixprec`` (``~/.cache/mixprec``)."""
    own = os.environ.get("MIXPREC_CACHE_DIR")
    if own:
        return Path(own)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixprec"


def slot(device_type: str) -> int | None:
    """The device's slot in the C++ thread-local tables (None past the last one)."""
    found = _slots.get(device_type)
    if found is None and len(_slots) < _MAX_SLOTS:
        found = _slots[device_type] = len(_slots)
    return found


def known_devices() -> dict[str, int]:
    """The device types that have a slot (C++ kernels may serve them)."""
    return _slots


def attach(op: Op, key: str, device_type: str) -> bool:
    """Put a C++ kernel for ``op`` on top of the Python kernel just registered at ``key``; False without one."""
    module = extension()
    where = slot(device_type)
    if module is None or where is None:
        return False
    schema = op._schema
    number = _numbers.get(op, len(_numbers))
    try:
        made = module.attach(schema.name, schema.overload_name, key, number, where, device_type)
    except RuntimeError as error:  # the dispatcher refused it: the Python kernel serves the overload alone
        _log.warning("mixprec: no C++ kernel for %s.%s (%s)", schema.name, schema.overload_name, error)
        return False
    if made is None:  # no schema in the dispatcher (TorchScript's own overloads): the Python kernel alone
        return False
    _numbers[op] = number
    _registrations.append(made)
    return True


def detach_all() -> None:
    """Unregister every C++ kernel (before the Python kernels below them go)."""
    _registrations.clear()
    _native.clear()
    module = _loaded[0] if _loaded else None
    if module is not None:
        module.new_epoch()  # no thread's table counts until Python tells the thread's setting again
        for where in _slots.values():
            module.set_native(where, None)


def set_holders(idents: set[int]) -> None:
    """The threads that hold mixprec state now (``_state.holders``), as the kernels come: a thread not among
    them and not told of a setting since has none (any it makes is told), so it may take the native table."""
    module = _loaded[0] if _loaded else None
    if module is not None:
        module.set_holders(sorted(idents))


def count() -> int:
    """How many overloads are numbered (a table made with fewer sends the rest to Python)."""
    return len(_numbers)


def table(entries: dict[Op, Any]) -> Any:
    """A C++ table of ``entries`` (``{overload: runner}``) over every numbered overload, or None without the
    extension. An overload without an entry falls through; one whose runner has no ``cast_plan`` goes to
    Python."""
    module = extension()
    if module is None:
        return None
    numbered = list(_numbers.items())  # (another thread may be numbering more: numbers 0..n-1 of them now)
    plans: list[tuple[int, Any, bool, bool]] = [(_SLOW, None, False, False)] * len(numbered)
    for op, number in numbered:
        entry = entries.get(op)
        if entry is None:
            plans[number] = (_THROUGH, None, False, False)
            continue
        plan = getattr(entry, "cast_plan", None)
        if plan is not None:
            plans[number] = (_CAST, *plan)
    return module.make_table(plans)


def set_active(device_type: str, made: Any) -> None:
    """This thread's table for ``device_type`` (None: every call with no native table goes to Python)."""
    module = _loaded[0] if _loaded else None
    where = _slots.get(device_type)
    if module is not None and where is not None:
        module.set_active(where, made, bool(_state.get().frames))


def set_native(device_type: str, made: Any) -> None:
    """The process's table of torch's native categories for ``device_type``, for calls with no setting."""
    module = _loaded[0] if _loaded else None
    where = _slots.get(device_type)
    if module is None or where is None:
        return
    _native[device_type] = made
    module.set_native(where, made if _native_on else None)


def counts() -> tuple[int, int]:
    """This thread's calls so far that the C++ kernels took, and that they handed to the Python kernels."""
    module = _loaded[0] if _loaded else None
    return (0, 0) if module is None else tuple(module.counts())  # type: ignore[return-value]


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Every call goes to the Python kernels while this lasts (every thread's): they alone decide, as without
    the extension."""
    module = extension()
    if module is None:
        yield
        return
    module.set_enabled(False)
    try:
        yield
    finally:
        module.set_enabled(True)


def native_allowed(on: bool) -> None:
    """Whether a call with no setting may take the native table (not while ``mixprec.install`` is in force)."""
    global _native_on
    _native_on = on
    module = _loaded[0] if _loaded else None
    if module is not None:
        for device_type, made in _native.items():
            module.set_native(_slots[device_type], made if on else None)
