"""Emulated low-precision compute: float32 kernels between low-precision roundings.

Under ``compute="emulated"`` a ``lower_precision_fp`` op still receives its
inputs cast to the autocast dtype (by the usual rule, through the cast cache),
and its result has the dtype native autocast gives. In between::

    forward:   x32 = x_low.float()                  # exact
               y32 = op(x32, ...)                   # float32 kernels
               return y32.to(out)                   # one rounding per output, to the dtype native gives
                                                    # it: an explicit dtype= argument's, else low
    saved:     the low-precision inputs x_low       # activation memory as native; a weight
                                                    # (nn.Parameter cast by autocast) is saved as
                                                    # the parameter itself and re-rounded in backward
    backward:  g32 = grad_low.float(); x32 = x_low.float()
               grad_x32 = op's backward(g32, x32)   # float32 kernels
               return grad_x32.to(low)

Products of low-precision values are exact in float32 and the sums are
accumulated in float32, which is what bfloat16 / float16 matrix units do, so
results agree with native kernels up to accumulation order.

Matrix products (mm, addmm, bmm, baddbmm, matmul, linear) and convolutions
(``mixprec.engine._emulate_kernels``) have their backward written out. Every other
``lower_precision_fp`` op (scaled_dot_product_attention, RNN cells, nn.LSTM /
nn.GRU, ...) goes through ``_Recompute``: it saves the low-precision inputs and
the random-number state, and its backward recomputes the op in float32 from
them, then differentiates that (from the saved inputs themselves under
``create_graph``, so a double backward keeps its second-order terms). A composite (lstm, multi_dot) is rounded at its
boundary only, not between the steps it makes inside.

Saving the parameter rather than its low-precision copy holds no extra memory
(the parameter is resident anyway) and frees the copy when the region exits.
One consequence: like a float32 op, and unlike native autocast, backward raises
if the parameter was modified in place between forward and backward.

Linear layers with a large output (an LM head's logits) are computed in slices
of output features (``_emulate_kernels.CHUNK_ELEMENTS``), so that no float32
copy of the whole output, weight or output gradient is ever made.

An op whose floating inputs are not all in the autocast dtype after casting
(float64 ones, or another low-precision dtype) runs as native autocast runs it.

Under torch.compile and torch.export the op is traced as the three steps of the
forward above (upcast, float32 op, rounding) and autograd differentiates them;
the custom autograd Functions are eager only. The graph's partitioner saves the
low-precision inputs and recomputes their upcast in backward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from mixprec import _compat
from mixprec.engine import _emulate_kernels, _memo

_Tensor = torch.Tensor


class _Busy(threading.local):
    depth = 0


_busy = _Busy()


def busy() -> bool:
    """Whether this thread is inside emulated compute (its casts are the emulation's, not autocast's)."""
    return _busy.depth > 0


@contextlib.contextmanager
def _computing() -> Iterator[None]:
    _busy.depth += 1
    try:
        yield
    finally:
        _busy.depth -= 1


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Autocast off in this thread (a backward may run inside a region, or in a checkpoint's recompute)."""
    with _computing(), torch._C._DisableAutocast():
        yield


def up(t: torch.Tensor | None, low: torch.dtype) -> Any:
    """A low-precision tensor as float32 (exact); anything else unchanged."""
    return t.float() if isinstance(t, _Tensor) and t.dtype is low else t


def down(t: Any, low: torch.dtype) -> Any:
    """A float32 result rounded to the low-precision dtype; anything else unchanged."""
    return t.to(low) if isinstance(t, _Tensor) and t.dtype is torch.float32 else t


