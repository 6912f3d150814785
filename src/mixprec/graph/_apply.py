"""``apply_policy``: rewrite an aten-level FX GraphModule by an autocast policy.

Algorithm::

    new graph; for each node of gm, in order (gm itself is never touched):
        args = the new nodes of its inputs, each carrying a fake value (meta["val"])
        if node calls an ATen op the policy lists:
            lower_precision_fp / fp32 -> args' eligible tensors via Casts.to(dtype or float32), a cast per use
                                         but a weight's shared where the format keeps it (``_plan.keeps_weights``)
            promote                   -> to the widest eligible input dtype (real dtypes, no guess)
            fp32_set_opt_dtype / fp32_append_dtype -> dtype=float32 (on the overload that takes it)
            banned                    -> RuntimeError naming the user's source line
            fp8 (scaled_mm)           -> where fp8 may run it (_fp8.fits, a symbolic size as 16), one node
                                         calling the kernels' rule (_fp8.scaled_call), which decides when
                                         it runs; else as lower_precision_fp
        elif node calls an ATen op with no category: its CompositeImplicitAutograd decomposition, rewritten,
            where that reaches an op with one (``_decompose``), as eager autocast casts below the composite
        elif node calls a higher-order op: each subgraph it calls rewritten by the same rules, on the values
            it hands it, into a copy (``_subgraphs``)
        copy the node; compute its fake value from its new inputs
        Casts.note(the new node): what it aliases and writes, so no cast outlives a write to its source

The category is the engine's for the node's overload (``_tables``: the device's
effective table, as the eager kernels read it), and what it does is the
engine's cast plan (``_plan``), on the nodes' fake values instead of tensors.
Eligible tensors are as in eager autocast: floating point, not float64, on
``device_type`` (any device if None). Dtypes come from the fake values, so a
cat of two bfloat16 tensors stays bfloat16: nothing is cast conservatively.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mixprec import _compat, _errors
from mixprec.engine import _devices, _plan, _rules, _tables
from mixprec.graph import _decompose, _fp8, _subgraphs
from mixprec.graph._casts import Casts, is_cast, uses
from mixprec.graph._subgraphs import attribute as _attr
from mixprec.policies import Category, Policy
from mixprec.policies._category import Action


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
    return _Rewrite(policy, dtype, device_type, _fake_mode(gm)).module(gm, None)[0]


class _Rewrite:
    def __init__(
        self,
        policy: Policy,
        dtype: torch.dtype,
        device_type: str | None,
        fake_mode: Any,
        table: dict[Any, Category] | None = None,
        enabled: bool = True,
    ) -> None:
        self.policy, self.dtype, self.device_type, self.fake_mode = policy, dtype, device_type, fake_mode
        # The engine's table of overloads, as the eager kernels read it: the device's effective table (what
        # runs there under this policy, torch's own kernels included), or the policy's own for any device; none
        # inside a disabled torch.autocast region (``under``), which keeps the policy's for regions nested in it.
        if table is not None:
            self.policy_table = table
        elif device_type is not None and _tables.autocast_key(device_type) is not None:
            self.policy_table = _tables.effective(policy, device_type)[0]
        else:
            self.policy_table = _tables.categories(policy)
        self.table = self.policy_table if enabled else {}
        # Calls (``_decompose.signature``: all a decomposition depends on) whose decomposition reaches no op
        # with a category: traced once per graph, not at every node (a graph holds many reshapes).
        self._barren: set[Hashable] = set()
        self.casts = Casts(fx.Graph(), fake_mode)  # the graph being written (``module`` sets it)
        self.region_device: str | None = None  # inside a region entered by a call, where device_type is None
        self._changed: dict[str, frozenset[Any]] = {}  # device type -> the ops the policy moves there

    def module(self, gm: fx.GraphModule, inputs: list[Any] | None) -> tuple[fx.GraphModule, Any]:
        """``gm`` rewritten (its placeholders holding ``inputs``, or the values they recorded), and the values
        of its outputs. A subgraph a higher-order op calls is rewritten into a copy (``_subgraphs``)."""
        graph = fx.Graph()
        graph._codegen = copy.deepcopy(gm.graph._codegen)
        outer, self.casts = self.casts, Casts(graph, self.fake_mode)
        try:
            subgraphs = self._copy(gm, graph, iter(inputs) if inputs is not None else None)
        finally:
            self.casts = outer
        for node in graph.nodes:
            if node.op == "get_attr" and not node.users and isinstance(node.meta.get("val"), fx.GraphModule):
                graph.erase_node(node)  # a subgraph only the original higher-order op called
        root = {n.target: subgraphs[n.target] if n.target in subgraphs else _attr(gm, n.target)
                for n in graph.nodes if n.op in ("get_attr", "call_module")}
        out = fx.GraphModule(root, graph)
        out.training = gm.training
        output = next(n for n in graph.nodes if n.op == "output")
        return out, pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), output.args[0])

    def under(self, device_type: str, dtype: torch.dtype, enabled: bool) -> _Rewrite:
        """The pass inside a ``torch.autocast`` region in the graph: the policy at the region's dtype, as a
        nested ``torch.autocast`` changes only torch's dtype in eager code (the kernels read it from torch: the
        policy still applies), or no casts where the region is disabled."""
        return _Rewrite(self.policy, dtype, device_type, self.fake_mode, self.policy_table, enabled)

    def _copy(self, gm: fx.GraphModule, graph: fx.Graph, inputs: Any) -> dict[str, fx.GraphModule]:
        """Write ``gm``'s nodes into ``graph``, rewritten; the subgraphs written, by attribute name."""
        env: dict[fx.Node, fx.Node] = {}
        subgraphs: dict[str, fx.GraphModule] = {}
        regions: list[_Rewrite] = [self]  # the rules in force: a torch.autocast region's inside one (make_fx's)
        region_calls, set_grad = _compat.autocast_region_calls(), _compat.grad_mode_call()
        attributes: dict[int, fx.Node] = {}  # id of a tensor attribute -> the first get_attr node reading it
        for node in gm.graph.nodes:
            rw = regions[-1]
            mapped = pytree.tree_map_only(fx.Node, env.__getitem__, (node.args, node.kwargs))
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                rw.check_devices(node, mapped)
                env[node] = rw.call(node, mapped)
                self.casts.uses[env[node]] = uses(node)
                continue
            if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                rw.check_devices(node, mapped)
                new = _subgraphs.call(rw, gm, node, mapped, subgraphs)
                if new is not None:
                    env[node] = new
                    self.casts.uses[new] = uses(node)
                    continue
            new = graph.node_copy(node, env.__getitem__)
            inner = rw.entered(*node.args[:3]) if node.op == "call_function" and node.target is region_calls[0] else rw
            if inner is not rw:
                new.args = (*node.args[:2], False, *node.args[3:])  # its casts written out (``entered``)
            if node.op == "placeholder" and inputs is not None:
                new.meta["val"] = next(inputs)
            elif node.op == "get_attr" and _is_real_tensor(attr := _attr(gm, node.target)):
                # the attribute itself (make_fx records a parameter's value without requires_grad), and one
                # tensor to the cast cache however many get_attr nodes read it (make_fx: one per use)
                new.meta["val"] = _refake(self.fake_mode, attr)
                self.casts.same[new] = attributes.setdefault(id(attr), new)
                if type(attr) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):  # (a subclass's storage
                    # may not be its data: it stays with the inputs' one storage)
                    self.casts.storages[new] = (attr.device, attr.untyped_storage().data_ptr())
            elif node.op in ("placeholder", "get_attr"):
                val = node.meta["val"] if "val" in node.meta else _attr(gm, node.target)
                new.meta["val"] = _refake(self.fake_mode, val)
            elif node.op == "call_function" and (node.target in region_calls or node.target is set_grad):
                new.meta["val"] = node.meta.get("val")  # (run at rewrite time, it would set the thread's state)
            elif node.op == "call_function":
                new.meta["val"] = _fake_call(self.fake_mode, node.target, new.args, new.kwargs, node)
            self.casts.note(new)
            self.casts.uses[new] = uses(node)
            env[node] = new
            if node.op == "call_function" and node.target is set_grad and isinstance(node.args[0], bool):
                self.casts.grad_enabled = node.args[0]
            if node.op == "call_function" and node.target is region_calls[0]:
                regions.append(inner)
            elif node.op == "call_function" and node.target is region_calls[1] and len(regions) > 1:
                regions.pop()
        return subgraphs

    def entered(self, device_type: str, dtype: torch.dtype | None, enabled: bool) -> _Rewrite:
        """The rules inside a ``torch.autocast`` region that the graph enters by a call (make_fx records
        ``_enter_autocast`` / ``_exit_autocast``; export a ``wrap_with_autocast`` HOP, ``_subgraphs``): the
        policy at the region's dtype (``under``), or no casts where it is disabled, in the same graph and cast cache (a
        nested region shares the outer one's cache, as torch's does); the rewritten graph enters it disabled,
        its casts written out. A region for another device than the pass's leaves its rules as they are."""
        if self.device_type is not None and self.device_type != device_type:
            return self
        inner = self.under(device_type, dtype if dtype is not None else torch.get_autocast_dtype(device_type), enabled)
        inner.casts, inner.region_device = self.casts, device_type if self.device_type is None else None
        return inner

    def check_devices(self, node: fx.Node, inputs: Any) -> None:
        """Inside a region for one device where the pass casts on every device: a call on tensors of another
        device would need both rules at once, which apply_policy refuses (``_subgraphs.check_devices``)."""
        if self.region_device is not None:
            vals = [n.meta.get("val") for n in pytree.tree_leaves(inputs) if isinstance(n, fx.Node)]
            _subgraphs.check_devices(self.region_device, vals, node)

    def eligible(self, value: Any) -> bool:
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        return isinstance(val, torch.Tensor) and _plan.eligible(val.dtype, val.device.type, self.device_type)

    def runs_as_native(self, target: Any, device: str | None) -> bool:
        """Whether eager runs ``target`` on ``device`` as torch's own autocast kernel does: the policy leaves it
        in torch's category there (not in ``_tables.effective``'s ``changed``, as ``_kernels`` decides), so
        its weights' casts go through torch's cache, where an op the policy moves casts through mixprec's own
        (``_cast.cache_for_call``): two caches, so a weight read by both kinds of op is cast once for each."""
        if device is None or _tables.autocast_key(device) is None:
            return False
        changed = self._changed.get(device)
        if changed is None:
            changed = self._changed[device] = _tables.effective(self.policy, device)[1]
        return target not in changed

    def cast_all(
        self, inputs: tuple[tuple[Any, ...], dict[str, Any]], dtype: torch.dtype, cached: bool, native: bool = False
    ) -> Any:
        """A call's eligible nodes cast to ``dtype``; weights' casts shared if ``cached``, in torch's cache if
        ``native`` (``Casts.to``). The casts are written in the order eager's kernels make them
        (``_compat.native_casts_reversed``: the arguments last to first, a list's tensors first to last), which
        is the order autograd sums their gradients in."""

        def cast(value: Any) -> Any:
            return pytree.tree_map_only(
                fx.Node, lambda n: self.casts.to(n, dtype, cached, native) if self.eligible(n) else n, value
            )

        args, kwargs = inputs
        if not _compat.native_casts_reversed():
            return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        cast_kwargs = {k: cast(kwargs[k]) for k in reversed(kwargs)}
        cast_args = [cast(a) for a in reversed(args)]
        return tuple(reversed(cast_args)), {k: cast_kwargs[k] for k in kwargs}

    def call(self, node: fx.Node, inputs: tuple[tuple[Any, ...], dict[str, Any]], depth: int = 0) -> fx.Node:
        args, kwargs = inputs
        target: Any = node.target
        category = self.table.get(target)
        if category is None and depth < _DEPTH and self.table:  # (none in a disabled torch.autocast region)
            inlined = self._inline(node, target, args, kwargs, depth)
            if inlined is not None:
                return inlined
        if category is not None:
            target, args, kwargs = self._apply(category, node, target, args, kwargs)
        elif target is _ASSERT_METADATA and _is_tensor(args[0]):
            args, kwargs = _assert_dtype(args, kwargs, args[0].meta["val"].dtype)
        new = self.casts.graph.call_function(target, args, kwargs)
        new.meta = {**node.meta}
        effects = None
        if target is _fp8.scaled_call:  # its value is the cast call's (fp8 gives the same shape and dtype)
            op, op_args, op_kwargs, _, dtype, _ = args
            effects = op, op_args, op_kwargs
            cast_args, cast_kwargs = self.cast_values((op_args, op_kwargs), dtype)
            target, args, kwargs = op, cast_args, cast_kwargs
        new.meta["val"] = _fake_call(self.casts.fake_mode, target, args, kwargs, node)
        self.casts.note(new, effects)
        return new

    def cast_values(self, tree: Any, dtype: torch.dtype) -> Any:
        """``tree`` with each eligible node replaced by a fake value of its cast to ``dtype`` (no node made)."""
        with self.casts.fake_mode:
            return pytree.tree_map_only(
                fx.Node, lambda n: n.meta["val"].to(dtype) if self.eligible(n) else n.meta.get("val"), tree
            )

    def _may_run_fp8(self, target: Any, args: Any, kwargs: Any, device: str) -> bool:
        """Whether the call may run in fp8: ``_fp8.fit`` on its fake values, each symbolic size taken as 16. A
        call that fits so fits whenever its symbolic sizes are multiples of 16 (its node decides when it runs,
        as the kernels do); one that does not never fits, whatever they are (only sizes can depend on them)."""

        def aligned(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or not any(isinstance(s, torch.SymInt) for s in value.shape):
                return value
            shape = [_fp8.ALIGNMENT if isinstance(s, torch.SymInt) else s for s in value.shape]
            with self.casts.fake_mode:
                return torch.empty(shape, dtype=value.dtype, device=value.device)

        vals, kwarg_vals = pytree.tree_map_only(fx.Node, lambda n: aligned(n.meta.get("val")), (args, kwargs))
        return _fp8.fits(target, vals, kwarg_vals, device)

    def _inline(self, node: fx.Node, target: Any, args: Any, kwargs: Any, depth: int) -> fx.Node | None:
        """For an op with no category whose CompositeImplicitAutograd kernel reaches ops with one: its
        decomposition, rewritten, as eager autocast meets those ops below the composite and casts them
        (``conv1d.padding`` -> ``_convolution_mode``). None for any other op, which stays whole."""
        key = _decompose.signature(target, args, kwargs)
        if key is not None and key in self._barren:
            return None
        sub = _decompose.trace(node, target, args, kwargs, self.run_values)
        if sub is None or not self._reaches(sub, depth + 1):
            if key is not None:
                self._barren.add(key)
            return None
        inputs = iter(n for n in pytree.tree_leaves((args, kwargs)) if isinstance(n, fx.Node))
        env: dict[fx.Node, Any] = {}
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(inputs)
            elif inner.op == "call_function":
                inner.meta["stack_trace"] = node.meta.get("stack_trace")  # errors name the user's line
                mapped = pytree.tree_map_only(fx.Node, env.__getitem__, (inner.args, inner.kwargs))
                env[inner] = self.call(inner, mapped, depth + 1)
                self.casts.uses[env[inner]] = uses(inner)
            elif inner.op == "output":
                return env[inner.args[0]]  # type: ignore[no-any-return]
        return None

    def _reaches(self, sub: fx.GraphModule, depth: int) -> bool:
        """Whether a decomposition holds an op with a category, at most ``_DEPTH`` decompositions down."""
        for inner in sub.graph.nodes:
            if inner.op != "call_function" or not isinstance(inner.target, torch._ops.OpOverload):
                continue
            if self.table.get(inner.target) is not None:
                return True
            if depth < _DEPTH:
                deeper = _decompose.trace(inner, inner.target, inner.args, inner.kwargs, self.run_values)
                if deeper is not None and self._reaches(deeper, depth + 1):
                    return True
        return False

    def plan(self, category: Category, target: Any, args: Any, kwargs: Any) -> _plan.CastPlan:
        """``_plan``'s plan for a call of ``target`` on ``args``/``kwargs``: nodes carrying fake values, or
        fake values themselves (while a decomposition is traced)."""
        vals, kwarg_vals = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
        first = next((v for v in (*vals, *kwarg_vals.values()) if isinstance(v, torch.Tensor)), None)
        return _plan.plan(
            category,
            self.dtype,
            (v.dtype for v in pytree.tree_leaves((vals, kwarg_vals)) if self._eligible_value(v)),
            first_eligible=first is not None and self._eligible_value(first),
            advice=self.policy.advice(_tables.entry_name(self.policy, target)) if category.action is Action.BAN else "",
        )

    def run_values(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``op`` on fake values, their eligible tensors cast as the policy casts them (a banned call runs as
        it is: the pass raises where it rewrites the node)."""
        category = self.table.get(op)
        plan = self.plan(category, op, args, kwargs) if category is not None else None
        if plan is not None and plan.error is None:
            if plan.cast_to is not None:
                cast = plan.cast_to
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: t.to(cast) if self._eligible_value(t) else t, (args, kwargs)
                )
            elif plan.dtype_arg is not None:
                op, args, kwargs = _rules.with_dtype_arg(op, args, kwargs, plan)
        return op(*args, **kwargs)

    def _eligible_value(self, val: Any) -> bool:
        return isinstance(val, torch.Tensor) and _plan.eligible(val.dtype, val.device.type, self.device_type)

    def _apply(self, category: Category, node: fx.Node, target: Any, args: Any, kwargs: Any) -> Any:
        """The call as ``_plan`` says, on nodes: the same plan the eager kernels carry out on tensors."""
        first = next((v for v in (*args, *kwargs.values()) if _is_tensor(v)), None)
        plan = self.plan(category, target, args, kwargs)
        if plan.error is not None:
            raise RuntimeError(f"{plan.error}{_decompose.where(node)}")
        if plan.scaled is not None:
            device = self.device_type or (first.meta["val"].device.type if first is not None else None)
            if device is not None and self._may_run_fp8(target, args, kwargs, device):
                fields = _fp8.recipe_fields(self.policy.fp8_recipe)
                return _fp8.scaled_call, (target, args, kwargs, device, plan.cast_to, fields), {}
        if plan.cast_to is not None:
            device = self.device_type or (first.meta["val"].device.type if first is not None else None)
            native = self.runs_as_native(target, device)
            return target, *self.cast_all((args, kwargs), plan.cast_to, _plan.keeps_weights(category), native)
        if plan.dtype_arg is not None:
            return _rules.with_dtype_arg(target, args, kwargs, plan)
        return target, args, kwargs


#: The check export writes before a ``.to``/``.float()`` (the dtype, device and layout its input had in the trace).
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _assert_dtype(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, ...]:
    """An ``_assert_tensor_metadata`` call's arguments, checking the dtype its input has after the rewrite (a
    ``.float()`` of a linear's output checked float32, which the linear no longer gives)."""
    if len(args) > 3:
        return (*args[:3], dtype, *args[4:]), kwargs
    if kwargs.get("dtype") is not None:
        return args, {**kwargs, "dtype": dtype}
    return args, kwargs


#: How many CompositeImplicitAutograd decompositions deep the pass follows an op with no category.
_DEPTH = 3


def _is_tensor(value: Any) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _fake_call(fake_mode: Any, target: Callable[..., Any], args: Any, kwargs: Any, node: fx.Node) -> Any:
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (args, kwargs))
    try:
        with fake_mode, torch.no_grad():  # (no value computed requires grad: ``_casts.is_weight``)
            return target(*vals[0], **vals[1])
    except Exception:  # a higher-order op or a node fake tensors cannot run: keep what the trace recorded
        return node.meta.get("val")


def _is_real_tensor(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)


def _refake(fake_mode: Any, val: Any) -> Any:
    """``val`` as a fake tensor of ``fake_mode`` (export records parameters and inputs in different modes),
    requiring grad where ``val`` does (a parameter: ``_casts.is_weight``)."""
    if not isinstance(val, torch.Tensor):
        return val
    with fake_mode:
        return torch.empty_strided(
            val.shape, val.stride(), dtype=val.dtype, device=val.device, requires_grad=val.requires_grad
        )


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
    if dtype not in _devices.LOW_PRECISION:
        raise ValueError(
            _errors.message("apply_policy argument 'dtype' is invalid", "it is the lower-precision dtype",
                            received={"dtype": dtype},
                            expected=[_devices.dtype_name(d) for d in _devices.LOW_PRECISION])
        )
