"""GradScaler's settings and persistence: validated factors, getters and setters,
``state_dict`` / ``load_state_dict``, and pickling.

Kept apart from the per-iteration state machine in ``_grad_scaler``; GradScaler
inherits these methods from :class:`ScalerSettings`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
from collections.abc import Mapping
from typing import Any

import torch

from mixprec import _errors
from mixprec.engine import _devices
from mixprec.scaler._rule import ScaleRule

ORDER = "Call scaler.scale(loss).backward(), then unscale_(optimizer) (optional), step(optimizer), update()."


class ScalerStateError(RuntimeError, AssertionError):
    """A GradScaler method was called out of order.

    Subclasses AssertionError too, so code written against torch's GradScaler
    (which asserts in some of these cases) still catches it.
    """


_DEVICE_EXPECTED = (
    "a device type such as 'cpu', 'cuda' or 'xpu', with or without an index ('cuda:0'), or a torch.device"
)


def device_type(device: object) -> str:
    """The device type of ``device``, in any form torch.amp.GradScaler takes: ``"cuda"``, ``"cuda:0"``,
    ``torch.device("cuda", 0)`` all give ``"cuda"`` (the scale is made on the device of the first tensor
    scaled, so an index says nothing more)."""
    if isinstance(device, torch.device):
        return device.type
    if not isinstance(device, str):
        raise TypeError(
            _errors.message("GradScaler device is invalid", "it must be a device string or a torch.device",
                            received={"device": device}, expected=_DEVICE_EXPECTED)
        )
    try:
        return torch.device(device).type
    except RuntimeError:
        raise ValueError(
            _errors.message("GradScaler device is invalid", "it is not a device torch knows",
                            received={"device": device}, expected=_DEVICE_EXPECTED)
        ) from None


def device_available(device_type: str) -> bool:
    """Whether the device type is present on this machine, as mixprec's device table says; a type the table
    does not list (``"meta"``, a private backend) is taken to be, as torch takes every type but CUDA."""
    found = _devices.DEVICES.get(device_type)
    return found is None or found.available()


def check_enabled(value: Any) -> bool:
    """``enabled`` as a bool: True or False, or an int read by its truth as torch reads it (argparse's
    ``type=int`` gives 1 or 0). Anything else is refused: torch would read the string "False" as True."""
    if isinstance(value, bool):
        return value
    try:
        return bool(operator.index(value))
    except TypeError:
        raise TypeError(
            _errors.message("GradScaler enabled is invalid", "it must be a bool or an int",
                            received={"enabled": value}, expected="True or False (or 1 or 0)")
        ) from None


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, value: object, ok: bool, expected: str, *, integral: bool = False) -> None:
    """Raise TypeError for a non-number (or non-int), ValueError for a number out of range."""
    if not (isinstance(value, int) and not isinstance(value, bool) if integral else _is_real(value)):
        raise TypeError(
            _errors.message(
                f"GradScaler {name} is invalid", "it has the wrong type", received={name: value}, expected=expected
            )
        )
    if not ok:
        raise ValueError(
            _errors.message(
                f"GradScaler {name} is invalid", "it is out of range", received={name: value}, expected=expected
            )
        )


def check_growth_factor(value: Any) -> None:
    _check("growth_factor", value, _is_real(value) and value > 1.0, "a float > 1.0")


def check_backoff_factor(value: Any) -> None:
    _check("backoff_factor", value, _is_real(value) and 0.0 < value < 1.0, "a float in (0, 1)")


def check_growth_interval(value: Any) -> None:
    _check("growth_interval", value, _is_real(value) and value > 0, "an int > 0", integral=True)


def check_init_scale(value: Any, name: str = "init_scale") -> None:
    _check(name, value, _is_real(value) and 0 < value < math.inf, "a finite float > 0")


def check_loaded_scale(value: Any) -> None:
    """A saved scale: any a scaler reaches, 0.0 (backed off past float32's smallest, a diverged run) and inf
    (``update(new_scale=inf)``) included, as torch.amp.GradScaler loads them."""
    _check("scale", value, _is_real(value) and value >= 0, "a float >= 0 (0.0 and inf are states a scaler reaches)")


def make_rule(
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    hysteresis: Any = 1,
    min_scale: Any = None,
    max_scale: Any = None,
) -> ScaleRule:
    """A :class:`ScaleRule` from user-given values, each checked (TypeError / ValueError naming it)."""
    check_growth_factor(growth_factor)
    check_backoff_factor(backoff_factor)
    check_growth_interval(growth_interval)
    _check("hysteresis", hysteresis, _is_real(hysteresis) and hysteresis >= 1, "an int >= 1", integral=True)
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None:
            _check(name, bound, _is_real(bound) and bound > 0 and not math.isnan(bound), "None or a float > 0")
    if min_scale is not None and max_scale is not None:
        _check("min_scale", min_scale, min_scale <= max_scale, f"min_scale <= max_scale (max_scale={max_scale})")
    return ScaleRule(
        float(growth_factor),
        float(backoff_factor),
        growth_interval,
        hysteresis,
        None if min_scale is None else float(min_scale),
        None if max_scale is None else float(max_scale),
    )


#: The keys torch.amp.GradScaler saves, which load_state_dict needs.
_REQUIRED = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_state_dict(state_dict: object) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            _errors.message("GradScaler.load_state_dict: state_dict is invalid", "it must be a mapping",
                            received={"state_dict": state_dict}, expected="a dict from GradScaler.state_dict()")
        )
    if not state_dict:
        raise RuntimeError(
            _errors.message(
                "GradScaler.load_state_dict: the source state dict is empty",
                "it was possibly saved from a disabled instance of GradScaler",
                received={"state_dict": state_dict},
                expected="the keys " + ", ".join(_REQUIRED),
            )
        )
    missing = [key for key in _REQUIRED if key not in state_dict]
    if missing:
        raise ValueError(
            _errors.message("GradScaler.load_state_dict: state_dict is incomplete", "it lacks keys GradScaler saves",
                            received={"missing": missing}, expected="the keys " + ", ".join(_REQUIRED))
        )


def _number(value: object) -> object:
    """The Python number of a 0-dim tensor or a numpy scalar (torch's load_state_dict takes them, e.g. from a
    checkpoint written by other code); any other value as given, to be checked as it is."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.dim() == 0 else value
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only if numpy is imported (mixprec never imports it)
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    return value


class ScalerSettings:
    """Getters, setters, state_dict and pickling for :class:`~mixprec.GradScaler`."""

    _enabled: bool
    _rule: ScaleRule
    _init_scale: float
    _init_growth_tracker: int
    _init_hysteresis_tracker: int
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _hysteresis_tracker: torch.Tensor | None
    _per_optimizer_states: dict[int, Any]

    def get_scale(self) -> float:
        """The current scale as a Python float (syncs), or 1.0 if disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._rule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        check_growth_factor(new_factor)
        self._rule = dataclasses.replace(self._rule, growth_factor=float(new_factor))

    def get_backoff_factor(self) -> float:
        return self._rule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        check_backoff_factor(new_factor)
        self._rule = dataclasses.replace(self._rule, backoff_factor=float(new_factor))

    def get_growth_interval(self) -> int:
        return self._rule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        check_growth_interval(new_interval)
        self._rule = dataclasses.replace(self._rule, growth_interval=new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def _get_hysteresis_tracker(self) -> int:
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Every field needed to resume, trackers included; empty if disabled.

        torch.amp.GradScaler's five keys, plus ``hysteresis``, ``min_scale``,
        ``max_scale`` and ``_hysteresis_tracker`` (which torch ignores on load).
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._rule.growth_factor,
            "backoff_factor": self._rule.backoff_factor,
            "growth_interval": self._rule.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._rule.hysteresis,
            "min_scale": self._rule.min_scale,
            "max_scale": self._rule.max_scale,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, or one saved by torch.amp.GradScaler.

        Keys torch does not save (``hysteresis``, ``min_scale``, ``max_scale``)
        keep this scaler's values when absent. A value may be a Python number,
        a 0-dim tensor or a numpy scalar, as torch allows.
        """
        if not self._enabled:
            return
        _check_state_dict(state_dict)
        state: dict[str, Any] = {key: _number(value) for key, value in state_dict.items()}
        rule = self._rule
        rule = make_rule(  # every value is checked before anything is loaded
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
            state.get("hysteresis", rule.hysteresis),
            state.get("min_scale", rule.min_scale),
            state.get("max_scale", rule.max_scale),
        )
        check_loaded_scale(state["scale"])
        for key in ("_growth_tracker", "_hysteresis_tracker"):
            value = state.get(key, 0)
            _check(key, value, _is_real(value) and value >= 0, "an int >= 0", integral=True)
        self._rule = rule
        self._init_scale = float(state["scale"])
        self._init_growth_tracker = int(state["_growth_tracker"])
        self._init_hysteresis_tracker = int(state.get("_hysteresis_tracker", self._rule.hysteresis))
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(self._init_growth_tracker)
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer_states:
                raise ScalerStateError(
                    "A GradScaler may only be pickled at the beginning of an iteration, or at the end after "
                    "scaler.update(): it holds per-optimizer state mid-iteration."
                )
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_scale"] = state["_growth_tracker"] = state["_hysteresis_tracker"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
