"""The numerics doctor's engine: compare, find the first inf/NaN, suggest and check a fix.

Algorithm::

    reference = run(target) in float32                       # recorded op by op
    amp       = run(target) under mixprec.autocast(device, dtype, policy)
    rows      = compare(reference, amp)                        # errors, overflow, non-finite per op
    first     = first row that turned finite values into inf/NaN
    for path in first.module, its parents ..., the root:       # innermost first
        with mixprec.set_module_policy(model.<path>, "fp32"): # the suggestion
            if run(target) under autocast has no more inf/NaN than float32's: suggest it; stop
    an op of loss_fn's own (module "(loss_fn)"): the loss in float32, autocast off, is the suggestion
"""

from __future__ import annotations

import contextlib
import dataclasses
import keyword
from collections.abc import Iterator
from typing import Any

import torch

import mixprec
from mixprec import _errors
from mixprec._untouched import untouched
from mixprec.diagnostics._compare import (
    LOSS,
    OpReport,
    Target,
    autocast_region,
    check_target,
    compare,
    first_nonfinite,
    module_source,
    run_once,
)
from mixprec.engine import _devices

SCHEMA = "mixprec.doctor/1"


@dataclasses.dataclass
class Suggestion:
    """A policy change, as code, and whether re-running with it removed every inf/NaN."""

    code: str
    module: str
    fixes: bool
    nonfinite_after: int


@dataclasses.dataclass
class Diagnosis:
    """What ``mixprec doctor`` reports; ``to_json`` gives the documented schema."""

    device: str
    dtype: torch.dtype
    policy: str
    has_loss: bool
    rows: list[OpReport]
    nonfinite_reference: int
    nonfinite_autocast: int
    first: OpReport | None
    suggestion: Suggestion | None

    def worst(self, count: int = 10) -> list[OpReport]:
        """The ``count`` worst rows: inf/NaN first, then overflow/underflow, then relative error."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise (ValueError if isinstance(count, int) and not isinstance(count, bool) else TypeError)(
                _errors.message("Diagnosis.worst: count is invalid", "it is how many rows to return",
                                received={"count": count}, expected="an int >= 0")
            )
        return sorted(self.rows, key=OpReport.badness, reverse=True)[:count]

    def to_json(self, target: str) -> dict[str, Any]:
        if not isinstance(target, str):
            raise TypeError(
                _errors.message("Diagnosis.to_json: target is invalid", "it names what was diagnosed",
                                received={"target": target}, expected="a str such as 'path/to/file.py:build'")
            )
        first = self.first
        return {
            "schema": SCHEMA,
            "target": target,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "policy": self.policy,
            "backward": self.has_loss,
            "nonfinite": {"float32": self.nonfinite_reference, "autocast": self.nonfinite_autocast},
            "first_nonfinite": None
            if first is None
            else {"op": first.op, "module": first.module, "source": first.source, "index": first.index},
            "suggestion": None if self.suggestion is None else dataclasses.asdict(self.suggestion),
            "worst": [r.index for r in self.worst()],
            "ops": [dataclasses.asdict(r) for r in self.rows],
        }


def _ancestors(path: str) -> Iterator[str]:
    while path:
        yield path
        path = path.rpartition(".")[0]
    yield ""


def _code(model: torch.nn.Module, path: str) -> str:
    """Python that reaches the module: ``model.decoder[0]`` for ``decoder.0`` (an index into a list-like
    container), ``model.blocks["attn-1"]`` for a ``ModuleDict`` key, ``model.get_submodule(...)`` where a name
    is no attribute Python can spell (``class``, ``attn-1`` outside a ModuleDict)."""
    access, module = "", model
    for part in path.split(".") if path else ():
        child = module.get_submodule(part)
        if part.isidentifier() and not keyword.iskeyword(part) and getattr(module, part, None) is child:
            access += f".{part}"
        elif isinstance(module, torch.nn.ModuleDict):
            access += f"[{part!r}]"
        elif part.isdigit() and isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)):
            access += f"[{part}]"
        else:
            access = f".get_submodule({path!r})"
            break
        module = child
    return f'mixprec.set_module_policy(model{access}, "fp32")'


def _float_loss(target: Target, device: str) -> Target:
    """``target`` with its loss computed in float32: autocast off, the output's floating tensors cast up."""
    loss_fn = target[2]

    def loss_in_float32(output: Any) -> Any:
        up = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, output
        )
        with torch.autocast(device, enabled=False):
            return loss_fn(up)  # type: ignore[misc]

    return (target[0], target[1], loss_in_float32)


def _suggest(target: Target, first: OpReport, region: Any, device: str, floor: int) -> Suggestion:
    """The suggestion for ``first``; it fixes the run if its re-run leaves no more inf/NaN than ``floor``, the
    float32 run's (a NaN sample in the inputs stays under any policy)."""
    model = target[0]
    if first.module == LOSS:  # (no module policy reaches loss_fn's own ops)
        after = run_once(_float_loss(target, device), region(), record=False).nonfinite
        code = f'with torch.autocast("{device}", enabled=False): loss = loss_fn(output.float())'
        return Suggestion(code, LOSS, after <= floor, after)
    tried = []
    for path in _ancestors(first.module):
        with mixprec.set_module_policy(model.get_submodule(path), "fp32"):
            after = run_once(target, region(), record=False).nonfinite
        tried.append(Suggestion(_code(model, path), path, after <= floor, after))
        if after <= floor:
            break
    return tried[-1]  # the first that fixes it, else the root's (autocast off for the whole model)


def diagnose(target: Target, device: str, dtype: torch.dtype, policy: mixprec.Policy | None = None) -> Diagnosis:
    """Run ``target`` in float32 and under autocast and report op by op.

    Args:
        target: ``(model, example_inputs, loss_fn or None)``; inputs are passed as ``model(*inputs)``
            and ``loss_fn(output)`` must return a scalar.
        device: The autocast device type.
        dtype: The low-precision dtype.
        policy: The policy to run under (default: the device's).

    Examples:
        >>> model, x = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4)
        >>> d = diagnose((model, (x,), None), "cpu", torch.float16)
        >>> d.first is None  # no op made an inf or NaN
        True
    """
    check_target("diagnose", target)
    _devices.check_dtype("diagnose", device, dtype)
    if policy is not None and not isinstance(policy, mixprec.Policy):
        raise TypeError(
            _errors.message("diagnose: policy is invalid", "it is the policy to run under",
                            received={"policy": policy}, expected="a mixprec.Policy or None")
        )
    model = target[0]

    def region() -> mixprec.autocast:
        return autocast_region(device, dtype, policy)

    with untouched(model, target[1]):  # (its runs move no buffer, gradient, generator or amax history)
        reference = run_once(target, contextlib.nullcontext())
        amp = run_once(target, region())
        rows = compare(reference, amp, dtype)
        for row in rows:
            if row.phase == "backward":
                row.source = module_source(model, row.module)
        first = first_nonfinite(rows)
        # where float32 makes as many (no op made one that float32 did not), no module policy can fix it
        blameless = first is not None and not first.produced_nonfinite and amp.nonfinite <= reference.nonfinite
        suggestion = None
        if first is not None and not blameless:
            suggestion = _suggest(target, first, region, device, reference.nonfinite)
    name = policy.name if policy is not None else _devices.spec(device).policy
    return Diagnosis(device, dtype, name, target[2] is not None, rows, reference.nonfinite, amp.nonfinite, first,
                     suggestion)  # fmt: skip

