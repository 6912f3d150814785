"""fp8 scaling recipes: how an op that runs in fp8 scales its tensors before the cast, as policy data.

A recipe is a frozen value a policy carries; ``engine._fp8`` carries it out. Its fields:

* ``scaling``: ``"tensorwise"`` (one scale per tensor, from this call's amax: the default), ``"rowwise"``
  (one scale per row of each GEMM operand along the contracted dimension, from this call's amaxes) or
  ``"delayed"`` (one scale per tensor, from the largest amax of the last ``history`` steps);
* ``power_of_2``: round each scale down to a power of two (the cast then changes no mantissa bits);
* ``history``: the steps of amax history a delayed recipe keeps;
* ``eps``: the smallest amax a scale is computed from (an all-zero tensor gets a finite scale);
* ``forward``: the format inputs and weights are quantised to; ``backward``: the format incoming gradients
  are quantised to (``_format.FP8_FORMATS``);
* ``use_fast_accum``: the forward GEMM accumulates in the tensor cores' own accumulator, without the periodic
  promotion to float32 (``torch._scaled_mm``'s ``use_fast_accum``: faster on Hopper, less precise over a long
  contracted dimension); the gradients' GEMMs always promote. A GPU matter: the CPU's product is float32.

The scale of a tensor ``t`` is ``finfo(format).max / max(amax(t), eps)``; the scaled values are clamped to
``±finfo(format).max`` before the cast, since an overflowing cast saturates in e4m3 but gives inf in e5m2.
"""

from __future__ import annotations

import dataclasses
import math

from mixprec import _errors
from mixprec.policies._format import E4M3, E5M2, FP8_FORMATS

SCALINGS = ("tensorwise", "rowwise", "delayed")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an fp8 op scales its tensors (see the module)."""

    scaling: str = "tensorwise"
    power_of_2: bool = False
    history: int = 16
    eps: float = 1e-12
    forward: str = E4M3
    backward: str = E5M2
    use_fast_accum: bool = False

    def __post_init__(self) -> None:
        def refuse(field: str, value: object, expected: object) -> None:
            raise ValueError(
                _errors.message(
                    f"Fp8Recipe {field} is invalid",
                    "a recipe is policy data that every fp8 op scales by",
                    received={field: value},
                    expected=expected,  # type: ignore[arg-type]
                )
            )

        if self.scaling not in SCALINGS:
            refuse("scaling", self.scaling, list(SCALINGS))
        for flag in ("power_of_2", "use_fast_accum"):
            if type(getattr(self, flag)) is not bool:
                refuse(flag, getattr(self, flag), "True or False")
        if type(self.history) is not int or self.history < 1:
            refuse("history", self.history, "an int of at least 1")
        if not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not 0 < self.eps < math.inf:
            refuse("eps", self.eps, "a positive finite float")
        if self.eps > _FLOAT32_MAX:  # (the scale is computed in float32)
            refuse("eps", self.eps, f"a positive float at most float32's largest, {_FLOAT32_MAX:.6g}")
        for field in ("forward", "backward"):
            if getattr(self, field) not in FP8_FORMATS:
                refuse(field, getattr(self, field), list(FP8_FORMATS))
        if self.forward == E5M2:  # the gradient GEMMs would multiply two e5m2 operands, which CUDA refuses
            refuse("forward", self.forward, f"{E4M3!r} (an fp8 GEMM takes at most one e5m2 operand)")
        # the largest scale, finfo(format).max / eps, must be a finite float32 (a zero tensor's scale)
        smallest = max(_FLOAT8_MAX[f] for f in (self.forward, self.backward)) / _FLOAT32_MAX
        if self.eps < smallest:
            refuse("eps", self.eps, f"at least {smallest:.3g}, so that finfo(format).max / eps is a finite float32")


#: Each format's largest value, and float32's (no tensor is made at import).
_FLOAT8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_FLOAT32_MAX = 3.4028234663852886e38

#: The default recipe: tensorwise dynamic scaling, e4m3 forward, e5m2 gradients.
TENSORWISE = Fp8Recipe()
