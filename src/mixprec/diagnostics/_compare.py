"""Runs a model in float32 and under autocast, and compares the two op by op.

Ops are matched by ``(module path, op name, occurrence in that module)``, so an
op that runs only in one of the runs (a composite autocast expands, a cast) is
reported without an error figure rather than compared with the wrong op.

Per op (``OpReport``): ``max_abs_error`` = max |autocast - float32| over the
positions where both are finite; ``max_rel_error`` = that over max |float32|
(normwise); ``overflow_fraction`` / ``underflow_fraction`` = the fraction of the
float32 reference values that become inf / flush to zero when held in the
low-precision dtype (only for ops whose autocast output is in that dtype).
With a loss, each parameter's gradient gets a row too (phase "backward", op
"grad", the module owning the parameter, the module's ``forward`` as source).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import mixprec
from mixprec.diagnostics._recorder import OpRecord, Recorder, nonfinite
from mixprec.engine import _devices


@dataclasses.dataclass
class OpReport:
    """One row of the doctor's table (see docs/doctor.md for the JSON schema)."""

    index: int
    phase: str
    op: str
    module: str
    source: str
    input_dtypes: list[str]
    output_dtypes: list[str]
    casts: int
    max_abs_error: float | None
    max_rel_error: float | None
    overflow_fraction: float | None
    underflow_fraction: float | None
    nonfinite_inputs: int
    nonfinite_outputs: int
    produced_nonfinite: bool
    fp8_format: str | None = None  # where the op ran its GEMM in fp8: the format, and (Fp8Stats) ...
    fp8_amax: float | None = None  # ... the largest magnitude of its input, and of its weight,
    fp8_amax_weight: float | None = None
    fp8_saturated: float | None = None  # the fraction of their values clamped at the format's largest value,
    fp8_flushed: float | None = None  # the fraction flushed to zero,
    fp8_error: float | None = None  # the GEMM's relative error against float32 on a sample of rows
    fp8_grad_format: str | None = None  # its backward: the incoming gradient's format, largest magnitude,
    fp8_grad_amax: float | None = None  # and the fractions of its values saturated and flushed to zero
    fp8_grad_saturated: float | None = None
    fp8_grad_flushed: float | None = None

    def badness(self) -> tuple[int, float, float]:
        """Sort key, worst first when reversed: produced inf/NaN, then overflow/underflow, then error."""
        lost = (self.overflow_fraction or 0.0) + (self.underflow_fraction or 0.0)
        rel = self.max_rel_error if self.max_rel_error is not None else 0.0
        return (int(self.produced_nonfinite) + int(self.nonfinite_outputs > 0), lost, rel)


@dataclasses.dataclass
class Run:
    """One pass: the recorded ops, the outputs' non-finite count and the parameters' gradients."""

    records: list[OpRecord]
    nonfinite: int
    grads: dict[str, torch.Tensor]


Target = tuple[torch.nn.Module, tuple[Any, ...], Callable[..., Any] | None]

#: The module of the ops ``loss_fn`` runs itself (outside the model's modules).
LOSS = "(loss_fn)"


def check_target(where: str, target: object) -> None:
    """TypeError unless ``target`` is ``(model, example_inputs, loss_fn or None)``."""
    if not (
        isinstance(target, tuple)
        and len(target) == 3
        and isinstance(target[0], torch.nn.Module)
        and isinstance(target[1], tuple)
        and (target[2] is None or callable(target[2]))
    ):
        raise TypeError(
            mixprec._errors.message(
                f"{where}: target is invalid",
                "it is the model, its positional inputs and a loss function (or None)",
                received={"target": target},
                expected="a tuple (torch.nn.Module, tuple of inputs, callable or None)",
            )
        )


