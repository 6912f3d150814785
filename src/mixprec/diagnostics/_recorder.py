"""A per-op recorder: which op ran, where, in which dtypes, and with what values.

The recorder is a ``TorchFunctionMode`` entered *before* (below) an autocast
region, so it sees each call after autocast has cast its inputs, and it sees the
casts themselves (calls made from ``mixprec._cast``). Module forward pre/post
hooks keep a stack of module paths (as in ``named_modules``); the source line is
the first Python frame outside torch and mixprec.

Algorithm for each call ``func(*args, **kwargs)``::

    out = func(*args, **kwargs)                     # the mode is off inside: no recursion
    if the caller is mixprec's cast helper:          # an autocast cast
        pending.casts += 1; pending.created += new non-finite values
    elif out holds a floating tensor:
        append OpRecord(op, module stack top, user frame, dtypes, pending casts, non-finite counts)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten

import mixprec

_MIXPREC_DIR = os.path.dirname(os.path.abspath(mixprec.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DIAGNOSTICS_DIR = os.path.join(_MIXPREC_DIR, "diagnostics") + os.sep
_TORCH_DISPATCH = os.path.join(_TORCH_DIR, "overrides.py")
_CAST_FILE = os.path.join(_MIXPREC_DIR, "_cast.py")
_CAST_METHODS = frozenset({"to", "bfloat16", "half", "float"})  # what mixprec._cast.to calls
_SKIP = frozenset({"__get__", "__set__", "dim", "size", "numel", "stride", "is_floating_point", "item", "tolist"})


@dataclasses.dataclass
class OpRecord:
    """One recorded call. ``output`` (the first floating output) is kept only for comparison."""

    index: int
    op: str
    module: str
    source: str
    input_dtypes: list[str]
    output_dtypes: list[str]
    casts: int
    cast_nonfinite: int  # non-finite values created by the casts feeding this op
    nonfinite_inputs: int
    nonfinite_outputs: int
    key: tuple[str, str, int]
    output: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def produced_nonfinite(self) -> bool:
        """Whether this op (or a cast feeding it) turned finite values into inf/NaN."""
        return self.nonfinite_outputs > 0 and self.nonfinite_inputs - self.cast_nonfinite <= 0


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def nonfinite(tensors: list[torch.Tensor]) -> int:
    """The number of inf/NaN values in the floating tensors."""
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors if t.is_floating_point())


def user_source() -> str:
    """``file:line`` of the innermost frame outside torch and mixprec (the user's line).

    A model made only of torch modules has no such frame before the doctor's own
    call; then the innermost torch frame (a module's ``forward``) is the answer.
    """
    frame = sys._getframe(1)
    innermost_torch = None
    while frame is not None:
        raw = frame.f_code.co_filename
        name = raw if raw.startswith("<") else os.path.abspath(raw)
        if name.startswith(_MIXPREC_DIR):
            if name.startswith(_DIAGNOSTICS_DIR) and innermost_torch is not None:
                return innermost_torch
        elif name.startswith(_TORCH_DIR):
            if innermost_torch is None and not name.startswith(_TORCH_DISPATCH):
                innermost_torch = f"{name}:{frame.f_lineno}"
        elif not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return innermost_torch or "<unknown>"


def op_name(func: Any) -> str:
    """A readable name: ``torch.matmul``, ``torch.nn.functional.linear``, ``torch.Tensor.mul``."""
    try:
        name = resolve_name(func)
    except Exception:
        name = None
    return name or getattr(func, "__qualname__", None) or repr(func)


class Recorder(TorchFunctionMode):
    """Records every torch call with a floating output while active.

    Args:
        model: The module whose ``named_modules`` give the module paths.
        keep_outputs: Keep a float32 copy of each op's first floating output.

    Example:
        >>> with Recorder(model) as rec, mixprec.autocast("cpu", dtype=torch.float16):
        ...     model(x)
        >>> rec.records[0].op
        'torch.nn.functional.linear'
    """

    def __init__(self, model: torch.nn.Module, *, keep_outputs: bool = True) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self._model = model
        self._keep = keep_outputs
        self._stack: list[str] = []
        self._seen: Counter[tuple[str, str]] = Counter()
        self._pending_casts = 0
        self._pending_created = 0
        self._handles: list[Any] = []

    def __enter__(self) -> Recorder:
        for name, module in self._model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        super().__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _push(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in _SKIP:
            return out
        outputs = [t for t in _tensors(out) if t.is_floating_point()]
        if not outputs:
            return out
        inputs = _tensors((args, kwargs))
        if os.path.abspath(sys._getframe(1).f_code.co_filename) == _CAST_FILE:
            self._pending_casts += 1
            self._pending_created += max(0, nonfinite(outputs) - nonfinite(inputs))
            return out
        self._record(func, inputs, outputs)
        return out

    def _record(self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        name = op_name(func)
        module = self._stack[-1] if self._stack else ""
        occurrence = self._seen[(module, name)]
        self._seen[(module, name)] += 1
        kept = outputs[0].detach().to(torch.float32, copy=True) if self._keep else None
        self.records.append(
            OpRecord(
                index=len(self.records),
                op=name,
                module=module,
                source=user_source(),
                input_dtypes=[_dtype_name(t) for t in inputs],
                output_dtypes=[_dtype_name(t) for t in outputs],
                casts=self._pending_casts,
                cast_nonfinite=self._pending_created,
                nonfinite_inputs=nonfinite(inputs),
                nonfinite_outputs=nonfinite(outputs),
                key=(module, name, occurrence),
                output=kept,
            )
        )
        self._pending_casts = self._pending_created = 0


class CastCounter(TorchFunctionMode):
    """Counts the casts autocast makes while active (enter it before the autocast region)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
        if getattr(func, "__name__", "") in _CAST_METHODS and caller == _CAST_FILE:
            self.casts += 1
        return func(*args, **(kwargs or {}))