def target(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype) -> torch.dtype:
    """The dtype native autocast gives the op's floating outputs: that of an explicit ``dtype`` or ``out_dtype``
    argument (``softmax(x, -1, dtype=torch.float32)``), else the autocast dtype."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return low
    for i, argument in enumerate(schema.arguments):
        if argument.name in ("dtype", "out_dtype"):
            value = kwargs.get(argument.name, args[i] if i < len(args) else None)
            if isinstance(value, torch.dtype):
                return value
    return low


def targets(
    func: Callable[..., Any], args: Any, kwargs: Any, out: torch.dtype, count: int
) -> list[torch.dtype]:
    """The dtype each of a call's ``count`` tensor outputs rounds to: ``out`` (``target``), except where torch's
    own kernel returns float32 for the low-precision inputs ``args, kwargs`` (flash attention's logsumexp,
    ``_fused_rms_norm``'s rstd), read off the op's meta kernel once per op, inputs' dtypes and other arguments."""
    if count <= 1 or not isinstance(func, torch._ops.OpOverload) or len(func._schema.returns) <= 1:
        return [out] * count
    leaves = pytree.tree_leaves((args, kwargs))
    key = (func, *(v.dtype if isinstance(v, _Tensor) else v for v in leaves))
    try:
        hash(key)
    except TypeError:
        return [out] * count

    def meta() -> Any:  # (outside every mode: a trace records nothing of it, a user's mode sees nothing)
        with _compat.outside_modes():
            on_meta = pytree.tree_map(
                lambda v: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") if isinstance(v, _Tensor) else v,
                (args, kwargs),
            )
            return func(*on_meta[0], **on_meta[1])

    found = _native.get(key, _MISSING)
    if found is _MISSING:
        sizes = [n for v in leaves if isinstance(v, _Tensor) for n in v.shape]
        if not all(type(n) is int for n in sizes):  # (a symbolic size: no probe here, where int() would guard)
            return [out] * count
        found = _native.put(key, _meta_dtypes(meta))
    if found is None or len(found) != count:
        return [out] * count
    return [torch.float32 if d is torch.float32 and out is not torch.float32 else out for d in found]


_MISSING: Any = object()
#: ``(op, its inputs' dtypes, its other arguments)`` -> its outputs' dtypes under torch's kernels, or None.
_native: _memo.Memo[Any, tuple[torch.dtype, ...] | None] = _memo.Memo(512, "emulated outputs' dtypes")


def _meta_dtypes(run: Callable[[], Any]) -> tuple[torch.dtype, ...] | None:
    """The dtypes of the tensors ``run()`` returns (a call on meta tensors), or None where it cannot run."""
    try:
        with torch._C._DisableAutocast():
            return tuple(t.dtype for t in pytree.tree_leaves(run()) if isinstance(t, _Tensor))
    except Exception:  # (an op without a meta kernel: every output rounds to the target)
        return None


def _all_low(tensors: Iterator[Any], low: torch.dtype, others: bool = True) -> bool:
    """Whether the call's floating tensors are all in ``low`` (and there is one); ``others``: whether tensors of
    other kinds (integer, bool) may be among them, as an RNN's batch sizes are (a matrix product's kernel would
    round them to ``low`` and run, where native refuses the mix)."""
    seen = False
    for t in tensors:
        if isinstance(t, _Tensor):
            if t.is_floating_point() or t.is_complex():
                if t.dtype is not low:
                    return False
                seen = True
            elif not others:
                return False
    return seen


def _needs_graph(tensors: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, _Tensor) and t.requires_grad for t in tensors)


def _saved(tensors: Sequence[Any], sources: Sequence[Any], keep: Sequence[bool]) -> list[Any]:
    """What to save: the float32 parameter a low-precision copy came from, else the copy itself."""
    return [
        None if not k else (src if src is not None else t) for t, src, k in zip(tensors, sources, keep, strict=True)
    ]


