"""A mixprec region inside code that torch.compile traces.

Torch's part of a region (``torch.amp._enter_autocast`` / ``_exit_autocast``)
is understood by dynamo: it enters autocast while tracing and records the
state change in the graph. mixprec's part, the thread's setting, is put in the
graph as calls of ``push(token)``, a function dynamo writes into the graph
unexamined (``allow_in_graph``) and runs on each pass over the graph (its own
fake-tensor pass, AOTAutograd's trace, the eager backend's run), so the
kernels at the Autocast keys see the region's policy wherever they run. The
casts they make end up in the graph; ``push`` itself leaves nothing in an
ATen graph.

torch.export records a region as torch's ``wrap_with_autocast``, which holds
torch's state only: ``strict_exporting`` and ``torch_region`` let strict export
see torch's part as a ``with torch.autocast`` block, and ``token`` refuses to
export a region whose policy changes a category.

Nothing here imports ``torch._dynamo`` when mixprec is imported: ``constant``
(``mixprec._constant``) marks a function as ``torch.compiler.assume_constant_result``
does, and ``token`` (run eagerly by the trace) registers ``push`` with dynamo.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from mixprec import _errors, _guard, _kernels, _state, _tables
from mixprec._constant import constant
from mixprec.policies import Policy

_lock = threading.Lock()
_tokens: dict[int, tuple[str, _state.Setting | None]] = {}


@constant
def token(device_type: str, policy: Policy | None, emulate: bool, emulate_ops: frozenset[str]) -> int:
    """An int standing for a setting in a graph (None: no setting), its kernels registered (run eagerly)."""
    if policy is not None and "table" not in vars(policy):
        # Dynamo hands a constant function an object made during the trace without its attributes.
        raise RuntimeError(
            _errors.message(
                "mixprec.autocast got a policy made inside the compiled function",
                "torch.compile passes an object built while tracing to mixprec without its table",
                fix="Build the policy outside the compiled function (e.g. at module level) and pass it in.",
            )
        )
    setting = None if policy is None else _state.Setting(device_type, policy, emulate, emulate_ops)
    if setting is not None:
        _refuse_export(setting)
        _kernels.ensure(setting)
    import torch._dynamo

    torch._dynamo.allow_in_graph(push)
    _guard.guard_trace()
    _restore_after_trace(device_type)
    _state.hold(_state.get())  # the trace sets settings in this thread (``push``)
    key = hash((device_type, id(policy), emulate, emulate_ops))
    with _lock:
        _tokens[key] = (device_type, setting)
    return key


@constant
def strict_exporting() -> bool:
    """Whether dynamo is tracing for ``torch.export.export(..., strict=True)`` (run eagerly by the trace)."""
    if not torch.compiler.is_exporting():
        return False
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        InstructionTranslator.current_tx()
    except AttributeError:  # non-strict export runs the code itself
        return False
    return True


@contextlib.contextmanager
def torch_region(device: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool) -> Iterator[None]:
    """Torch's autocast as a ``with`` statement, which strict export records as ``wrap_with_autocast``
    (dynamo enters a generator context called explicitly, not ``torch.autocast.__enter__``)."""
    with torch.autocast(device, dtype, enabled, cache_enabled):
        yield


def _refuse_export(setting: _state.Setting) -> None:
    """An exported program keeps torch's autocast state, not mixprec's policy: refuse a policy it would drop.

    Emulated compute is not refused: it has native's casts and dtypes, and the exported program runs its
    low-precision ops on the kernels of the device it is deployed on.
    """
    if not torch.compiler.is_exporting() or not _tables.effective(setting.policy, setting.device_type)[1]:
        return
    raise RuntimeError(
        _errors.message(
            "This mixprec.autocast region cannot be exported",
            "torch.export records a region as torch's autocast (device, dtype, enabled, cache), so the "
            "exported program would apply torch's native categories, not this policy's",
            received={"policy": setting.policy},
            fix="Export the float32 model and apply the policy to the program with "
            "mixprec.graph.apply_policy, or keep the device's default policy inside exported code.",
        )
    )


def _restore_after_trace(device_type: str) -> None:
    """Dynamo runs ``push`` while tracing; put the thread's settings back when the trace ends, also on failure.

    Torch's autocast dtype too: dynamo restores the enabled flags after a failed trace, not the dtype that
    ``torch.amp._enter_autocast`` set while tracing.
    """
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        output = InstructionTranslator.current_tx().output
    except AttributeError:  # not under dynamo's frame translation (e.g. non-strict export)
        return
    if getattr(output, "_mixprec_restores", False):
        return
    setattr(output, "_mixprec_restores", True)  # noqa: B010 - a private mark on dynamo's object
    active = _state.get().active
    saved = dict(active)
    dtype = torch.get_autocast_dtype(device_type)

    def restore() -> None:
        active.clear()
        active.update(saved)
        if saved:
            _state.hold(_state.get())
        torch.set_autocast_dtype(device_type, dtype)

    output.add_cleanup_hook(restore)


def push(key: int) -> None:
    """Make the setting behind ``key`` this thread's setting for its device (None: no setting)."""
    device_type, setting = _tokens[key]
    state = _state.get()
    if setting is None:
        state.active.pop(device_type, None)
    else:
        state.active[device_type] = setting
        _state.hold(state)
