"""How ``explain`` learns what an op does with its inputs: it runs the op, on fake tensors.

Algorithm::

    call     = the ATen call to model, with tensors described by shape and dtype:
               the user's example (an op, or a Python callable traced at the pre-dispatch level to the
               ATen op it reaches: torch.norm(x) reaches aten::linalg_vector_norm), else arguments made
               from the op's schema (tensors of a few small shapes, integral ones where the argument
               names an index or a target), the first that runs in float32
    run      = on fake tensors of the requested dtypes (the floating arguments, in order), every Autocast
               key excluded:  rule(op, ...)  for a categorized op (the kernels' own rule, _kernels.rule_for)
                              op(...)        for one with no category
    outcome  = the dtypes the op received, its first floating output's dtype, or the error it raised

No kernel is registered and nothing is computed on real data, so asking ``explain``
changes nothing in the process. An op with no category that decomposes into ops
with one (a CompositeImplicitAutograd kernel) is not run: under autocast its
callees are cast by their own categories, which ``callees`` names.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Container, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from mixprec import _compat
from mixprec.engine import _tables
from mixprec.policies import Category

Op = torch._ops.OpOverload

#: Tensor arguments that hold integers: indices, class targets, lengths.
_INTEGRAL = frozenset(
    {"index", "indices", "target", "targets", "labels", "offsets", "lengths", "input_lengths", "target_lengths"}
)
SHAPES: tuple[tuple[int, ...], ...] = ((2, 2), (2,), (1, 2, 4), (1, 2, 4, 4), (4, 4), (2, 2, 2), (1, 2, 4, 4, 4), ())


@dataclasses.dataclass(frozen=True)
class Spec:
    """A tensor argument as a shape and a dtype; ``floating``: the requested input dtypes apply to it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    floating: bool


@dataclasses.dataclass(frozen=True)
class Call:
    """An ATen call: its tensors described (``Spec``), or an example's own tensors."""

    op: Op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Outcome:
    cast_inputs: tuple[torch.dtype, ...]  # the floating arguments' dtypes as the op received them
    runs_in: torch.dtype | None
    raises: str | None


def _spec(t: torch.Tensor) -> Spec:
    return Spec(tuple(t.shape), t.dtype, t.is_floating_point() or t.is_complex())


def _keys() -> Any:
    found = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    for name in dir(torch._C.DispatchKey):
        if name.startswith("Autocast"):
            found = found | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    return found


# ---------------------------------------------------------------- the call to model


def _int_list(name: str, shape: tuple[int, ...]) -> list[int]:
    """A list-of-ints argument that fits tensors of ``shape``, by what its name says it is."""
    if "shape" in name:
        return list(shape[-1:]) or [1]
    if name in ("dim", "dims"):
        return [0]
    if "size" in name and "kernel" not in name:
        return list(shape[2:]) or [1]
    return [1] * max(len(shape) - 2, 1)


def _argument(argument: Any, shape: tuple[int, ...], index_shape: tuple[int, ...]) -> Any:
    """A value for a required argument (its type as the schema prints it in Python: ``List[Tensor]``)."""
    kind, name = str(argument.type), argument.name
    if kind == "Tensor":
        return Spec(index_shape, torch.int64, False) if name in _INTEGRAL else Spec(shape, torch.float32, True)
    if kind == "List[Tensor]":
        return [Spec(shape, torch.float32, True), Spec(shape, torch.float32, True)]
    if kind == "List[Optional[Tensor]]":
        return [Spec(index_shape, torch.int64, False)]
    if kind in ("int", "SymInt"):
        return torch.float32 if name in ("dtype", "out_dtype") else (0 if name == "dim" else 1)
    if kind in ("List[int]", "List[SymInt]"):
        return _int_list(name, shape)
    if kind in ("float", "number"):
        return 0.5
    if kind == "bool":
        return False
    if kind.startswith("Optional["):
        return None
    raise LookupError(kind)


