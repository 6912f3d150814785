"""Cast nodes: recognising them, and inserting them with no chains and no round trips.

Algorithm for ``Casts.to(node, dtype)``::

    while node is a lossless widening cast of src (bf16->f32, f16->f32, ...):
        node = src                            # a cast of a widened copy equals a cast of its source
    if node's dtype is dtype: return node     # also removes cast / cast-back pairs
    return cache.setdefault((node, dtype), new _to_copy(node, dtype=dtype))

A widened copy represents its source exactly, so casting the source instead
gives the same bits; narrowing casts round, so they are never skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

_WIDER = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def cast_source(node: fx.Node) -> fx.Node | None:
    """The input of ``node`` if it is a pure dtype cast (``_to_copy``/``to``/``convert_element_type``)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    target = node.target
    if target is aten._to_copy.default:
        return node.args[0] if set(node.kwargs) <= {"dtype"} and len(node.args) == 1 else None
    if target in (aten.to.dtype, torch.ops.prims.convert_element_type.default):
        return node.args[0]
    return None


def is_cast(node: fx.Node) -> bool:
    return cast_source(node) is not None


def dtype_of(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class Casts:
    """Inserts ``aten._to_copy`` casts into ``graph``, one per (tensor, dtype)."""

    def __init__(self, graph: fx.Graph, fake_mode: Any) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    def to(self, node: fx.Node, dtype: torch.dtype) -> fx.Node:
        """``node`` as ``dtype``: itself, an existing cast, or one new cast node."""
        source = cast_source(node)
        while source is not None and dtype_of(node) in _WIDER.get(dtype_of(source), ()):  # type: ignore[arg-type]
            node, source = source, cast_source(source)
        if dtype_of(node) is dtype:
            return node
        key = (node, dtype)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self.graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
            with self.fake_mode:
                hit.meta["val"] = node.meta["val"].to(dtype)
        return hit
