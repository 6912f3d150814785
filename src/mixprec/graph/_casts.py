"""Cast nodes: recognising them, and inserting them with no chains and no round trips.

Algorithm for ``Casts.to(node, dtype, cached, native)``::

    while node is a lossless widening cast of src (bf16->f32, f16->f32, ...)
          and this is node's one use in its graph
          and nothing wrote to src or node since node was made:
        node = src                            # a cast of a widened copy equals a cast of its source
    if node's dtype is dtype: return node     # also removes cast / cast-back pairs
    if not cached or grad is off or node (itself: through .to's to its own dtype) is neither a weight
            nor an input that may be one:
        return new _to_copy(node, dtype=dtype)  # eager autocast's rule: it casts afresh at each use
    if cache holds (node, dtype, native) and nothing wrote to node or to that cast since the cast was made:
        return it if node is a weight, else new cast_unless_weight(node, it, dtype)
    return cache[(node, dtype, native)] = new _to_copy(node, dtype=dtype)

A widened copy represents its source exactly, so casting the source instead
gives the same bits; narrowing casts round, so they are never skipped. Only a
copy used once is skipped: where it has other uses, eager sums their gradients
in the copy's dtype before its backward narrows the sum once, and the source's
gradient would instead sum each use's narrowed part (``uses``: how often each
node's original is used in the graph being rewritten; a node it does not know,
such as a cast the pass made, is never skipped).

Sharing: eager autocast keeps a cast for reuse only for a weight (a float32
leaf that requires grad, not a view) and only where the target format keeps
weights' casts (``Format.cached``: the region's dtype, not float32, float16 or
fp8); every other use casts afresh. Sharing is not free to choose: a cast used
by two ops sums their gradients in the cast's dtype before its backward, where
two casts sum them in the source's dtype. So ``to`` shares a cast exactly where
eager would (``cached`` is the target's, ``is_weight`` eager's test on the
node's value: a parameter, which ``_apply`` records as a leaf requiring grad).
Eager keeps two caches: torch's, for an op run as torch's own kernel runs it,
and mixprec's, for an op the policy moves (``_cast.cache_for_call``); a weight
read by both kinds of op is cast once in each, and so the pass keys its casts
by the cache too (``native``).
A graph input traced without ``requires_grad`` may yet be a weight when the
graph runs (a leaf the caller made require grad, as a parameter that make_fx
takes as an input): its later uses call ``cast_unless_weight``, which reuses
the first use's cast where the tensor it gets is a weight and casts afresh
where not, as eager autocast decides per call. Under ``no_grad`` (a stretch of
a make_fx graph after ``_set_grad_enabled(False)``) eager keeps no weight's
cast, and neither does the pass. A parameter that two
``get_attr`` nodes read (make_fx names it once per use) is one tensor to the
cache (``same``).

Writes: every node added to the graph is ``note``d in order. A node joins the
storage of the arguments its op's schema annotates (a view, an in-place op's
result, an ``out=``), and an argument annotated ``!`` is written, with all that
shares its storage: its base and the base's other views. The graph's inputs
(placeholders) may alias one another and any attribute, so they share one
storage, and a write to one is a write to every attribute. An attribute read as
a real tensor (a parameter, a buffer: ``storages``) has its own, so a write to
one (a BatchNorm's running statistics) reaches the attributes sharing its
storage, and leaves other weights' casts standing, as in eager. (An input that
is such an attribute, written so, keeps its cast: where it is a weight, torch's
own cache keeps a stale cast too, and where not, ``cast_unless_weight`` casts
it again.) A
call that is no ATen op (a higher-order op, a Python function) may alias and
write every tensor it is given, but a higher-order op whose subgraphs write none
of their inputs (``writes_inputs``: a ``no_grad`` or ``torch.autocast`` block that
only reads them) writes nothing. So a cast made before an in-place op is never
reused after it, as eager autocast casts again at each call (its own cache keeps
only weights' casts, and mixprec's drops one when the weight's version moves).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mixprec.engine import _cast

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
    if target in (aten.to.dtype, torch.ops.prims.convert_element_type.default, cast_unless_weight):
        return node.args[0]
    return None


def is_cast(node: fx.Node) -> bool:
    return cast_source(node) is not None


def cast_unless_weight(t: torch.Tensor, cast: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cast`` (an earlier use's cast of ``t`` to ``dtype``) where ``t`` is a weight by eager autocast's test,
    whose cache would give that cast again; else a new cast of ``t``, as eager casts anything else at each use.
    The graph's later uses of an input that may be a weight when it runs call it (``Casts.to``)."""
    return cast if _cast.is_weight_when_run(t) else _cast.to(t, dtype)


def may_be_weight(node: fx.Node) -> bool:
    """Whether ``node`` is a graph input whose trace cannot say if it is a weight (float32, traced without
    ``requires_grad``): a placeholder, as the caller's tensor may be a leaf that requires grad when it runs."""
    val = node.meta.get("val")
    return node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dtype is torch.float32