def _made(op: Op, shape: tuple[int, ...], index_shape: tuple[int, ...]) -> Call | None:
    args = []
    for argument in op._schema.arguments:
        if argument.has_default_value():
            break
        if argument.kwarg_only:
            return None
        try:
            args.append(_argument(argument, shape, index_shape))
        except LookupError:
            return None
    return Call(op, tuple(args), {})


@functools.lru_cache(maxsize=512)
def synthesize(qualified: str) -> Call | None:
    """A call of the op (``aten::mm``) or overload (``aten::softmax.int``) that runs in float32, or None."""
    for op in _tables.overloads(qualified):  # (functional ones only)
        for shape in SHAPES:
            for index_shape in ((shape[0],) if shape else (), shape):
                call = _made(op, shape, index_shape)
                if call is not None and run(call, "cpu", None, None, ()).raises is None:  # as the op itself runs
                    return call
    return None


def from_example(op: Any, qualified: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
    """The call ``op(*args, **kwargs)`` makes at the dispatcher (an overload, a packet or a name)."""
    args, kwargs = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    if isinstance(op, torch._ops.OpOverload):
        return Call(op, args, kwargs)
    try:
        name = qualified if "::" in qualified else f"aten::{qualified}"
        overload = _compat.resolve_overload(name.split(".")[0], args, kwargs)
        found = getattr(torch.ops, name.split("::")[0])
        return Call(getattr(getattr(found, name.split("::")[1].split(".")[0]), overload), args, kwargs)
    except (RuntimeError, AttributeError, TypeError):
        return None


class _Quiet(logging.Filter):
    """Drops every record (one per trace: each trace adds and removes its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


def aten_calls(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    """The ATen calls ``fn(*args, **kwargs)`` makes, traced before autograd with autocast off (tensors or
    ``Spec``s among the arguments; fake tensors stand in for them). Empty if it cannot be traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(flat) if isinstance(v, (torch.Tensor, Spec))]

    def rebuilt(*tensors: Any) -> Any:
        values = list(flat)
        for i, t in zip(slots, tensors, strict=True):
            values[i] = t
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        return fn(*call_args, **call_kwargs)

    logger = logging.getLogger("torch._subclasses.fake_tensor")  # (it logs the error it raises, traceback and all)
    quiet = _Quiet()
    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True), torch._C._DisableAutocast():
            warnings.simplefilter("ignore")
            tensors = [_tensor(v if isinstance(v, Spec) else _spec(v), "cpu", None) for v in (flat[i] for i in slots)]
            graph = make_fx(rebuilt, pre_dispatch=True)(*tensors)
    except Exception:  # whatever stops the trace (data-dependent control flow, an op fake tensors lack)
        return []
    finally:
        logger.removeFilter(quiet)

    def value(v: Any) -> Any:
        return _spec(v.meta["val"]) if isinstance(v, torch.fx.Node) else v

    def plain(v: Any) -> Any:  # (fx keeps a list argument as its immutable_list: a call gets a list, as torch's)
        return list(v) if isinstance(v, list) and type(v) is not list else v

    return [
        Call(
            node.target,
            tuple(plain(a) for a in pytree.tree_map(value, tuple(node.args))),
            {k: plain(v) for k, v in pytree.tree_map(value, dict(node.kwargs)).items()},
        )
        for node in graph.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    ]


def traced(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], listed: Container[Op] = ()
) -> Call | None:
    """The ATen call a Python callable makes with these arguments that explains it: the first whose overload is
    ``listed`` (has a category: ``F.mse_loss`` reaches ``broadcast_tensors`` before ``mse_loss``), else the
    first (torch.norm(x): linalg_vector_norm)."""
    specs = not kwargs and all(isinstance(a, Spec) for a in args)
    try:
        found = _spec_calls(fn, args) if specs else aten_calls(fn, args, kwargs)
    except TypeError:  # (a callable object that cannot be hashed)
        found = aten_calls(fn, args, kwargs)
    return next((call for call in found if call.op in listed), found[0] if found else None)