def run_once(target: Target, region: contextlib.AbstractContextManager[Any], record: bool = True) -> Run:
    """Forward (and backward with a loss) inside ``region``; the recorder sits below it."""
    check_target("run_once", target)
    if not (hasattr(region, "__enter__") and hasattr(region, "__exit__")):
        raise TypeError(
            mixprec._errors.message(
                "run_once: region is invalid",
                "the model runs inside it",
                received={"region": region},
                expected="a context manager such as mixprec.autocast(...)",
            )
        )
    if not isinstance(record, bool):
        raise TypeError(
            mixprec._errors.message("run_once: record is invalid", "it says whether to record the ops",
                                    received={"record": record}, expected="True or False")
        )
    model, inputs, loss_fn = target
    model.zero_grad(set_to_none=True)
    recorder = Recorder(model) if record else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), recorder, region:
        torch.manual_seed(0)  # the same dropout masks in every run
        output = model(*inputs)
        with recorder._outside(LOSS) if isinstance(recorder, Recorder) else contextlib.nullcontext():
            loss = loss_fn(output) if loss_fn is not None else None
    order: list[str] = []  # the parameters in the order backward finished their gradients
    if loss is not None:
        hooks = [
            p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
            for name, p in model.named_parameters() if p.requires_grad
        ]  # fmt: skip
        try:
            with recorder.gradients() if isinstance(recorder, Recorder) else contextlib.nullcontext():
                loss.float().backward()
        finally:
            for hook in hooks:
                hook.remove()
    bad = nonfinite([t for t in torch.utils._pytree.tree_flatten(output)[0] if isinstance(t, torch.Tensor)])
    if isinstance(loss, torch.Tensor):  # (an inf loss from finite outputs: loss_fn overflowed, no layer did)
        bad += nonfinite([loss])
    params = dict(model.named_parameters())
    ranks = {name: i for i, name in enumerate(dict.fromkeys(order))}  # (rows in execution order: backward's)
    names = sorted((n for n, p in params.items() if p.grad is not None), key=lambda n: ranks.get(n, len(ranks)))
    grads = {n: params[n].grad.detach().float().clone() for n in names}  # type: ignore[union-attr]
    bad += nonfinite(list(grads.values()))
    records = recorder.records if isinstance(recorder, Recorder) else []
    return Run(records, bad, grads)


def _error_of(got: torch.Tensor, ref: torch.Tensor | None) -> tuple[float | None, float | None]:
    if ref is None or ref.shape != got.shape:
        return None, None
    got, ref = (t.float() if t.element_size() == 1 else t for t in (got, ref))  # (fp8 has no isfinite)
    both = torch.isfinite(got) & torch.isfinite(ref)
    if not bool(both.any()):
        return None, None
    diff = float((got[both] - ref[both]).abs().max())
    scale = float(ref[both].abs().max())
    return diff, diff / scale if scale > 0 else None


def _new_nonfinite(got: torch.Tensor, ref: torch.Tensor | None) -> bool:
    """Whether ``got`` holds inf/NaN where float32's ``ref`` holds a finite value."""
    if ref is None or ref.shape != got.shape:
        return False
    got, ref = (t.float() if t.element_size() == 1 else t for t in (got, ref))  # (fp8 has no isfinite)
    return bool((~torch.isfinite(got) & torch.isfinite(ref)).any())


def _lost(ref: torch.Tensor | None, low: torch.dtype) -> tuple[float | None, float | None]:
    if ref is None or ref.numel() == 0:
        return None, None
    held = ref.to(low)
    overflow = (torch.isfinite(ref) & torch.isinf(held)).float().mean()
    underflow = ((ref != 0) & (held == 0)).float().mean()
    return float(overflow), float(underflow)