def itself(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` is when it runs: through each ``.to``/``.float()`` (``aten.to.dtype``,
    no ``copy=True``) to the dtype its source has, which returns the source itself."""
    while node.op == "call_function" and node.target is aten.to.dtype:
        source = node.args[0]
        copies = node.args[3] if len(node.args) > 3 else node.kwargs.get("copy", False)
        if copies or not isinstance(source, fx.Node) or dtype_of(source) is not dtype_of(node):
            break
        node = source
    return node


def is_weight(node: fx.Node) -> bool:
    """Whether ``node`` is a weight by eager autocast's test (``engine._cast.is_weight``), asked of its value:
    a float32 leaf that requires grad, not a view. ``_apply`` computes every value under no_grad, so only the
    graph's inputs may pass, where their trace recorded them so: its parameters (``get_attr`` nodes, or export's
    lifted placeholders), and an input traced with ``requires_grad=True``."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and _cast.is_weight(val)


def uses(node: fx.Node) -> int:
    """How many times ``node``'s value is used in its graph: once per argument it is, of each user."""
    return sum(
        1 for user in node.users for leaf in pytree.tree_leaves((user.args, user.kwargs)) if leaf is node
    )


def dtype_of(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


class Casts:
    """Inserts ``aten._to_copy`` casts into ``graph``: one per use, but one per (weight, dtype) between writes
    to the weight where the target format keeps weights' casts, as eager autocast casts."""

    def __init__(self, graph: fx.Graph, fake_mode: Any) -> None:
        self.graph = graph
        self.fake_mode = fake_mode
        self.cache: dict[tuple[fx.Node, torch.dtype, bool], fx.Node] = {}  # (weight, dtype, torch's cache?)
        self._tick = 0
        self._made: dict[fx.Node, int] = {}  # node -> when it was noted
        self._storage: dict[Any, Any] = {}  # union-find: node (or _INPUTS, a storage) -> one sharing its storage
        self._written: dict[Any, int] = {}  # a storage's root -> when it was last written
        self.storages: dict[fx.Node, Any] = {}  # a get_attr node reading a real tensor -> its storage (``note``)
        self._attributes: set[Any] = set()  # the roots holding an attribute's storage
        self._inputs_written = 0  # when a graph input (which may be any attribute too) was last written
        self.uses: dict[fx.Node, int] = {}  # a node -> how many times its original's value is used
        self.same: dict[fx.Node, fx.Node] = {}  # a get_attr node -> the first reading the same tensor
        self.grad_enabled = True  # False after a make_fx graph's _set_grad_enabled(False): nothing is kept

    def note(
        self,
        node: fx.Node,
        effects: tuple[Any, ...] | None = None,
        writes: bool | list[fx.Node] = True,
        aliases: list[fx.Node] | None = None,
    ) -> None:
        """Record ``node``, just added to the graph: its storage and its writes. ``effects``: (target, args,
        kwargs) whose schema says them, where the node calls something else for an op (``_fp8.scaled_call``).
        For a call that is no ATen op, ``writes``: the arguments it may write, where known (a higher-order op
        whose subgraph writes those inputs alone: ``input_effects``), True: any, False: none; ``aliases``: the
        arguments its value may share storage with, where known (None: any)."""
        self._tick += 1
        self._made[node] = self._tick
        target, args, kwargs = effects if effects is not None else (node.target, node.args, node.kwargs)
        aliased: list[Any]
        written: list[fx.Node]
        if node.op == "get_attr" and node in self.storages:
            aliased, written = [self.storages[node]], []
            self._attributes.add(self._root(self.storages[node]))
        elif node.op in ("placeholder", "get_attr"):
            aliased, written = [_INPUTS], []
        elif node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            aliased, written = _schema_effects(target, args, kwargs)
        elif node.op == "call_function" and target is operator.getitem:
            aliased, written = _tensors(args[0]), []
        elif node.op == "output":
            aliased, written = [], []
        else:
            aliased = _tensors((args, kwargs)) if aliases is None else _tensors(aliases)
            written = _tensors((args, kwargs)) if writes is True else _tensors(writes) if writes else []
        for other in aliased:
            self._union(node, other)
        inputs = self._root(_INPUTS)
        for other in written:
            root = self._root(other)
            self._written[root] = self._tick
            if root is inputs:  # an input may be any attribute
                self._inputs_written = self._tick

    def to(self, node: fx.Node, dtype: torch.dtype, cached: bool, native: bool = False) -> fx.Node:
        """``node`` as ``dtype``: itself, an existing cast (a weight's, where ``cached``: the target format keeps
        weights' casts; from torch's cache if ``native``, else mixprec's), or one new cast node."""
        source = cast_source(node)
        while (
            source is not None
            and dtype_of(node) in _WIDER.get(dtype_of(source), ())  # type: ignore[arg-type]
            and self.uses.get(node, 0) == 1
            and self._unwritten(node, since=node)
            and self._unwritten(source, since=node)
        ):
            node, source = source, cast_source(source)
        if dtype_of(node) is dtype:
            return node
        base = itself(node)  # (the tensor a weight's cache would know it by)
        weight = is_weight(base)
        if not (cached and self.grad_enabled and (weight or may_be_weight(base))):
            return self._cast(node, dtype)
        key = (self.same.get(base, base), dtype, native)
        hit = self.cache.get(key)
        if hit is None or not (self._unwritten(node, since=hit) and self._unwritten(hit, since=hit)):
            hit = self.cache[key] = self._cast(node, dtype)
            return hit
        return hit if weight else self._cast(node, dtype, first=hit)

    def _cast(self, node: fx.Node, dtype: torch.dtype, first: fx.Node | None = None) -> fx.Node:
        """A new cast node: ``_to_copy(node, dtype=dtype)``, or ``cast_unless_weight(node, first, dtype)``."""
        if first is None:
            cast = self.graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
        else:
            cast = self.graph.call_function(cast_unless_weight, (node, first, dtype))
        with self.fake_mode, torch.no_grad():
            cast.meta["val"] = node.meta["val"].to(dtype)
        self.note(cast, writes=False)  # (cast_unless_weight may return first: it aliases it, and writes nothing)
        return cast

    def _unwritten(self, node: fx.Node, since: fx.Node) -> bool:
        """Whether nothing wrote to ``node``'s storage after ``since`` was noted."""
        root = self._root(node)
        last = self._written.get(root, 0)
        if root in self._attributes:
            last = max(last, self._inputs_written)
        return last < self._made.get(since, 0)

    def _root(self, node: Any) -> Any:
        parent = self._storage.get(node, node)
        while parent is not node:
            grand = self._storage.get(parent, parent)
            self._storage[node] = grand
            node, parent = parent, grand
        return node

    def _union(self, a: Any, b: Any) -> None:
        ra, rb = self._root(a), self._root(b)
        if ra is not rb:
            self._storage[ra] = rb
            self._written[rb] = max(self._written.pop(ra, 0), self._written.get(rb, 0))
            if ra in self._attributes:
                self._attributes.discard(ra)
                self._attributes.add(rb)


def writes_inputs(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` may write one of its inputs (``input_effects``)."""
    effects = input_effects(gm)
    return effects is None or bool(effects[1])


def input_effects(gm: fx.GraphModule) -> tuple[frozenset[int], frozenset[int]] | None:
    """The positions of ``gm``'s placeholders whose storage its outputs may share, and of those whose storage
    running it may write: through an op whose schema writes a placeholder or a tensor sharing its storage (a
    view, an in-place result). None where a call of anything that is no ATen op (but a higher-order op whose own
    subgraphs write no input, and ``getitem``) gets one: it may alias and write any."""
    derived: dict[fx.Node, frozenset[int]] = {}  # a node that may share inputs' storage -> their positions
    written: set[int] = set()
    shared_out: set[int] = set()
    position = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            derived[node] = frozenset((position,))
            position += 1
        elif node.op == "output":
            shared_out.update(*(derived[n] for n in _tensors(node.args) if n in derived))
        elif node.op != "call_function":
            continue
        elif isinstance(node.target, torch._ops.OpOverload):
            aliased, writes = _schema_effects(node.target, node.args, node.kwargs)
            written.update(*(derived[n] for n in writes if n in derived))
            shared = [derived[n] for n in aliased if n in derived]
            if shared:
                derived[node] = frozenset().union(*shared)
        elif node.target is operator.getitem:
            if node.args[0] in derived:
                derived[node] = derived[node.args[0]]
        elif isinstance(node.target, torch._ops.HigherOrderOperator):
            inner = [getattr(gm, n.target) for n in node.all_input_nodes if n.op == "get_attr"]
            shared = [derived[n] for n in node.all_input_nodes if n.op != "get_attr" and n in derived]
            if shared:
                if not all(isinstance(g, fx.GraphModule) and not writes_inputs(g) for g in inner):
                    return None
                derived[node] = frozenset().union(*shared)
        elif any(n in derived for n in node.all_input_nodes):
            return None
    return frozenset(shared_out), frozenset(written)


_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)

#: The storage all the graph's inputs share: two of them may be the same tensor, or views of one, or of an
#: attribute. An attribute the pass has as a real tensor has its own storage (``Casts.storages``).
_INPUTS = object()


def _schema_effects(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes a call of ``op`` may alias (every argument its schema annotates) and those it writes (``!``)."""
    aliased: list[fx.Node] = []
    written: list[fx.Node] = []
    for i, argument in enumerate(op._schema.arguments):
        info = argument.alias_info
        if info is None:
            continue
        nodes = _tensors(args[i] if i < len(args) else kwargs.get(argument.name))
        aliased += nodes
        if info.is_write:
            written += nodes
    return aliased, written


def _tensors(tree: Any) -> list[fx.Node]:
    """The nodes in ``tree`` that may hold tensors (a value of another type, such as a SymInt, cannot)."""
    return [
        n
        for n in pytree.tree_leaves(tree)
        if isinstance(n, fx.Node) and not isinstance(n.meta.get("val"), _SCALARS)
    ]
