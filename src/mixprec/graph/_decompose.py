"""What a decomposition ``apply_policy`` follows depends on.

``signature`` is everything a call's decomposition depends on, so that the pass traces a call that reaches no
op with a category once per graph (keyed on the op and its tensors' dtypes alone, an elementwise ``einsum``
kept a later matrix-product ``einsum`` whole).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree


def signature(target: Any, args: Any, kwargs: Any) -> Hashable | None:
    """What a call's decomposition depends on: the op, its non-tensor arguments, and its tensors' dtypes,
    devices, sizes and strides; None where an argument has no hashable form (the call is then not cached)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [target, str(spec)]
    for leaf in leaves:
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf
        if isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.device, _sizes(value.shape), _sizes(value.stride()),
                          value.requires_grad))
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            parts.append(("sym", str(value)))
        else:
            parts.append(value)
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _sizes(sizes: Any) -> tuple[Any, ...]:
    return tuple(str(s) if isinstance(s, torch.SymInt) else s for s in sizes)