def compare(reference: Run, amp: Run, low: torch.dtype) -> list[OpReport]:
    """One OpReport per op of the autocast run, then one per parameter gradient."""
    for name, value in (("reference", reference), ("amp", amp)):
        if not isinstance(value, Run):
            raise TypeError(
                mixprec._errors.message(f"compare: {name} is invalid", "it is what run_once returned",
                                        received={name: value}, expected="a mixprec.diagnostics.Run")
            )
    if low not in _devices.LOW_PRECISION:
        raise (ValueError if isinstance(low, torch.dtype) else TypeError)(
            mixprec._errors.message("compare: low is invalid", "it is the autocast run's low-precision dtype",
                                    received={"low": low},
                                    expected=[_devices.dtype_name(d) for d in _devices.LOW_PRECISION])
        )
    by_key = {r.key: r.output for r in reference.records}
    float32_made = {r.key for r in reference.records if r.produced_nonfinite}  # (not autocast's doing there)
    narrow = {str(d).removeprefix("torch."): d for d in _devices.LOW_PRECISION}
    rows = []
    located = False  # whether a row made inf/NaN where float32's same op made none: the first such made them
    for rec in amp.records:
        ref = by_key.get(rec.key)
        got = rec.output if rec.output is not None else torch.empty(0)
        abs_err, rel_err = _error_of(got, ref)
        # (measured in the dtype the op returned: the run's, or float16 from an fp16-category op in a bf16 run)
        held = narrow.get(rec.output_dtypes[0]) if rec.output_dtypes else None
        over, under = _lost(ref, held) if held is not None else (None, None)
        row = OpReport(
            rec.index, "forward", rec.op, rec.module, rec.source, rec.input_dtypes, rec.output_dtypes,
            rec.casts, abs_err, rel_err, over, under, rec.nonfinite_inputs, rec.nonfinite_outputs,
            rec.produced_nonfinite and rec.key not in float32_made,
        )  # fmt: skip
        if not located and rec.nonfinite_outputs and _new_nonfinite(got, ref):
            # (inputs that hold inf/NaN in both runs, a NaN sample, hide an overflow from the count alone)
            row.produced_nonfinite = located = True
        located = located or row.produced_nonfinite
        stats = rec.fp8
        if stats is not None:
            row.fp8_format, row.fp8_amax, row.fp8_amax_weight = stats.format, stats.amax_input, stats.amax_weight
            row.fp8_saturated, row.fp8_flushed, row.fp8_error = stats.saturated, stats.flushed, stats.sampled_error
            row.fp8_grad_format, row.fp8_grad_amax = stats.grad_format, stats.grad_amax
            row.fp8_grad_saturated, row.fp8_grad_flushed = stats.grad_saturated, stats.grad_flushed
        rows.append(row)
    # (clean: no op held more inf/NaN than in float32; a -inf attention mask float32 holds too is no overflow)
    float32_held = {r.key: r.nonfinite_outputs for r in reference.records}
    forward_clean = all(rec.nonfinite_outputs <= float32_held.get(rec.key, 0) for rec in amp.records)
    return rows + list(_grad_rows(reference, amp, len(rows), forward_clean))


def _grad_rows(reference: Run, amp: Run, start: int, forward_clean: bool) -> Iterator[OpReport]:
    """A gradient row 'produced' inf/NaN only if it holds more than float32's and the forward held no more than
    float32's (else it inherited them)."""
    for i, (name, grad) in enumerate(amp.grads.items()):
        module = name.rpartition(".")[0]
        ref = reference.grads.get(name)
        abs_err, rel_err = _error_of(grad, ref)
        bad = nonfinite([grad])
        extra = bad > (nonfinite([ref]) if ref is not None else 0)
        yield OpReport(
            start + i, "backward", f"grad of {name}", module, "", ["float32"], ["float32"], 0,
            abs_err, rel_err, None, None, 0, bad, extra and forward_clean,
        )  # fmt: skip


def module_source(model: torch.nn.Module, path: str) -> str:
    """``file:line`` of the ``forward`` of the module at ``path``."""
    forward = type(model.get_submodule(path)).forward
    try:
        _, start = inspect.getsourcelines(forward)
        return f"{os.path.abspath(inspect.getsourcefile(forward) or '?')}:{start}"
    except (OSError, TypeError):
        return "<unknown>"


def first_nonfinite(rows: list[OpReport]) -> OpReport | None:
    """The first row, in execution order, that produced inf/NaN (else the first holding any)."""
    produced = next((r for r in rows if r.produced_nonfinite), None)
    return produced or next((r for r in rows if r.nonfinite_outputs > 0), None)


def autocast_region(device: str, dtype: torch.dtype, policy: mixprec.Policy | None) -> mixprec.autocast:
    """The doctor's region: ``compute="native"``, so that its numbers are native autocast's.

    Emulated compute gives the same dtypes and overflows alike (the output is rounded
    to the low-precision dtype), but its float32 accumulation would hide the
    low-precision kernels' own rounding from the comparison with float32.
    """
    return mixprec.autocast(device, dtype=dtype, policy=policy, compute="native")
