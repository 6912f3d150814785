"""The loss-scale update rule, on device tensors, with no host sync.

With ``hysteresis == 1`` and no bounds this is exactly torch's rule and runs
torch's fused kernel ``torch._amp_update_scale_`` (which leaves the hysteresis
tracker alone: with hysteresis 1 its value makes no difference). Otherwise it is Megatron-LM's
DynamicGradScaler rule::

    if found_inf:
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:
            scale = min(max(scale * backoff_factor, min_scale), scale)     # never up
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_tracker = hysteresis
            if isfinite(scale * growth_factor):
                scale = max(min(scale * growth_factor, max_scale), scale)  # never down

Megatron lets ``hysteresis_tracker`` go negative; stopping it at 0 gives the
same scales and keeps the int32 tracker from wrapping. ``max_scale`` and the
``isfinite`` guard (torch's) are mixprec's additions to Megatron's rule. A bound
stops a move but never reverses it: a scale already past one (set by
``update(new_scale)`` or a loaded state) stays put rather than jump back to it
the wrong way, an overflow never raises the scale and a growth step never lowers it.

Products are formed in float64 and rounded to float32, as torch's kernel does
(``float * double``), so that the two paths agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mixprec import _errors


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def check_within(self, name: str, value: float) -> None:
        """Raise mixprec's ValueError unless ``value`` (a starting scale) lies within the bounds."""
        low = 0.0 if self.min_scale is None else self.min_scale
        high = math.inf if self.max_scale is None else self.max_scale
        if not low <= value <= high:
            raise ValueError(
                _errors.message(
                    f"GradScaler argument {name!r} is out of bounds",
                    "the scale starts there and min_scale and max_scale bound it",
                    received={name: value},
                    expected=f"a value within [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
                )
            )

    @property
    def is_torch_rule(self) -> bool:
        return self.hysteresis == 1 and self.min_scale is None and self.max_scale is None

    def apply(
        self,
        scale: torch.Tensor,
        growth_tracker: torch.Tensor,
        hysteresis_tracker: torch.Tensor,
        found_inf: torch.Tensor,
    ) -> None:
        """Update ``scale``, ``growth_tracker`` and ``hysteresis_tracker`` in place."""
        if self.is_torch_rule:
            torch._amp_update_scale_(
                scale, growth_tracker, found_inf, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            return
        found = found_inf > 0
        hysteresis_left = torch.where(found, (hysteresis_tracker - 1).clamp(min=0), hysteresis_tracker)
        backed_off = (scale.double() * self.backoff_factor).float()
        if self.min_scale is not None:
            backed_off = torch.minimum(torch.clamp(backed_off, min=self.min_scale), scale)
        successful = growth_tracker + 1
        grow = ~found & (successful == self.growth_interval)
        grown = (scale.double() * self.growth_factor).float()
        grown_ok = torch.isfinite(grown)
        if self.max_scale is not None:
            grown = torch.maximum(torch.clamp(grown, max=self.max_scale), scale)
        new_scale = torch.where(found & (hysteresis_left <= 0), backed_off, scale)
        new_scale = torch.where(grow & grown_ok, grown, new_scale)
        new_growth = torch.where(found | grow, torch.zeros_like(successful), successful)
        new_hysteresis = torch.where(grow, torch.full_like(hysteresis_left, self.hysteresis), hysteresis_left)
        scale.copy_(new_scale)
        growth_tracker.copy_(new_growth)
        hysteresis_tracker.copy_(new_hysteresis)