class _Explicit(torch.autograd.Function):
    """A matrix product or convolution with its backward written out (``_emulate_kernels``)."""

    @staticmethod
    def forward(
        ctx: Any, kernel: _emulate_kernels.Kernel, params: Any, low: torch.dtype, sources: Any, *tensors: Any
    ) -> Any:
        ctx.kernel, ctx.params, ctx.low = kernel, params, low
        ctx.shapes = tuple(None if t is None else t.shape for t in tensors)
        ctx.save_for_backward(*_saved(tensors, sources, kernel.keep))
        return kernel.forward(params, low, *tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        with paused():
            grads = ctx.kernel.backward(
                ctx.params, ctx.low, ctx.needs_input_grad[4:], ctx.shapes, grad, *ctx.saved_tensors
            )
        return (None, None, None, None, *grads)


_SLOT = object()


class _Call:
    """A call with its tensor leaves taken out: ``call(*tensors)`` runs it, outputs flattened."""

    def __init__(self, func: Callable[..., Any], leaves: list[Any], where: list[int], spec: Any) -> None:
        self.func, self.where, self.spec = func, where, spec
        self.leaves = [None if isinstance(v, _Tensor) else v for v in leaves]
        self.out_spec: Any = None
        self.out_other: list[Any] = []  # the non-tensor output leaves, _SLOT where a tensor goes

    def arguments(self, *tensors: Any) -> tuple[Any, Any]:
        leaves = list(self.leaves)
        for i, t in zip(self.where, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)  # type: ignore[no-any-return]

    def rounding(self, tensors: Sequence[Any], out: torch.dtype, count: int) -> list[torch.dtype]:
        """``targets`` for the call on ``tensors`` (its low-precision inputs)."""
        return targets(self.func, *self.arguments(*tensors), out, count)

    def __call__(self, *tensors: Any) -> list[Any]:
        args, kwargs = self.arguments(*tensors)
        out_leaves, self.out_spec = pytree.tree_flatten(self.func(*args, **kwargs))
        self.out_other = [_SLOT if isinstance(v, _Tensor) else v for v in out_leaves]
        return out_leaves

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if v is _SLOT else v for v in self.out_other]
        return pytree.tree_unflatten(leaves, self.out_spec)


class _Recompute(torch.autograd.Function):
    """Any other op: saves the low-precision inputs, recomputes in float32 for backward."""

    @staticmethod
    def forward(ctx: Any, call: _Call, low: torch.dtype, out: torch.dtype, sources: Any, *tensors: Any) -> Any:
        ctx.call, ctx.low = call, low
        ctx.rng = torch.get_rng_state()
        ctx.devices, ctx.device_rng = get_device_states(*tensors)
        ctx.save_for_backward(*_saved(tensors, sources, [True] * len(tensors)))
        found = call(*(up(t, low) for t in tensors))
        # Where the tensors are among the outputs: a recompute with grad on may return more of them
        # (mkldnn_rnn_layer's workspace is undefined without grad).
        ctx.positions = [i for i, t in enumerate(found) if isinstance(t, _Tensor)]
        dtypes = call.rounding(tensors, out, len(ctx.positions))
        outs = tuple(down(found[i], d) for i, d in zip(ctx.positions, dtypes, strict=True))
        ctx.mark_non_differentiable(*(t for t in outs if not t.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        low, saved = ctx.low, ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        # A double backward (create_graph) differentiates the gradients: the recompute then starts from the
        # saved inputs themselves (their upcast, or a parameter's rounding, is differentiable), not from
        # copies cut off from the graph, whose second-order terms would be lost.
        second = torch.is_grad_enabled()
        inputs = [
            (_emulate_kernels.r32(t, low) if second and t.requires_grad else
             _emulate_kernels.r32(t, low).detach().requires_grad_(need)) if _is_low(t, low) else t
            for t, need in zip(saved, needs, strict=True)
        ]
        with torch.random.fork_rng(devices=ctx.devices), paused(), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            set_device_states(ctx.devices, ctx.device_rng)
            again = ctx.call(*inputs)
            outs = [again[i] for i in ctx.positions]
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs],
                wanted,
                [up(g, low) for _, g in pairs],
                allow_unused=True,
                create_graph=torch.is_grad_enabled(),
            )
            if pairs and wanted
            else [None] * len(wanted)
        )
        return (None, None, None, None, *(down(next(found), low) if need else None for need in needs))


