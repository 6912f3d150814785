"""Higher-order ops: the subgraphs ``apply_policy`` rewrites along with the graph that calls them.

A higher-order op (HOP) node calls GraphModules held as attributes of the graph (``get_attr`` nodes among its
arguments). Eager autocast casts the ops they run as any other, so the pass rewrites each subgraph by the same
rules, on the values the HOP hands it (the rewritten graph's: a branch gets a linear's bf16 output), into a
copy; the HOP's value is then the rewritten subgraph's::

    cond(pred, true, false, operands)                 each branch on operands; branches that give different
                                                      dtypes: an error (one graph value holds both)
    while_loop(cond, body, carried, additional)       both on carried + additional; a body that changes a
                                                      carried dtype: an error, as eager while_loop raises one
    map_impl(body, xs, args)                          body on one slice of each of xs, and args
    scan(combine, init, xs, additional)               combine on init + one slice of each of xs + additional;
                                                      one that changes a carried dtype: an error, as above
    wrap_with_set_grad_enabled(enabled, gm, *args)    gm on args
    invoke_subgraph(gm, identifier, *args)            gm on args, the identifier made the rewrite's own
    wrap_with_autocast(device, dtype, enabled, cache, gm, *args)
                                                      a torch.autocast region in the graph: gm on args by the
                                                      policy at the region's dtype (a nested torch.autocast
                                                      changes only the dtype in eager code), with no casts
                                                      where the region is disabled; the region then runs
                                                      disabled, its casts written out
    another HOP that holds a subgraph, or calls an op the policy lists: an error naming it
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mixprec import _errors
from mixprec.graph._casts import Casts, input_effects, writes_inputs
from mixprec.graph._decompose import where


class Rewriter(Protocol):
    """What this module needs of the pass (``_apply._Rewrite``)."""

    fake_mode: Any
    device_type: str | None
    table: dict[Any, Any]
    casts: Casts

    def module(self, gm: fx.GraphModule, inputs: list[Any]) -> tuple[fx.GraphModule, Any]:
        """``gm`` rewritten with its placeholders holding ``inputs``, and the values of its outputs."""

    def under(self, device_type: str, dtype: torch.dtype, enabled: bool) -> Rewriter:
        """The pass for the ops inside a ``torch.autocast(device_type, dtype, enabled)`` region."""


#: A HOP's rule: (pass, node, its new arguments, the subgraph a new argument names or None) -> (the arguments
#: with each subgraph rewritten, the node's value).
Rule = Callable[[Rewriter, fx.Node, list[Any], Callable[[Any], "fx.GraphModule | None"]], tuple[list[Any], Any]]


def call(
    rw: Rewriter, gm: fx.GraphModule, node: fx.Node, mapped: Any, subgraphs: dict[str, fx.GraphModule]
) -> fx.Node | None:
    """A HOP node of ``gm`` written into the pass's graph with its subgraphs rewritten (each added to
    ``subgraphs`` under the attribute name the new node reads), or None where it is copied as it is."""

    def submodule(arg: Any) -> fx.GraphModule | None:
        found = attribute(gm, arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
        return found if isinstance(found, fx.GraphModule) else None

    args, kwargs = mapped
    done = rewrite(rw, node, args, submodule)
    if done is None:
        return None
    new_args, value = done
    graph = rw.casts.graph
    for i, (old, arg) in enumerate(zip(args, new_args, strict=True)):
        if isinstance(arg, fx.GraphModule):
            name, k = str(old.target), 0
            while name in subgraphs and subgraphs[name].code != arg.code:  # called again, on other dtypes
                k += 1
                name = f"{old.target}_{k}"
            subgraphs.setdefault(name, arg)
            new_args[i] = graph.get_attr(name)
            rw.casts.note(new_args[i])
    new = graph.call_function(node.target, tuple(new_args), kwargs)  # type: ignore[arg-type]
    new.meta = {**node.meta, "val": value}
    inner = [subgraphs[str(a.target)] for a in new_args if isinstance(a, fx.Node) and str(a.target) in subgraphs]
    first = _OPERANDS.get(getattr(node.target, "__name__", ""))
    effects = input_effects(inner[0]) if first is not None and len(inner) == 1 else None
    if effects is None:
        rw.casts.note(new, writes=any(writes_inputs(g) for g in inner))
    else:  # what its one subgraph aliases and writes, by its arguments
        operands = new_args[first:]
        shared, written = ([operands[i] for i in sorted(positions) if i < len(operands)] for positions in effects)
        rw.casts.note(new, writes=written, aliases=shared)
    return new


#: The HOPs that call one subgraph on their arguments from a position on: (name, that position).
_OPERANDS = {"wrap_with_set_grad_enabled": 2, "invoke_subgraph": 2, "wrap_with_autocast": 5}


def attribute(gm: fx.GraphModule, target: Any) -> Any:
    """The object ``gm.<target>`` names (a dotted path)."""
    obj: Any = gm
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def rewrite(
    rw: Rewriter, node: fx.Node, args: tuple[Any, ...], submodule: Callable[[Any], fx.GraphModule | None]
) -> tuple[list[Any], Any] | None:
    """A HOP node's new arguments (each subgraph a rewritten GraphModule) and value; None for a HOP that holds
    no subgraph and calls no op the policy lists, which is copied as it is."""
    name = getattr(node.target, "__name__", str(node.target))
    rule = _RULES.get(name)
    if rule is not None:
        return rule(rw, node, list(args), submodule)
    leaves = pytree.tree_leaves((args, node.kwargs))
    listed = [a for a in leaves if isinstance(a, torch._ops.OpOverload) and a in rw.table]
    if any(submodule(a) is not None for a in leaves) or listed:
        raise NotImplementedError(
            _errors.message(
                f"apply_policy cannot rewrite the higher-order op {name}",
                "it runs a subgraph or an op the policy lists, which apply_policy does not know how to rewrite "
                "for this op; left as it is, they would run in other dtypes than under autocast",
                received={"op": f"torch.ops.higher_order.{name}"},
                expected=sorted(_RULES),
                fix="Export the model without it, or apply the policy in eager code (mixprec.autocast).",
            )
            + where(node)
        )
    return None


def _values(tree: Any) -> Any:
    return pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), tree)


def _dtypes(tree: Any) -> list[Any]:
    return [v.dtype if isinstance(v, torch.Tensor) else type(v) for v in pytree.tree_leaves(tree)]


def _sub(submodule: Callable[[Any], fx.GraphModule | None], arg: Any) -> fx.GraphModule:
    found = submodule(arg)
    if found is None:
        raise TypeError(
            _errors.message(
                "apply_policy cannot rewrite a higher-order op",
                "where it takes a subgraph it was given something else than a GraphModule the graph holds",
                received={"argument": arg},
                fix="Pass a graph from torch.export.export or make_fx, which hold subgraphs as attributes.",
            )
        )
    return found


def _cond(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    pred, true, false, operands = args[:4]
    inputs = list(_values(operands))
    (true, out), (false, other) = rw.module(_sub(submodule, true), inputs), rw.module(_sub(submodule, false), inputs)
    if _dtypes(out) != _dtypes(other):
        raise RuntimeError(
            _errors.message(
                "apply_policy cannot rewrite torch.cond",
                "under the policy its branches return different dtypes, and the graph has one value for both",
                received={"true_branch": _dtypes(out), "false_branch": _dtypes(other)},
                fix="End both branches in the same dtype (a .to(dtype) on each result).",
            )
            + where(node)
        )
    return [pred, true, false, operands, *args[4:]], out


def _while_loop(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    cond, body, carried, additional = args[:4]
    inputs = [*_values(carried), *_values(additional)]
    body, out = rw.module(_sub(submodule, body), inputs)
    _check_carried(node, list(_values(carried)), list(out))
    cond, _ = rw.module(_sub(submodule, cond), inputs)
    return [cond, body, carried, additional, *args[4:]], out


def _scan(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    combine, init, xs, additional = args[:4]
    carried, stacked = list(_values(init)), list(_values(xs))
    with rw.fake_mode:
        slices = [x.select(0, 0) for x in stacked]
    combine, out = rw.module(_sub(submodule, combine), [*carried, *slices, *_values(additional)])
    carries, ys = list(out)[: len(carried)], list(out)[len(carried) :]
    _check_carried(node, carried, carries)
    with rw.fake_mode:
        ys = [y.new_empty((stacked[0].shape[0], *y.shape)) for y in ys]
    return [combine, init, xs, additional, *args[4:]], [*carries, *ys]


def _check_carried(node: fx.Node, carried: list[Any], returned: list[Any]) -> None:
    """A loop's body must give back the dtypes it takes, as eager while_loop and scan check under autocast."""
    if _dtypes(returned) != _dtypes(carried):
        raise RuntimeError(
            _errors.message(
                f"apply_policy cannot rewrite {getattr(node.target, '__name__', node.target)}",
                "under the policy its body returns a carried value in another dtype than it takes, which the "
                "op refuses under autocast in eager code too",
                received={"carried": _dtypes(carried), "returned": _dtypes(returned)},
                fix="Cast the body's results to the carried dtypes (a .to(dtype) on each).",
            )
            + where(node)
        )


