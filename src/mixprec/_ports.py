"""Python ports of C++ composites, so that the listed ops inside them are autocast.

Native autocast sits in the dispatcher, below C++ composites such as
``aten::pad``, and so casts the ops they reach. The interception mode sits
above them and sees only the composite. Where a composite reaches a listed op
on some paths only, it cannot be given one category; its port runs the same
inner ops, op for op, as the C++ source does, and the mode intercepts each.

A port is used as the composite's twin (see ``mixprec._expand``): it runs with
the mode pushed, and a call it makes back to the composite itself (for the
error paths) runs natively.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_KINDS = {"reflect": "reflection_pad", "replicate": "replication_pad", "circular": None}


def pad(input: torch.Tensor, pad: Any, mode: str = "constant", value: float | None = None) -> torch.Tensor:
    """``aten::pad`` (aten/src/ATen/native/PadNd.cpp).

    Algorithm::

        constant                       -> constant_pad_nd(input, pad, value or 0)
        reflect/replicate/circular with len(pad) == 2k (k = 1, 2, 3) and input.dim() in (k + 1, k + 2)
                                       -> reflection_padkd / replication_padkd / _pad_circular
        anything else                  -> aten::pad itself, which raises ATen's error
    """
    if mode == "constant":
        return torch.constant_pad_nd(input, pad, 0.0 if value is None else value)
    k = len(pad) // 2
    if mode in _KINDS and (value is None or value == 0) and len(pad) in (2, 4, 6) and input.dim() in (k + 1, k + 2):
        kind = _KINDS[mode]
        if kind is None:
            return torch._C._nn._pad_circular(input, pad)  # type: ignore[attr-defined]
        return getattr(torch._C._nn, f"{kind}{k}d")(input, pad)
    return torch._C._nn.pad(input, pad, mode, value)


@functools.cache
def ports() -> dict[Callable[..., Any], Callable[..., Any]]:
    """``{composite: port}``, built on first use (nothing happens at import time)."""
    return {torch._C._nn.pad: pad}
