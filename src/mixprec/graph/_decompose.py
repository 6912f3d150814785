"""The decompositions ``apply_policy`` follows: an op with no category, whose CompositeImplicitAutograd kernel
eager autocast runs, casting the ops that kernel calls (``einsum`` -> ``bmm``).

Algorithm for ``trace(node, target, args, kwargs, run)``::

    no CompositeImplicitAutograd kernel, or the node's value is not one tensor: None (the op stays whole)
    sub = make_fx(that kernel, pre_dispatch) on the call's fake values (the rewritten graph's, so with the
          dtypes eager autocast gives them), under Casting(run): each ATen op the kernel reaches runs as
          ``run`` says (the policy's casts), so its meta function sees the dtypes it sees in eager autocast,
          and the trace records the call uncast (above the Python key), for the pass to rewrite
    a data-dependent size (argwhere: nonzero): traced again where such a size is a symbol (a ShapeEnv)
    a trace that fails: an error naming the op (the op left whole could run in other dtypes than eager's)
    constants of its own, or not one output: None

``signature`` is everything a call's decomposition depends on, so that the pass traces a call that reaches no
op with a category once per graph (keyed on the op and its tensors' dtypes alone, an elementwise ``einsum``
kept a later matrix-product ``einsum`` whole).

Casting sees the ops below the composites the kernel calls (``mm``, not ``matmul``), so where an op of the
kernel that the policy lists is itself a composite, the trace's values past it can differ from eager's; the
recorded graph does not, since the pass rewrites each of its nodes by its own category.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import _compat, _errors
from mixprec.engine import _tables


class Casting(TorchDispatchMode):
    """While a decomposition is traced: each op runs as ``run(op, args, kwargs)`` says, on fake values."""

    def __init__(self, run: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]) -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.run(func, tuple(args), dict(kwargs or {}))


def trace(
    node: fx.Node, target: Any, args: Any, kwargs: Any, run: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
) -> fx.GraphModule | None:
    """The graph of ``target``'s CompositeImplicitAutograd kernel on the call's inputs (nodes carrying fake
    values), traced as the module docstring says; None where the op stays whole."""
    if not isinstance(target, torch._ops.OpOverload) or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    if not _compat.has_kernel(_tables.qualified(target), "CompositeImplicitAutograd"):
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, fx.Node)]
    vals = [leaves[i].meta.get("val") for i in slots]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None

    def decomposed(*tensors: Any) -> Any:
        values = list(leaves)
        for i, tensor in zip(slots, tensors, strict=True):
            values[i] = tensor
        a, k = pytree.tree_unflatten(values, spec)
        with Casting(run):
            return _compat.call_at_key(target, "CompositeImplicitAutograd", a, k)

    from torch._subclasses import fake_tensor  # only for graphs that hold such an op
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        try:
            sub = make_fx(decomposed, pre_dispatch=True, tracing_mode="fake")(*vals)
        except (fake_tensor.DynamicOutputShapeException, fake_tensor.DataDependentOutputException):
            # A data-dependent size (argwhere: nonzero): trace again where such a size is a symbol.
            sub = make_fx(decomposed, pre_dispatch=True, tracing_mode="fake")(*_with_shape_env(vals))
    except Exception as error:
        raise RuntimeError(
            _errors.message(
                f"apply_policy cannot rewrite {target}",
                "it has no category, so eager autocast runs its CompositeImplicitAutograd kernel and casts the "
                "ops that kernel calls, but tracing that kernel on the graph's fake values failed "
                f"({type(error).__name__}: {' '.join(str(error).split())[:300]})",
                received={"inputs": [(v.dtype, tuple(v.shape)) for v in vals]},
                fix="Where the error is the op's own, the model fails under autocast too (run it in "
                "mixprec.autocast to see); otherwise please report it. apply_policy does not leave such an op "
                "whole: it could then run in other dtypes than under autocast.",
            )
            + where(node)
        ) from error
    if any(n.op == "get_attr" for n in sub.graph.nodes):
        return None
    outputs = [n for n in sub.graph.nodes if n.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0].args[0], fx.Node):
        return None
    return sub


def _with_shape_env(vals: list[torch.Tensor]) -> list[torch.Tensor]:
    """``vals`` as fake tensors of a new mode with a ShapeEnv, where a data-dependent size is a symbol."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]


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


def where(node: fx.Node) -> str:
    """`` (graph node n, from File "...", line N, in f)``: the node, and the user's line it came from."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return f" (graph node {node.name})"
    last = [
        line.strip()
        for line in trace.strip().splitlines()
        if line.strip().startswith("File ") and "<eval_with_key>" not in line  # not code torch generated
    ]
    return f" (graph node {node.name}, from {last[-1] if last else trace.strip()})"
