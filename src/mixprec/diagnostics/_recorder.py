"""A per-op recorder: which op ran, where, in which dtypes, and with what values.

The recorder is a ``TorchFunctionMode`` for the torch calls (the op's name,
module and source line, its outputs) with a ``TorchDispatchMode`` beside it
for what happens below autocast: autocast's casts are ``aten::_to_copy`` calls
made at the Autocast dispatch key (by torch's kernels or mixprec's), inside the
torch call whose inputs they cast. Module forward pre/post hooks keep a stack
of module paths (as in ``named_modules``); the source line is the first Python
frame outside torch and mixprec.

Algorithm for each torch call ``func(*args, **kwargs)`` with a floating output::

    out = func(*args, **kwargs)            # the dispatch mode counts the _to_copy calls inside,
                                           # unless func is itself a cast (Tensor.float, .to, ...)
    append OpRecord(op, module stack top, user frame, input dtypes after the casts,
                    casts, non-finite values the casts created, non-finite counts)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mixprec
from mixprec import _errors
from mixprec.engine import _emulate, _fp8

_MIXPREC_DIR = os.path.dirname(os.path.abspath(mixprec.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DIAGNOSTICS_DIR = os.path.join(_MIXPREC_DIR, "diagnostics") + os.sep
_TORCH_DISPATCH = os.path.join(_TORCH_DIR, "overrides.py")
_USER_CASTS = frozenset({"to", "bfloat16", "half", "float", "double", "type", "type_as"})  # casts by the user
_TO_COPY = torch.ops.aten._to_copy.default
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
    fp8: Fp8Stats | None = None  # set where the op ran its GEMM in fp8

    @property
    def produced_nonfinite(self) -> bool:
        """Whether this op (or a cast feeding it) turned finite values into inf/NaN."""
        return self.nonfinite_outputs > 0 and self.nonfinite_inputs - self.cast_nonfinite <= 0


@dataclasses.dataclass(frozen=True)
class Fp8Stats:
    """What an fp8 GEMM did to its operands (``fp8_stats``): the largest magnitude of the input and weight, the
    fraction of their values that saturated (beyond the format's largest value after scaling by more than half
    its ulp: the clamp changed their fp8 value) and that
    flushed to zero (non-zero, quantised to zero), and the GEMM's relative error against a float32 GEMM of the
    same operands, on a sample of up to ``SAMPLE_ROWS`` rows."""

    format: str
    amax_input: float
    amax_weight: float
    saturated: float
    flushed: float
    sampled_error: float | None
    grad_format: str | None = None  # from the call's backward, where it ran under the recorder: the gradient's
    grad_amax: float | None = None  # format, largest magnitude, and the fractions of its values saturated and
    grad_saturated: float | None = None  # flushed to zero by its quantisation
    grad_flushed: float | None = None


SAMPLE_ROWS = 64


def _lost_to_fp8(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """The fractions of the high-precision values (``(high, fp8, inverse scale)`` triples) that saturated (beyond
    the format's largest value after scaling by more than half its ulp: the clamp changed their fp8 value) and
    that flushed to zero."""
    counts, total = [0.0, 0.0], 0
    for high, low, inverse in pairs:
        info = torch.finfo(low.dtype)
        beyond = info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2  # max + half its ulp
        high = high.float()
        counts[0] += float((high.abs() / inverse > beyond).sum())
        counts[1] += float(((high != 0) & (low.float() == 0)).sum())
        total += high.numel()
    return counts[0] / max(total, 1), counts[1] / max(total, 1)


def fp8_stats(call: _fp8.Fp8Call) -> Fp8Stats:
    """The ``Fp8Stats`` of one fp8 linear's forward."""
    saturated, flushed = _lost_to_fp8([(call.x, call.xq, call.x_inverse_scale),
                                       (call.weight, call.wq, call.w_inverse_scale)])  # fmt: skip
    rows = torch.linspace(0, call.x.shape[0] - 1, min(SAMPLE_ROWS, call.x.shape[0])).long()
    exact = call.x[rows].float() @ call.weight.float().t()
    if call.bias is not None:
        exact = exact + call.bias.float()
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    error = float((call.out[rows].float() - exact).abs().max()) / scale if scale > 0 else None
    return Fp8Stats(
        str(call.xq.dtype).removeprefix("torch."), float(call.x.abs().max()), float(call.weight.abs().max()),
        saturated, flushed, error,
    )  # fmt: skip


def with_gradient(stats: Fp8Stats, grad: _fp8.Fp8Grad, merge: bool = False) -> Fp8Stats:
    """``stats`` with what its call's backward did to the incoming gradient; ``merge``: the worst of that and
    what ``stats`` holds from another GEMM's backward of the same op (``merged``)."""
    saturated, flushed = _lost_to_fp8([(grad.grad, grad.gq, grad.g_inverse_scale)])
    amax = float(grad.grad.abs().max())
    if merge and stats.grad_amax is not None and stats.grad_saturated is not None and stats.grad_flushed is not None:
        amax, saturated = max(amax, stats.grad_amax), max(saturated, stats.grad_saturated)
        flushed = max(flushed, stats.grad_flushed)
    return dataclasses.replace(
        stats, grad_format=str(grad.gq.dtype).removeprefix("torch."), grad_amax=amax,
        grad_saturated=saturated, grad_flushed=flushed,
    )  # fmt: skip


def merged(stats: list[Fp8Stats]) -> Fp8Stats:
    """One op's fp8 GEMMs as one row (``F.multi_head_attention_forward`` runs its projections inside): the
    largest magnitudes, and the worst fractions and error of any of them."""
    if len(stats) == 1:
        return stats[0]
    errors = [s.sampled_error for s in stats if s.sampled_error is not None]
    return Fp8Stats(
        "/".join(dict.fromkeys(s.format for s in stats)), max(s.amax_input for s in stats),
        max(s.amax_weight for s in stats), max(s.saturated for s in stats), max(s.flushed for s in stats),
        max(errors) if errors else None,
    )  # fmt: skip


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _is_weight(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter, as the cast cache keys them). A view made under no_grad of one
    that requires grad, then written in place (``weight[:, 0].clamp_(...)`` there), raises on ``is_leaf``: it is
    no leaf."""
    if not t.requires_grad:
        return False
    try:
        return t.is_leaf
    except RuntimeError:
        return False


def nonfinite(tensors: list[torch.Tensor]) -> int:
    """The number of inf/NaN values in the floating tensors (fp8 ones read as float32: torch has no isfinite
    for them)."""
    with torch.no_grad():  # (isfinite is composite: under grad mode its abs saves tensors, which a
        # non-reentrant checkpoint then counts against its recompute: CheckpointError)
        floating = [t.float() if t.element_size() == 1 else t for t in tensors if t.is_floating_point()]
        return sum(int((~torch.isfinite(t)).sum()) for t in floating)


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
    short = getattr(func, "__name__", None)
    if name and short and name.rsplit(".", 1)[-1] != short and getattr(torch, short, None) is func:
        name = f"torch.{short}"  # (torch names torch.mm "torch.spmm", an alias it maps to the same entry)
    return name or getattr(func, "__qualname__", None) or repr(func)


class _Casts(TorchDispatchMode):
    """Below autocast: counts ``aten::_to_copy`` calls and the non-finite values they create."""

    def __init__(self, measure: bool) -> None:
        super().__init__()
        self.measure = measure
        self.count = 0
        self.created = 0
        self.casts_of: dict[int, torch.dtype] = {}  # id of a cast tensor -> the dtype it was cast to
        self.user_cast = 0  # > 0 while a cast the user called runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is _TO_COPY and not self.user_cast and not _emulate.busy() and isinstance(out, torch.Tensor):
            self.count += 1
            self.casts_of[id(args[0])] = out.dtype
            if self.measure:
                self.created += max(0, nonfinite([out]) - nonfinite([args[0]]))
        return out


class _Tap(TorchFunctionMode):
    """A torch-function mode with a ``_Casts`` dispatch mode under it."""

    def __init__(self, measure: bool) -> None:
        super().__init__()
        self.below = _Casts(measure)

    def __enter__(self) -> Any:
        self.below.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        self.below.__exit__(*exc_info)

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        if getattr(func, "__name__", "") in _USER_CASTS:
            self.below.user_cast += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.below.user_cast -= 1
        return func(*args, **kwargs)


class Recorder(_Tap):
    """Records every torch call with a floating output while active.

    Args:
        model: The module whose ``named_modules`` give the module paths.
        keep_outputs: Keep a float32 copy of each op's first floating output.

    Examples:
        >>> model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
        >>> with Recorder(model) as rec, mixprec.autocast("cpu", dtype=torch.float16):
        ...     _ = model(x)
        >>> rec.records[0].op
        'torch.nn.functional.linear'
    """

    def __init__(self, model: torch.nn.Module, *, keep_outputs: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                _errors.message("Recorder: model is invalid", "the recorder names ops by its module paths",
                                received={"model": model}, expected="a torch.nn.Module")
            )
        if not isinstance(keep_outputs, bool):
            raise TypeError(
                _errors.message("Recorder: keep_outputs is invalid", "it says whether to keep each op's output",
                                received={"keep_outputs": keep_outputs}, expected="True or False")
            )
        super().__init__(measure=True)
        self.records: list[OpRecord] = []
        self._model = model
        self._keep = keep_outputs
        self._stack: list[str] = []
        self._seen: Counter[tuple[str, str]] = Counter()
        self._handles: list[Any] = []
        self._weights: dict[int, torch.dtype] = {}  # cached weight casts, as the cache reuses them
        self._fp8: list[tuple[object, Fp8Stats]] = []  # the fp8 GEMMs of the torch call being recorded
        self._by_token: dict[object, OpRecord] = {}  # an fp8 call's record, for its backward
        self._gemms: dict[int, int] = {}  # the fp8 GEMMs of a record that ran more than one, by id(record)

    def __enter__(self) -> Recorder:
        for name, module in self._model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(name)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        _fp8.observers.append(self._observe)
        super().__enter__()
        return self

    def _observe(self, seen: _fp8.Fp8Call | _fp8.Fp8Grad) -> None:
        if isinstance(seen, _fp8.Fp8Call):
            self._fp8.append((seen.token, fp8_stats(seen)))
            return
        record = self._by_token.get(seen.token)
        if record is not None and record.fp8 is not None:
            record.fp8 = with_gradient(record.fp8, seen, merge=self._gemms.get(id(record), 1) > 1)

    @contextlib.contextmanager
    def gradients(self) -> Iterator[None]:
        """While open (around ``backward()``), the fp8 calls recorded add what their backward did."""
        _fp8.observers.append(self._observe)
        try:
            yield
        finally:
            _fp8.observers.remove(self._observe)

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        if self._observe in _fp8.observers:
            _fp8.observers.remove(self._observe)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    @contextlib.contextmanager
    def _outside(self, label: str) -> Iterator[None]:
        """While open, ops that run outside every module of the model are recorded in module ``label`` (the
        doctor's ``"(loss_fn)"``), not in the model's ``""``."""
        self._stack.append(label)
        try:
            yield
        finally:
            self._stack.remove(label)

    def _push(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._stack.append(name)

        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        casts = self.below
        count, created = casts.count, casts.created
        casts.casts_of = {}
        self._fp8.clear()
        inputs = _tensors((args, kwargs))
        received = nonfinite(inputs)  # (before the call: an in-place op writes its inf into its input)
        out = self._call(func, args, kwargs)
        if getattr(func, "__name__", "") in _SKIP:
            return out
        outputs = [t for t in _tensors(out) if t.is_floating_point()]
        if out is None and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            outputs = [args[0]]  # (``h[i] = v``: __setitem__ returns None, and what it wrote is in h)
        if not outputs:
            return out
        self._record(func, inputs, outputs, casts.count - count, casts.created - created, received)
        return out

    def _input_dtype(self, t: torch.Tensor) -> str:
        """The dtype the op received ``t`` in: its cast in this call, or a cached weight's earlier cast."""
        cast = self.below.casts_of.get(id(t))
        if cast is not None:
            # (the cache keeps a weight's casts to the region's dtype only: a float32, float16-category or fp8 one
            # is made afresh at each use, and never stands for the cached one)
            if _is_weight(t) and cast == torch.get_autocast_dtype(t.device.type):
                self._weights[id(t)] = cast
            return str(cast).removeprefix("torch.")
        weight = _is_weight(t) and torch.is_autocast_enabled(t.device.type)
        cached = self._weights.get(id(t)) if weight else None
        return str(cached or t.dtype).removeprefix("torch.")

    def _record(
        self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], casts: int, created: int,
        received: int,
    ) -> None:
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
                input_dtypes=[self._input_dtype(t) for t in inputs],
                output_dtypes=[_dtype_name(t) for t in outputs],
                casts=casts,
                cast_nonfinite=created,
                nonfinite_inputs=received,
                nonfinite_outputs=nonfinite(outputs),
                key=(module, name, occurrence),
                output=kept,
                fp8=merged([stats for _, stats in self._fp8]) if self._fp8 else None,
            )
        )
        for token, _ in self._fp8:  # (every GEMM's backward adds to the op's row)
            self._by_token[token] = self.records[-1]
        if len(self._fp8) > 1:
            self._gemms[id(self.records[-1])] = len(self._fp8)
        self._fp8.clear()


class CastCounter(_Tap):
    """Counts the casts autocast makes while active (``aten::_to_copy`` calls not made by the user's own casts).

    Examples:
        >>> with CastCounter() as counter, mixprec.autocast("cpu"):
        ...     _ = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> counter.casts
        3
    """

    def __init__(self) -> None:
        super().__init__(measure=False)

    @property
    def casts(self) -> int:
        return self.below.count

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return self._call(func, args, kwargs or {})
