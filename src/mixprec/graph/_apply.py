"""``apply_policy``: rewrite an aten-level FX GraphModule by an autocast policy.

Algorithm::

    new graph; for each node of gm, in order (gm itself is never touched):
        args = the new nodes of its inputs, each carrying a fake value (meta["val"])
        if node calls an ATen op the policy lists:
            lower_precision_fp / fp32 -> args' eligible tensors via Casts.to(dtype or float32)
            promote                   -> to the widest eligible input dtype (real dtypes, no guess)
            fp32_set_opt_dtype / fp32_append_dtype -> dtype=float32 (on the overload that takes it)
            banned                    -> RuntimeError naming the user's source line
        copy the node; compute its fake value from its new inputs

Eligible tensors are as in eager autocast: floating point, not float64, on
``device_type`` (any device if None). Dtypes come from the fake values, so a
cat of two bfloat16 tensors stays bfloat16: nothing is cast conservatively.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mixprec import _errors
from mixprec.engine import _devices
from mixprec.graph._casts import Casts, dtype_of, is_cast
from mixprec.policies import Category, Policy

_float32 = torch.float32
_LOW = (torch.bfloat16, torch.float16)


def cast_nodes(gm: fx.GraphModule) -> int:
    """How many dtype casts (``_to_copy`` / ``to.dtype`` / ``convert_element_type``) ``gm`` holds."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(
            _errors.message("cast_nodes argument 'gm' has the wrong type", "it counts the casts of an FX graph",
                            received={"gm": gm}, expected="a torch.fx.GraphModule")
        )
    return sum(1 for n in gm.graph.nodes if is_cast(n))


def apply_policy(
    gm: fx.GraphModule, policy: Policy, dtype: torch.dtype, *, device_type: str | None = None
) -> fx.GraphModule:
    """A copy of ``gm`` whose ops run in the dtypes ``policy`` gives them.

    Args:
        gm: An aten-level graph with fake values in ``meta["val"]``, as
            ``torch.export.export(...).module()`` or ``make_fx`` produce. Keep
            composite ops (export's default IR does), since policies name them.
        policy: e.g. ``mixprec.policies.CPU``.
        dtype: The lower-precision dtype.
        device_type: Only tensors on this device are cast; None casts on any device.

    Returns:
        A new GraphModule sharing gm's parameters; gm is not mutated.

    Examples:
        >>> model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
        >>> ep = torch.export.export(model, (x,))
        >>> low = mixprec.graph.apply_policy(ep.module(), mixprec.policies.CPU, torch.bfloat16)
        >>> low(x).dtype  # as model(x) under mixprec.autocast("cpu")
        torch.bfloat16
    """
    _check(gm, policy, dtype, device_type)
    fake_mode = _fake_mode(gm)
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    casts = Casts(graph, fake_mode)
    rewrite = _Rewrite(policy, dtype, device_type, casts)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            new = rewrite.call(node, pytree.tree_map_only(fx.Node, env.__getitem__, (node.args, node.kwargs)))
        else:
            new = graph.node_copy(node, env.__getitem__)
            if node.op in ("placeholder", "get_attr"):
                val = node.meta["val"] if "val" in node.meta else _attr(gm, node.target)
                new.meta["val"] = _refake(fake_mode, val)
            elif node.op == "call_function":
                new.meta["val"] = _fake_call(fake_mode, node.target, new.args, new.kwargs, node)
        env[node] = new
    return fx.GraphModule(gm, graph)