def _map(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    body, xs, rest = args[:3]
    stacked = list(_values(xs))
    with rw.fake_mode:
        slices = [x.select(0, 0) for x in stacked]
    body, out = rw.module(_sub(submodule, body), [*slices, *_values(rest)])
    with rw.fake_mode:
        value = pytree.tree_map_only(torch.Tensor, lambda o: o.new_empty((stacked[0].shape[0], *o.shape)), out)
    return [body, xs, rest, *args[3:]], value


def _after(position: int, operands: int) -> Rule:
    """The rule of a HOP that calls the subgraph at ``position`` on its arguments from ``operands`` on."""

    def rule(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
        sub, out = rw.module(_sub(submodule, args[position]), list(_values(args[operands:])))
        return [*args[:position], sub, *args[position + 1 :]], out

    return rule


def _invoke_subgraph(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    """gm on args. A traced call caches the subgraph's autograd by its identifier, so a rewrite of it (two
    calls on other dtypes give two) gets its own: the identifier and a digest of its code."""
    args, out = _after(0, 2)(rw, node, args, submodule)
    if isinstance(args[1], str):
        args[1] = f"{args[1]}_{hashlib.sha256(args[0].code.encode()).hexdigest()[:12]}"
    return args, out


def _autocast(rw: Rewriter, node: fx.Node, args: list[Any], submodule: Any) -> tuple[list[Any], Any]:
    device_type, dtype, enabled = args[:3]
    gm = _sub(submodule, args[4])
    if rw.device_type is None:  # the pass casts on every device, the region on one: both apply where they mix
        check_devices(device_type, [*_values(args[5:]), *(n.meta.get("val") for n in gm.graph.nodes)], node)
    ours = rw.device_type is None or rw.device_type == device_type
    if ours:
        rw = rw.under(device_type, dtype if dtype is not None else torch.get_autocast_dtype(device_type), enabled)
    sub, out = rw.module(gm, list(_values(args[5:])))
    # the region's casts are the rewritten subgraph's own nodes now: it runs with autocast off, or torch's
    # kernels would cast again by torch's table where the policy says otherwise
    return [device_type, dtype, False if ours else enabled, args[3], sub, *args[5:]], out


def check_devices(device_type: str, values: Any, node: fx.Node) -> None:
    """Refuse a ``torch.autocast`` region for ``device_type`` holding ``values`` on other devices, where the pass
    casts on every device: the region's rules would apply to some tensors and the policy's to others."""
    others = {v.device.type for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)} - {device_type}
    if others:
        raise NotImplementedError(
            _errors.message(
                "apply_policy cannot rewrite a torch.autocast region in the graph",
                f"the region is for {device_type} and holds tensors on other devices, and apply_policy was "
                "given no device_type: the region's rules apply to some tensors and the policy's to others",
                received={"devices": sorted(others)},
                fix=f"Pass device_type={device_type!r} to apply_policy.",
            )
            + where(node)
        )


_RULES: dict[str, Rule] = {
    "cond": _cond,
    "while_loop": _while_loop,
    "map_impl": _map,
    "scan": _scan,
    "wrap_with_set_grad_enabled": _after(1, 2),
    "invoke_subgraph": _invoke_subgraph,
    "wrap_with_autocast": _autocast,
}