def _sources(tensors: Sequence[Any], originals: Sequence[Any]) -> tuple[Any, ...]:
    """For each input, the float32 ``nn.Parameter`` it was cast from, else None.

    A parameter stays resident anyway, so backward re-rounds it instead of
    keeping a low-precision copy alive: the weights cost no saved memory.
    """
    return tuple(
        o if o is not t and isinstance(o, torch.nn.Parameter) and o.dtype is torch.float32 and o.requires_grad else None
        for t, o in zip(tensors, originals, strict=True)
    )


def _is_low(t: Any, low: torch.dtype) -> bool:
    return isinstance(t, _Tensor) and (t.dtype is low or t.dtype is torch.float32)


def _generic(low: torch.dtype, func: Callable[..., Any], cast: tuple[Any, Any], original: tuple[Any, Any]) -> Any:
    leaves, spec = pytree.tree_flatten(cast)
    if not _all_low(iter(leaves), low):
        return func(*cast[0], **cast[1])
    where = [i for i, v in enumerate(leaves) if isinstance(v, _Tensor)]
    if any(leaves[i].is_nested for i in where):
        return func(*cast[0], **cast[1])  # (as in _eager)
    call = _Call(func, leaves, where, spec)
    tensors = [leaves[i] for i in where]
    out = target(func, *cast, low)
    if _needs_graph(tensors):
        originals = pytree.tree_leaves(original)
        sources = (
            _sources(tensors, [originals[i] for i in where]) if len(originals) == len(leaves) else (None,) * len(where)
        )
        return call.rebuild(_Recompute.apply(call, low, out, sources, *tensors))
    found = [t for t in call(*(up(t, low) for t in tensors)) if isinstance(t, _Tensor)]
    dtypes = call.rounding(tensors, out, len(found))
    return call.rebuild([down(t, d) for t, d in zip(found, dtypes, strict=True)])


def call(
    low: torch.dtype,
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    original: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """Run a ``lower_precision_fp`` op emulated.

    Args:
        low: The autocast dtype.
        func: The op.
        args, kwargs: The call's arguments, cast to ``low`` by the autocast rule.
        original: The arguments before that cast, to find the parameters the casts came from.
    """
    if _compat.tracing():
        return _traced(low, func, args, kwargs)
    if _compat.no_autograd_function() is not None:  # (torch.func, forward AD): the op as native runs it
        return func(*args, **kwargs)
    with _computing():
        return _eager(low, func, (args, kwargs), original)


def _eager(low: torch.dtype, func: torch._ops.OpOverload, cast: tuple[Any, Any], original: tuple[Any, Any]) -> Any:
    args, kwargs = cast
    found = _emulate_kernels.explicit(func, args, kwargs)
    if found is None:
        return _generic(low, func, (args, kwargs), original)
    kernel, params, tensors = found
    if any(isinstance(t, _Tensor) and t.is_nested for t in tensors):
        return func(*args, **kwargs)  # (a strided nested tensor has no sizes, nor a custom Function's backward)
    if not _all_low(iter(tensors), low, others=False):
        return func(*args, **kwargs)
    if not _needs_graph(tensors):
        return kernel.forward(params, low, *tensors)
    bound = _emulate_kernels.explicit(func, *original)
    sources = _sources(tensors, bound[2]) if bound is not None else (None,) * len(tensors)
    return _Explicit.apply(kernel, params, low, sources, *tensors)


def _traced(low: torch.dtype, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The emulated op as a trace sees it: upcast, the float32 op, one rounding per output."""
    leaves = pytree.tree_leaves((args, kwargs))
    if not _all_low(iter(leaves), low):
        return func(*args, **kwargs)
    _compat.keep_roundings()  # (inductor would fold the roundings below into their consumers' upcasts)
    out = target(func, args, kwargs, low)
    upcast = pytree.tree_map(lambda v: up(v, low), (args, kwargs))
    found, spec = pytree.tree_flatten(func(*upcast[0], **upcast[1]))
    dtypes = iter(targets(func, args, kwargs, out, sum(isinstance(v, _Tensor) for v in found)))
    rounded = [down(v, next(dtypes)) if isinstance(v, _Tensor) else v for v in found]
    return pytree.tree_unflatten(rounded, spec)
