"""The fp8 nodes ``apply_policy`` writes: a call of an ``fp8`` category's op, run as the eager kernels run it.

A node calls ``scaled_call(op, args, kwargs, device_type, dtype, recipe)``: the engine's ``_rules.run_scaled``,
which runs the call's three GEMMs in fp8 under the recipe (``engine._fp8``: quantisation as plain torch ops, the
GEMMs through ``torch._scaled_mm``, a weight quantised once per region) with its output in ``dtype``, or casts it
to ``dtype`` where fp8 cannot run it. Deciding when the node runs, as the kernels decide per call, keeps a graph
with a dynamic dimension equal to eager: a batch that is not a multiple of 16 falls back there as it does here.
The recipe travels as its fields (a dict of plain values), so the graph's code prints as Python that runs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from mixprec.engine import _fp8 as engine_fp8
from mixprec.engine import _rules
from mixprec.policies._recipe import Fp8Recipe

#: fp8's size rule: every GEMM dimension a multiple of this.
ALIGNMENT = engine_fp8.ALIGNMENT


def recipe_fields(recipe: Fp8Recipe) -> dict[str, Any]:
    """What a node carries of ``recipe``."""
    return dataclasses.asdict(recipe)


def fits(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> bool:
    """Whether fp8 can run a call of these (fake) values: ``engine._fp8.fit``, as the kernels ask it."""
    return not isinstance(engine_fp8.fit(op, args, kwargs, device_type), str)


def scaled_call(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    dtype: torch.dtype,
    recipe: dict[str, Any],
) -> Any:
    """``op(*args, **kwargs)`` as an op of an fp8 category runs it in a region of ``dtype`` on ``device_type``
    under the recipe with these fields. Autocast is off for the call, as below an autocast kernel: a graph run
    inside a region would otherwise cast what stands for ``_scaled_mm`` on CPU, or the fallback's op, again.
    Outside any region the call is a region of its own: it keeps no weight's quantisation past it, so a weight
    changed between calls in a way its version counter does not see (through ``.data``) is quantised afresh."""
    off = torch.is_autocast_enabled(device_type)
    try:
        with torch.autocast(device_type, enabled=False) if off else contextlib.nullcontext():
            return _rules.run_scaled(op, device_type, dtype, Fp8Recipe(**recipe), args, kwargs, cached=False)
    finally:
        if not off:
            engine_fp8.clear_weight_cache()