@functools.lru_cache(maxsize=2048)
def _spec_calls(fn: Callable[..., Any], specs: tuple[Spec, ...]) -> list[Call]:
    """``aten_calls`` of a call made of ``Spec``s only (explain without an example), once per callable and specs:
    a trace, or a failed one, costs milliseconds, and explain asks again for every policy and dtype."""
    return aten_calls(fn, specs, {})


# ---------------------------------------------------------------- running it


def _tensor(spec: Spec, device_type: str, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.zeros(spec.shape, dtype=dtype or spec.dtype, device=device_type)


class _Spy:
    """An overload that remembers the floating dtypes of the arguments it was last called with."""

    def __init__(self, op: Op) -> None:
        self.op = op
        self.seen: tuple[torch.dtype, ...] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.seen = tuple(t.dtype for t in _floating(args, kwargs))
        return self.op(*args, **kwargs)


def _floating(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    return (v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and v.is_floating_point())


def _real(spec: Spec, device: str, dtype: torch.dtype | None, generator: torch.Generator) -> torch.Tensor:
    """A small real tensor for ``spec``: integral ones zero (valid indices and targets), floating ones in
    [0.25, 0.75) (valid for logs, roots, probabilities and most solvers)."""
    dtype = dtype or spec.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    return (torch.rand(spec.shape, generator=generator) * 0.5 + 0.25).to(device=device, dtype=dtype)


def run(
    call: Call,
    device: str,
    low: torch.dtype | None,
    rule: Callable[..., Any] | None,
    dtypes: tuple[torch.dtype, ...],
) -> Outcome:
    """Run ``call`` on small real tensors on ``device``: the floating ones in ``dtypes`` (the last repeated), the
    op through ``rule`` (the kernels' rule; None: the op itself), every Autocast key excluded, grad off, the
    random state kept. Fake tensors would not do: meta kernels skip dtype checks real ones make (mm)."""
    wanted = iter(d for d in dtypes if d.is_floating_point or d.is_complex)  # an integral one names an index
    last: list[torch.dtype | None] = [None]
    generator = torch.Generator().manual_seed(0)

    def make(value: Spec | torch.Tensor) -> torch.Tensor:
        floating = value.floating if isinstance(value, Spec) else value.is_floating_point()
        if floating:
            last[0] = next(wanted, last[0])
        if isinstance(value, torch.Tensor):  # an example's own values
            return value.to(device=device, dtype=last[0] if floating and last[0] is not None else value.dtype)
        return _real(value, device, last[0] if floating else None, generator)

    given: list[torch.dtype] = []
    spy = _Spy(call.op)
    try:
        with (
            warnings.catch_warnings(),
            torch.random.fork_rng(devices=[]),
            torch.no_grad(),
            _compat.ExcludeDispatchKeyGuard(_keys()),
        ):
            warnings.simplefilter("ignore")
            args, kwargs = pytree.tree_map(
                lambda v: make(v) if isinstance(v, (Spec, torch.Tensor)) else v, (call.args, call.kwargs)
            )
            given = [t.dtype for t in _floating(args, kwargs)]
            out = spy(*args, **kwargs) if rule is None else rule(spy, device, low, False, args, kwargs)
    except Exception as error:
        text = str(error).strip().splitlines()
        return Outcome(spy.seen or tuple(given), None, text[0] if text else type(error).__name__)
    floating = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return Outcome(spy.seen or tuple(given), floating[0].dtype if floating else None, None)


def callees(call: Call, categories: dict[Op, Category], depth: int = 2) -> list[tuple[Op, Category]]:
    """The ops with a category that an op with none reaches through its CompositeImplicitAutograd kernel."""
    if depth == 0 or not _compat.has_kernel(_tables.qualified(call.op), "CompositeImplicitAutograd"):
        return []

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        return _compat.call_at_key(call.op, "CompositeImplicitAutograd", args, kwargs)

    found: list[tuple[Op, Category]] = []
    for inner in aten_calls(decomposed, call.args, call.kwargs):
        category = categories.get(inner.op)
        if category is not None:
            found.append((inner.op, category))
        else:
            found.extend(callees(inner, categories, depth - 1))
    return found
