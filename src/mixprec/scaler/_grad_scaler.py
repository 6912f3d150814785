"""GradScaler: dynamic loss scaling, used exactly like torch.amp.GradScaler.

Per iteration, for each optimizer::

    scaler.scale(loss).backward()
    scaler.unscale_(opt)        # optional: grads /= scale, found_inf |= any non-finite grad
    scaler.step(opt)            # skipped if found_inf (agreed across ranks)
    scaler.update()             # back off on inf, grow every growth_interval finite steps

Each optimizer moves READY -> UNSCALED -> STEPPED; ``update`` returns all to READY.
Calls out of that order raise :class:`ScalerStateError` naming the order.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from mixprec import _errors
from mixprec.scaler._history import History, ScaleRecord
from mixprec.scaler._rule import ScaleRule
from mixprec.scaler._settings import (
    ORDER,
    ScalerSettings,
    ScalerStateError,
    check_enabled,
    check_init_scale,
    device_available,
    device_type,
    make_rule,
)
from mixprec.scaler._unscale import check_optimizer, has_grads, unscale_grads

__all__ = ["GradScaler", "ScaleRecord", "ScalerStateError"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _OptimizerState:
    stage: _Stage = _Stage.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = dataclasses.field(default_factory=dict)


class GradScaler(ScalerSettings):
    """Dynamic loss scaling for float16 training; torch.amp.GradScaler's API plus
    Megatron-style ``hysteresis``, ``min_scale`` and ``max_scale``.

    Args:
        device: Device type of the gradients: "cuda", "cpu", ..., or a device such as "cuda:0" or
            ``torch.device("cuda")`` (only its type counts: the scale is made on the first scaled tensor's device).
        init_scale: Initial scale factor.
        growth_factor: Scale multiplier after ``growth_interval`` finite steps (> 1).
        backoff_factor: Scale multiplier on an inf/NaN step (< 1).
        growth_interval: Consecutive finite steps before the scale grows.
        enabled: If False (or 0), every method is a pass-through and the other arguments are not checked, as
            in torch.
        hysteresis: Inf steps tolerated before backing off (1 = torch's behaviour).
        min_scale: The scale never backs off below this (``init_scale`` must not lie below it).
        max_scale: The scale never grows above this (``init_scale`` must not lie above it). A scale set past
            a bound by ``update(new_scale)`` or a loaded state stays there until a move in the bound's direction.
        allow_fp16_grads: Unscale float16 gradients instead of refusing them.
        process_group: Group over which ranks agree on found_inf (default: the
            default group when torch.distributed is initialized; False: never). The
            agreement is a collective: every rank of the group must step its scaler,
            so a scaler only some ranks use takes ``False`` or a group of those ranks.

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = mixprec.GradScaler("cpu")
        >>> optimizer.zero_grad()
        >>> with mixprec.autocast("cpu", dtype=torch.float16):
        ...     loss = model(torch.randn(2, 4)).float().sum()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(optimizer)
        >>> scaler.update()
        >>> scaler.last_step_skipped  # 2**16 times a gradient of 1 overflows float16 (max 65504)
        True
        >>> scaler.get_scale()  # so the step was skipped and the scale halved
        32768.0
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        allow_fp16_grads: bool = False,
        process_group: Any = None,
    ) -> None:
        device = device_type(device)
        enabled = check_enabled(enabled)
        if enabled:
            self._rule = make_rule(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
            check_init_scale(init_scale)
            self._rule.check_within("init_scale", init_scale)
            if not isinstance(allow_fp16_grads, bool):
                raise TypeError(
                    _errors.message("GradScaler allow_fp16_grads is invalid", "it must be a bool",
                                    received={"allow_fp16_grads": allow_fp16_grads}, expected="True or False")
                )
            init_scale = float(init_scale)
        else:
            # As torch's: a disabled scaler passes everything through and checks no setting (a run without loss
            # scaling may hand it ones meant for none). They are kept as given, for the getters and repr.
            self._rule = ScaleRule(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        self._device = device
        self._enabled = enabled
        if enabled and not device_available(device):  # warned once every argument is known to be valid
            _errors.warn(
                _errors.message("GradScaler disabled", f"device {device!r} is not available on this machine"),
                _errors.AutocastDisabledWarning,
            )
            self._enabled = False
        self._init_scale = init_scale
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_tracker: torch.Tensor | None = None
        self._allow_fp16_grads = allow_fp16_grads
        self._process_group = process_group
        self._per_optimizer_states: defaultdict[int, _OptimizerState] = defaultdict(_OptimizerState)
        self._skipped_this_iteration: list[torch.Tensor | bool] = []
        self._last_step_skipped: torch.Tensor | bool | None = None
        self._history = History()

    # ----------------------------------------------------------------- scale
    def _lazy_init(self, device: torch.device) -> None:
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=device)

    def _require_scale(self, funcname: str) -> torch.Tensor:
        if self._scale is None:
            raise ScalerStateError(f"GradScaler.{funcname}() called before scale(): there is no scale yet. {ORDER}")
        return self._scale

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or nested lists/tuples/dicts of tensors) by the scale."""
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale is None:
                    self._lazy_init(value.device)
                assert self._scale is not None  # set just above
                scale = per_device.get(value.device)
                if scale is None:
                    scale = per_device[value.device] = self._scale.to(device=value.device, non_blocking=True)
                return value * scale
            if isinstance(value, dict):
                return {k: apply(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                items = [apply(v) for v in value]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
                return map(apply, value)
            raise ValueError(
                _errors.message(
                    "GradScaler.scale() cannot scale this value",
                    "outputs must be a tensor or nested lists/tuples/dicts of tensors",
                    received={"outputs": value},
                )
            )

        return apply(outputs)

    # --------------------------------------------------------------- unscale
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale the optimizer's grads (torch's method of that name, which sharded scalers override)."""
        return unscale_grads(optimizer, inv_scale, found_inf, allow_fp16, self._process_group)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (at most once per step), recording inf/NaN."""
        check_optimizer("unscale_", optimizer, self._enabled)
        if not self._enabled:
            return
        scale = self._require_scale("unscale_")
        state = self._per_optimizer_states.get(id(optimizer)) or _OptimizerState()  # kept only if unscaling works
        if state.stage is _Stage.UNSCALED:
            raise ScalerStateError(
                f"unscale_() has already been called on this optimizer since the last update(). {ORDER}"
            )
        if state.stage is _Stage.STEPPED:
            raise ScalerStateError(f"unscale_() is being called after step(). {ORDER}")
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state.found_inf_per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, self._allow_fp16_grads)
        state.stage = _Stage.UNSCALED
        self._per_optimizer_states[id(optimizer)] = state

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step`` unless an inf/NaN was found.

        Returns what ``optimizer.step`` returned, or None if the step was skipped;
        :attr:`last_step_skipped` tells which.
        """
        check_optimizer("step", optimizer, self._enabled)
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                _errors.message(
                    "Closure use is not currently supported if GradScaler is enabled",
                    "the loss must be scaled before backward, which a closure runs inside step()",
                    received={"closure": kwargs["closure"]},
                    fix="Call scaler.scale(loss).backward() yourself, then scaler.step(optimizer) without a closure.",
                )
            )
        scale = self._require_scale("step")
        state = self._per_optimizer_states.get(id(optimizer))
        if state is not None and state.stage is _Stage.STEPPED:
            raise ScalerStateError(f"step() has already been called since the last update(). {ORDER}")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, self._per_optimizer_states[id(optimizer)], scale, args, kwargs)
        if state is None or state.stage is _Stage.READY:
            self.unscale_(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
        if not state.found_inf_per_device:
            raise ScalerStateError(
                "step() found no inf checks recorded for this optimizer: none of its parameters has a gradient. "
                f"{ORDER}"
            )
        found = sum(v.item() for v in state.found_inf_per_device.values())
        skipped = bool(found)
        retval = None if skipped else optimizer.step(*args, **kwargs)
        state.stage = _Stage.STEPPED
        self._skipped_this_iteration.append(skipped)
        return retval

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, scale: torch.Tensor, args: Any, kwargs: Any
    ) -> Any:
        """Optimizers that unscale and skip inside their own kernels get grad_scale and found_inf."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            return self._step_passing_self(optimizer, state, scale, args, kwargs)
        if state.stage is _Stage.READY:
            self._check_inf_per_device(optimizer)
        if not state.found_inf_per_device and has_grads(optimizer):
            # unscale_() saw no grads, but some appeared since: they were never checked (torch fails
            # inside the optimizer's kernel on the int found_inf below).
            raise ScalerStateError(
                "step() found no inf checks recorded for this optimizer, but it has gradients now: they were "
                f"produced after unscale_(). {ORDER}"
            )
        # sum() of no tensors is the int 0, as in torch (an optimizer without grads, whose step does nothing).
        found_inf = _found_inf_sum(state, scale.device)
        previous = getattr(optimizer, "grad_scale", None)
        # Already unscaled: keep the user's grad_scale (if any); otherwise hand over the product.
        grad_scale = previous if state.stage is _Stage.UNSCALED else scale * (1 if previous is None else previous)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        state.stage = _Stage.STEPPED
        self._skipped_this_iteration.append(found_inf > 0)  # stays on device: no sync
        return retval

    def _step_passing_self(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, scale: torch.Tensor, args: Any, kwargs: Any
    ) -> Any:
        """torch's older contract (apex's fused optimizers): ``optimizer.step(grad_scaler=self)`` calls
        :meth:`_check_inf_per_device` and :meth:`_get_scale_async`, unscales by itself and skips its own update
        if a flag is set. The flags it recorded (or unscale_() did) tell whether the step was skipped; an
        optimizer that checked nothing leaves that unknown, and update() then reads no check from it."""
        warnings.warn(
            "GradScaler passes itself to optimizer.step(grad_scaler=...) for this optimizer; that contract is "
            "deprecated in torch in favour of the grad_scale / found_inf attributes.",
            FutureWarning,
            stacklevel=4,
        )
        kwargs["grad_scaler"] = self
        retval = optimizer.step(*args, **kwargs)
        state.stage = _Stage.STEPPED
        if state.found_inf_per_device:
            self._skipped_this_iteration.append(_found_inf_sum(state, scale.device) > 0)  # on device: no sync
        return retval

    # ------------------------------------- torch's hooks for optimizers that unscale themselves (apex's)
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Check the optimizer's gradients for inf/NaN without unscaling them; record and return the flags,
        one per device, as torch's method of that name does. Ranks agree on them as in :meth:`unscale_`,
        and :meth:`update` reads them (hysteresis and the bounds apply as for any optimizer)."""
        scale = self._require_scale("_check_inf_per_device")
        dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        zero = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state.found_inf_per_device = self._unscale_grads_(optimizer, dummy_inv_scale, zero, True)
        return state.found_inf_per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """The flags recorded for the optimizer in this iteration (torch's method of that name)."""
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale as a device tensor, without a sync; None before the first scale() (as torch's)."""
        return self._scale

    # ---------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale: back off after an inf/NaN step, grow after enough finite ones.

        Args:
            new_scale: Set the scale to this float or one-element tensor instead.
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        assert self._growth_tracker is not None and self._hysteresis_tracker is not None  # made with the scale
        if new_scale is not None:
            if isinstance(new_scale, float):
                scale.fill_(new_scale)
            elif (
                isinstance(new_scale, torch.Tensor)
                and new_scale.numel() == 1
                and not new_scale.requires_grad
                and new_scale.device.type == self._device
            ):
                scale.copy_(new_scale.reshape(()))  # (a shape-[1] tensor too: one element is what counts)
            else:
                raise ValueError(
                    _errors.message(
                        "GradScaler.update(new_scale) is invalid",
                        f"new_scale must be a float or a one-element {self._device} tensor that does not require grad",
                        received={"new_scale": new_scale},
                    )
                )
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state.found_inf_per_device.values()
            ]
            if not found_infs:
                raise ScalerStateError(f"update() called with no inf checks recorded in this iteration. {ORDER}")
            found_inf_combined = found_infs[0]
            for other in found_infs[1:]:
                found_inf_combined = found_inf_combined + other
            self._rule.apply(scale, self._growth_tracker, self._hysteresis_tracker, found_inf_combined)
        skipped = self._skipped_this_iteration
        self._last_step_skipped = _any(skipped) if skipped else None
        self._history.append(scale, False if self._last_step_skipped is None else self._last_step_skipped)
        self._skipped_this_iteration = []
        self._per_optimizer_states = defaultdict(_OptimizerState)

    # ------------------------------------------------------- skipped steps, log
    @property
    def last_step_skipped(self) -> bool | None:
        """Whether the last iteration's ``step`` was skipped for inf/NaN gradients.

        Known after ``update()``; None before the first update (or when no step
        ran). Step an LR scheduler only when this is False::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped:
                scheduler.step()
        """
        value = self._last_step_skipped
        if isinstance(value, torch.Tensor):
            value = self._last_step_skipped = bool(value.item())
        return value

    @property
    def history(self) -> list[ScaleRecord]:
        """Every ``update()`` so far: step number, scale after it, whether its step was skipped."""
        return self._history.records()

    def scale_events(self) -> list[ScaleRecord]:
        """The updates that changed the scale or skipped a step: what a training log wants."""
        return self._history.events()

    def __repr__(self) -> str:
        return f"GradScaler(device={self._device!r}, enabled={self._enabled}, rule={self._rule})"


def _any(flags: list[torch.Tensor | bool]) -> torch.Tensor | bool:
    """Whether any flag is set; stays a device tensor (no sync) if any flag is one."""
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    plain = any(f for f in flags if not isinstance(f, torch.Tensor))
    if not tensors:
        return plain
    combined = torch.stack([t.reshape(()) for t in tensors]).any()
    return combined | plain


def _found_inf_sum(state: _OptimizerState, device: torch.device) -> torch.Tensor | int:
    """The optimizer's flags summed on ``device``; the int 0 if none was recorded (as sum() gives in torch)."""
    return sum(t.to(device, non_blocking=True) for t in state.found_inf_per_device.values())