class _Rewrite:
    def __init__(self, policy: Policy, dtype: torch.dtype, device_type: str | None, casts: Casts) -> None:
        self.policy, self.dtype, self.device_type, self.casts = policy, dtype, device_type, casts

    def eligible(self, value: Any) -> bool:
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        return (
            isinstance(val, torch.Tensor)
            and val.is_floating_point()
            and val.dtype is not torch.float64
            and (self.device_type is None or val.device.type == self.device_type)
        )

    def cast_all(self, tree: Any, dtype: torch.dtype) -> Any:
        return pytree.tree_map_only(fx.Node, lambda n: self.casts.to(n, dtype) if self.eligible(n) else n, tree)

    def call(self, node: fx.Node, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> fx.Node:
        args, kwargs = inputs
        target: Any = node.target
        category = self.policy.category(target)
        explicit = kwargs.get("dtype") is not None or kwargs.get("out") is not None
        tensors = [n for n in pytree.tree_leaves((args, kwargs)) if self.eligible(n)]
        if category is not None and not explicit and tensors:
            target, args, kwargs = self._apply(Category(category), node, target, args, kwargs, tensors)
        new = self.casts.graph.call_function(target, args, kwargs)
        new.meta = {**node.meta}
        new.meta["val"] = _fake_call(self.casts.fake_mode, target, args, kwargs, node)
        return new

    def _apply(
        self, category: Category, node: fx.Node, target: Any, args: Any, kwargs: Any, tensors: list[fx.Node]
    ) -> Any:
        if category is Category.LOWER_PRECISION_FP:
            return target, *self.cast_all((args, kwargs), self.dtype)
        if category is Category.FP32:
            return target, *self.cast_all((args, kwargs), _float32)
        if category is Category.PROMOTE:
            return target, *self.cast_all((args, kwargs), _widest(tensors, node))
        if category is Category.BANNED:
            raise RuntimeError(f"{self.policy.advice(self.policy._banned_names[target])}{_where(node)}")
        first = args[0] if args else None
        if not (isinstance(first, fx.Node) and self.eligible(first)):
            return target, args, kwargs
        return _with_fp32_dtype(target, args, kwargs, node)


def _widest(tensors: list[fx.Node], node: fx.Node) -> torch.dtype:
    dtypes = {dtype_of(t) for t in tensors}
    if _float32 in dtypes:
        return _float32
    if len(dtypes) > 1:
        raise RuntimeError(
            _errors.message(
                "autocast promote",
                "inputs mix lower-precision dtypes, and autocast promotes only between float32 and one "
                "lower-precision dtype",
                received={"dtypes": sorted(str(d) for d in dtypes)},
                fix=f"Cast the inputs to one dtype before the call.{_where(node)}",
            )
        )
    return dtypes.pop()  # type: ignore[return-value]


def _with_fp32_dtype(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], node: fx.Node) -> Any:
    """The overload that takes ``dtype`` (itself, or its sibling that appends it), called with float32."""
    arguments = target._schema.arguments
    names = [a.name for a in arguments]
    values = {**dict(zip(names, args, strict=False)), **kwargs}
    values.update((a.name, a.default_value) for a in arguments if a.name not in values and a.has_default_value())
    if "dtype" not in names:
        packet = target.overloadpacket
        siblings = (getattr(packet, o) for o in packet.overloads())
        found = next((o for o in siblings if [a.name for a in o._schema.arguments] == [*names, "dtype"]), None)
        if found is None:
            raise RuntimeError(f"autocast: {packet} has no overload that takes dtype to run in float32.{_where(node)}")
        target = found
    values["dtype"] = _float32
    positional = tuple(values.pop(a.name) for a in target._schema.arguments if not a.kwarg_only)
    return target, positional, values


def _fake_call(fake_mode: Any, target: Callable[..., Any], args: Any, kwargs: Any, node: fx.Node) -> Any:
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
    try:
        with fake_mode:
            return target(*vals[0], **vals[1])
    except Exception:  # a higher-order op or a node fake tensors cannot run: keep what the trace recorded
        return node.meta.get("val")


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace")
    if not trace:
        return f" (graph node {node.name})"
    last = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    return f" (graph node {node.name}, from {last[-1] if last else trace.strip()})"


def _refake(fake_mode: Any, val: Any) -> Any:
    """``val`` as a fake tensor of ``fake_mode`` (export records parameters and inputs in different modes)."""
    if not isinstance(val, torch.Tensor):
        return val
    with fake_mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _fake_mode(gm: fx.GraphModule) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if any(v is None for v in vals):
        raise ValueError(
            _errors.message(
                "apply_policy needs dtypes",
                "its placeholders carry no meta['val']",
                fix="Trace the graph with torch.export.export or make_fx, which record them.",
            )
        )
    return FakeTensorMode(allow_non_fake_inputs=True)


def _attr(gm: fx.GraphModule, target: Any) -> torch.Tensor:
    obj: Any = gm
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _check(gm: object, policy: object, dtype: object, device_type: object) -> None:
    if device_type is not None:
        _devices.spec(device_type)
    for name, value, kind in (("gm", gm, fx.GraphModule), ("policy", policy, Policy), ("dtype", dtype, torch.dtype)):
        if not isinstance(value, kind):
            raise TypeError(
                _errors.message(
                    f"apply_policy argument {name!r} has the wrong type",
                    f"it must be a {kind.__module__}.{kind.__qualname__}",
                    received={name: value},
                    fix="Pass torch.export.export(model, args).module() or a make_fx graph." if name == "gm" else None,
                )
            )
    if dtype not in _LOW:
        raise ValueError(
            _errors.message("apply_policy argument 'dtype' is invalid", "it is the lower-precision dtype",
                            received={"dtype": dtype}, expected=[_devices.dtype_name(d) for d in _LOW])
        )
