"""The formats an op can run in: the targets of the categories (``_category.TREATMENTS``).

A format says which dtype a category's casts aim at: the region's
lower-precision dtype (``"region"``: bfloat16 or float16, whichever the region
was entered with), ``"float32"``, ``"float16"`` (whatever the region's dtype: torch's
cuDNN RNN kernel), and the two fp8 formats that an fp8 recipe
quantises to (``"float8_e4m3fn"`` for inputs and weights, ``"float8_e5m2"``
for gradients, by default: ``_recipe.Fp8Recipe``). A new format is one entry
in ``FORMATS``; a category that runs in it names it as its target (see
``docs/design.md``, "How fp8 plugs in").
"""

from __future__ import annotations

import dataclasses

import torch

from mixprec import _errors


@dataclasses.dataclass(frozen=True)
class Format:
    """One target format.

    Attributes:
        name: The format's name, as categories name their target.
        dtype: The dtype it stores in, or None for ``"region"``: the region's lower-precision dtype.
        cached: Whether the casts of weights to it are kept for the region (torch's cast cache keeps the
            lower-precision casts, not the float32 ones).
    """

    name: str
    dtype: torch.dtype | None
    cached: bool

    def resolve(self, region_dtype: torch.dtype) -> torch.dtype:
        """The dtype this format means in a region of ``region_dtype``."""
        return region_dtype if self.dtype is None else self.dtype


REGION = "region"
FLOAT32 = "float32"
FLOAT16 = "float16"
E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"
#: The formats an fp8 recipe may quantise to.
FP8_FORMATS = (E4M3, E5M2)

#: Every format a category can target, by name.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(REGION, None, cached=True),
        Format(FLOAT32, torch.float32, cached=False),
        # (torch's one float16-whatever-the-region kernel, cuDNN's RNN, flattens its weights afresh each call and
        # caches a cast only where float16 is the region's dtype: uncached is the same values, never another
        # dtype's cast)
        Format(FLOAT16, torch.float16, cached=False),
        Format(E4M3, torch.float8_e4m3fn, cached=False),  # (fp8 keeps its own weight casts: engine._fp8)
        Format(E5M2, torch.float8_e5m2, cached=False),
    )
}


def format_of(name: object) -> Format:
    """The format called ``name``, with mixprec's error for anything else."""
    found = FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise (ValueError if isinstance(name, str) else TypeError)(
            _errors.message(
                "Unknown format",
                "a category targets one of mixprec's formats",
                received={"format": name},
                expected=list(FORMATS),
            )
        )
    return found
