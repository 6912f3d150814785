"""fp8 compute: a linear's three GEMMs in fp8 through ``torch._scaled_mm``, as an ``fp8`` op runs them.

For ``y = x @ w.t() + b`` (``x`` flattened to 2-D, ``M x K``; ``w`` is ``N x K``) under an ``Fp8Recipe``::

    forward   xq, sx = quantise(x, recipe.forward)          wq, sw = quantise(w, recipe.forward)
              y  = _scaled_mm(xq, wq.t(), 1/sx, 1/sw, out_dtype) + b          (float32 accumulation, or
                                                                   the tensor cores': use_fast_accum)
    backward  gq, sg = quantise(grad_y, recipe.backward)
              grad_x = _scaled_mm(gq, w's fp8 as a column-major N x K, ...)   (grad_y @ w)
              grad_w = _scaled_mm(gq.t() row-major, x's fp8 column-major, ...)  (grad_y.t() @ x)
              grad_b = grad_y summed over rows
              (each only where autograd asks for it: a frozen weight's layer runs grad_x's GEMM alone)

    quantise(t, format): scale = finfo(format).max / max(amax(t), eps)   [rounded down to 2**k: power_of_2]
                         q = clamp(t * scale, ±finfo(format).max).to(format), and 1/scale for _scaled_mm
                         (delayed: an inf in t becomes NaN, not the largest value: the GradScaler sees it)

Tensorwise scaling takes one amax per tensor; rowwise one per row of each GEMM operand along the contracted
dimension, so each GEMM requantises its operands from the high-precision tensors saved in forward.
Quantisation is plain torch ops (amax, multiply, clamp, cast), which a compiler can fuse; only
``_scaled_mm`` is opaque. In eager mode a weight's quantisation is kept as native autocast keeps a weight's
cast: until the region ends (the thread's outermost mixprec region exits, or torch clears its autocast cache,
as a plain ``torch.autocast`` region does as it exits: ``_cast``), and only while the weight's version
counter, storage, dtype and the process's count of optimizer steps are unchanged (``quantise_weight``). So a
weight is quantised once per region however often it is used, and an update no version counter sees (through
``.data``, ``module.to``) between regions is always seen.

``_scaled_mm`` on CUDA takes a row-major first operand, a column-major second one, dimensions that are
multiples of 16, and at most one e5m2 operand; on CPU it takes more. Every device gets CUDA's rules here
(``aligned`` and the layouts below), so CPU tests catch what a GPU would refuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from mixprec import _compat, _errors
from mixprec.engine import _amax, _state
from mixprec.policies._format import FORMATS
from mixprec.policies._recipe import Fp8Recipe

ALIGNMENT = 16  # every GEMM dimension a multiple of this (CUDA's rule)
_NAN = float("nan")


def format_dtype(name: str) -> torch.dtype:
    """The fp8 dtype of a recipe's format name."""
    dtype = FORMATS[name].dtype
    if dtype is None or not dtype.is_floating_point or dtype.itemsize != 1:
        raise ValueError(
            _errors.message("Not an fp8 format", "an fp8 recipe quantises to one", received={"format": name})
        )
    return dtype


def scale(amax: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe) -> torch.Tensor:
    """The multiplier that maps ``amax`` to ``dtype``'s largest value (float32; eps guards a zero amax)."""
    factor = torch.finfo(dtype).max / amax.float().clamp(min=recipe.eps)
    if recipe.power_of_2:
        factor = torch.exp2(torch.floor(torch.log2(factor)))
    return factor


def absmax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The largest magnitude in ``t`` (``dim`` None), or along ``dim`` (kept as a size-1 dim): what a scale is
    taken from. (One function, so ``tools/fp8_tuning.py`` can time other ways of reducing on a GPU.)"""
    return t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)


def quantise(
    t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, dim: int | None, site: _amax.Site | None = None,
    row: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, inverse_scale)``: ``t`` scaled, clamped and cast to ``dtype`` (row-major), and what ``_scaled_mm``
    multiplies it back by. ``dim`` None: one scale for the tensor; else one per slice along ``dim`` (kept as a
    size-1 dim). With a delayed recipe's ``site``, the scale comes from its history's ``row``."""
    amax = absmax(t.detach(), dim)
    if site is not None:
        amax = site.amax(row, amax)
    factor = scale(amax, dtype, recipe)
    limit = torch.finfo(dtype).max
    scaled = t.detach().float() * factor
    q = scaled.clamp(-limit, limit)
    if site is not None:  # a delayed scale is finite whatever t holds: an inf must not saturate but turn NaN (the
        q = torch.where(scaled.isinf(), _NAN, q)  # cast saturates e4m3's), so the GradScaler skips the step; a
        # dynamic scale makes an inf NaN already (its amax is inf: inf * 0)
    return q.to(dtype).contiguous(), factor.reciprocal()  # (row-major whatever t's strides)


#: A weight's quantisations: ``(id(source), the weight's shape, strides and dtype, fp8 dtype, recipe, dim)`` ->
#: (a weak reference to the source, its ``_amax.stamp`` and the weight's data pointer and storage offset then,
#: ``(q, inverse_scale)``, the delayed recipe's site and its count of recorded steps then, or None and 0). An
#: in-place update bumps the version, an optimizer step the process's step count (FSDP2 keeps the version of the
#: weight it gathers into), ``p.data = ...`` moves the data, so an entry is used only while the weight is
#: unchanged, and replaced when it changes (one per weight and view, however long the region); the region's end
#: drops them all (``clear_weight_cache``).
_weights: dict[
    tuple[Any, ...], tuple[Any, tuple[Any, ...], tuple[torch.Tensor, torch.Tensor], _amax.Site | None, int]
] = {}


def quantise_weight(
    weight: torch.Tensor,
    source: torch.Tensor,
    dtype: torch.dtype,
    recipe: Fp8Recipe,
    dim: int | None,
    site: _amax.Site | None = None,
    keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise`` for a weight, kept (where ``keep``: a call in a region) while its ``source`` (the tensor the
    call got: the weight itself, or the ``other`` that ``mm`` multiplies by, of which the weight is the
    transpose) is unchanged, for the region (not while tracing: a compiled graph quantises in the graph, where
    the compiler fuses it).
    Under ``inference_mode`` it is made outside that mode, as a normal tensor: it carries no autograd history,
    and a differentiable call later in the step may save it for backward.

    Under a delayed recipe (``site``, rolled to this step) a kept quantisation also needs the same site at the
    same count of recorded steps: the scale comes from the site's history, which moves only when a step begins
    (a new stamp) or a saved history is loaded (a new site), and the weight's amax, recorded in the step's
    pending amaxes at its first call, is the same at every later call of the step."""
    if _compat.tracing() or not keep:
        return quantise(weight, dtype, recipe, dim, site, _amax.WEIGHT)
    key = (id(source), tuple(weight.shape), weight.stride(), weight.dtype, dtype, recipe, dim)
    # (where the weight's data lives: a step may move it, ``p.data = ...``, and the entry it had is replaced)
    now = (_amax.stamp(source), weight.data_ptr(), weight.storage_offset())
    found = _weights.get(key)
    filled = 0 if site is None else site.filled
    if found is not None and found[0]() is source and found[1] == now and found[3] is site and found[4] == filled:
        return found[2]
    # (a normal tensor under inference_mode: a differentiable call later in the step saves it)
    with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
        out = quantise(weight, dtype, recipe, dim, site, _amax.WEIGHT)

    def forget(_: object) -> None:
        _weights.pop(key, None)

    _weights[key] = (weakref.ref(source, forget), now, out, site, filled)
    return out


def clear_weight_cache() -> None:
    """Drop every kept weight quantisation (as a region ends: ``_cast``; and ``mixprec.engine.reset``)."""
    if _weights:
        _weights.clear()


def aligned(m: int, k: int, n: int) -> bool:
    """Whether an ``m x k`` by ``k x n`` GEMM meets ``_scaled_mm``'s size rule on CUDA."""
    return m % ALIGNMENT == 0 and k % ALIGNMENT == 0 and n % ALIGNMENT == 0


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t()`` as a row-major copy: the layout a backward GEMM takes an operand in (``_column_major``, and the
    weight gradient's first operand). (One function, so ``tools/fp8_tuning.py`` can time other copies.)"""
    return t.t().contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return transposed(t).t()


def scaled_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` in ``out_dtype`` with float32 accumulation (``use_fast_accum``: the tensor
    cores' own, on CUDA): ``a`` row-major, ``b`` column-major, as CUDA requires (refused otherwise, on every
    device)."""
    (m, k), n = a.shape, b.shape[1]
    if a.dtype is torch.float8_e5m2 and b.dtype is torch.float8_e5m2:
        raise RuntimeError(
            _errors.message(
                "An fp8 GEMM was called with two e5m2 operands, which CUDA refuses",
                "torch._scaled_mm on CUDA takes at most one float8_e5m2 operand",
                received={"a": str(a.dtype), "b": str(b.dtype)},
                fix="This is a mixprec bug: a recipe's forward format is e4m3 (Fp8Recipe refuses e5m2 there).",
            )
        )
    if not aligned(m, k, n) or not a.is_contiguous() or not b.t().is_contiguous():
        raise RuntimeError(
            _errors.message(
                "An fp8 GEMM was called with shapes or layouts CUDA refuses",
                "torch._scaled_mm on CUDA needs a row-major first operand, a column-major second one and "
                f"every dimension a multiple of {ALIGNMENT}",
                received={"a": f"{list(a.shape)} stride {a.stride()}", "b": f"{list(b.shape)} stride {b.stride()}"},
                fix="This is a mixprec bug: ops with unaligned shapes run in the region's dtype instead.",
            )
        )
    return _compat.scaled_mm(a, b, a_inv, b_inv, out_dtype, use_fast_accum)


@dataclasses.dataclass(frozen=True)
class Fp8Call:
    """What one fp8 linear's forward did, for an observer (the doctor): the high-precision input (``x``, 2-D)
    and weight, their fp8 values and inverse scales, the bias and the output (2-D)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    xq: torch.Tensor
    x_inverse_scale: torch.Tensor
    wq: torch.Tensor
    w_inverse_scale: torch.Tensor
    out: torch.Tensor
    recipe: Fp8Recipe
    token: object  # the same object in the ``Fp8Grad`` of this call's backward


@dataclasses.dataclass(frozen=True)
class Fp8Grad:
    """What an observed fp8 linear's backward did: the incoming gradient (2-D), its fp8 values and inverse
    scale as the ``grad_x`` GEMM takes them, and the ``token`` of its forward's ``Fp8Call``."""

    grad: torch.Tensor
    gq: torch.Tensor
    g_inverse_scale: torch.Tensor
    token: object


#: Called with each fp8 linear's ``Fp8Call`` (and, in the backward of an observed call, its ``Fp8Grad``) while
#: not empty (the doctor's recorder adds one while it runs).
observers: list[Callable[[Fp8Call | Fp8Grad], None]] = []


def _grad_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Fp8Recipe,
        out_dtype: torch.dtype,
        source: torch.Tensor | None,
    ) -> torch.Tensor:
        source = weight if source is None else source
        rowwise = recipe.scaling == "rowwise"
        forward = format_dtype(recipe.forward)
        x2 = x.reshape(-1, x.shape[-1])
        # Under inference_mode (an evaluation: no backward can follow) a delayed recipe scales dynamically, as
        # tensorwise does: no history is made, rolled (a collective under a process group, which ranks not
        # evaluating never join) or recorded, so evaluation data never reach training's scales. (Not so under a
        # plain no_grad, which a training forward may hold too: inside a reentrant checkpoint's forward it cannot
        # be told from the checkpoint's own, and its recompute must scale as the forward did.)
        delayed = recipe.scaling == "delayed" and not torch.is_inference_mode_enabled()
        site = _amax.site(source, recipe.history) if delayed else None
        xq, sx = quantise(x2, forward, recipe, 1 if rowwise else None, site, _amax.INPUT)
        wq, sw = quantise_weight(weight, source, forward, recipe, 1 if rowwise else None, site)
        w_inv = sw.reshape(1, -1) if rowwise else sw
        y = scaled_mm(xq.contiguous(), sx, wq.t(), w_inv, out_dtype, recipe.use_fast_accum)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.token = None
        if observers:
            ctx.token = object()
            seen = Fp8Call(x2.detach(), weight.detach(), bias, xq, sx, wq, sw.reshape(-1, 1) if rowwise else sw,
                           y.detach(), recipe, ctx.token)  # fmt: skip
            for observe in list(observers):
                observe(seen)
        # Only what the gradients asked for need: grad_x takes the weight, grad_w the input (a frozen weight's
        # layer, a first layer's data input: one backward GEMM, and one operand kept, instead of two).
        need_x, need_w = ctx.needs_input_grad[:2]
        if rowwise:  # each backward GEMM scales along its own contracted dimension: requantise from these
            ctx.save_for_backward(x2 if need_w else None, weight if need_x else None)
        else:
            ctx.save_for_backward(xq if need_w else None, sx, wq if need_x else None, sw)
        ctx.recipe, ctx.shape, ctx.has_bias, ctx.site, ctx.source = recipe, x.shape, bias is not None, site, source
        ctx.dtypes = (_grad_dtype(x), _grad_dtype(weight), bias.dtype if bias is not None else None)
        return y  # (2-D: ``linear`` gives it x's leading dimensions outside, so the output is no view of it)

    @staticmethod
    @once_differentiable  # (its GEMMs take quantised copies: a double backward raises, not silently zero)
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        recipe: Fp8Recipe = ctx.recipe
        backward, forward = format_dtype(recipe.backward), format_dtype(recipe.forward)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = grad_y.reshape(-1, grad_y.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        observed = ctx.token is not None and bool(observers)
        grad_x = grad_w = gq = sg = None
        if recipe.scaling == "rowwise":
            x2, weight = ctx.saved_tensors
            if need_x or observed:
                gq, sg = quantise(g, backward, recipe, 1)  # grad_x = g @ w: contracted over N
            if need_x:
                # (kept only in a region: after it, as a backward usually runs, nothing would drop it before the
                # next region's end, and a weight changed through ``.data`` in between would be quantised stale)
                in_region = bool(_state.get().frames) or torch.is_autocast_enabled(weight.device.type)
                wq_cols, sw_cols = quantise_weight(weight, ctx.source, forward, recipe, 0, keep=in_region)
                grad_x = scaled_mm(gq.contiguous(), sg, _column_major(wq_cols), sw_cols, x_dtype)  # type: ignore[union-attr,arg-type]
            if need_w:
                gq_cols, sg_cols = quantise(g, backward, recipe, 0)  # grad_w = g.t() @ x: contracted over M
                xq_cols, sx_cols = quantise(x2, forward, recipe, 0)
                a, a_inv = transposed(gq_cols), sg_cols.reshape(-1, 1)  # (a transpose keeps its strides)
                grad_w = scaled_mm(a, a_inv, _column_major(xq_cols), sx_cols, w_dtype)
        else:
            xq, sx, wq, sw = ctx.saved_tensors
            gq, sg = quantise(g, backward, recipe, None, ctx.site, _amax.GRAD)  # (records its amax, delayed)
            if need_x:
                grad_x = scaled_mm(gq.contiguous(), sg, _column_major(wq), sw, x_dtype)
            if need_w:
                grad_w = scaled_mm(transposed(gq), sg, _column_major(xq), sx, w_dtype)
        if observed:
            seen = Fp8Grad(g.detach(), gq, sg, ctx.token)  # type: ignore[arg-type]
            for observe in list(observers):
                observe(seen)
        grad_b = g.float().sum(0).to(b_dtype) if ctx.has_bias and need_b else None
        return None if grad_x is None else grad_x.reshape(ctx.shape), grad_w, grad_b, None, None, None


class Gemm(NamedTuple):
    """A call fp8 can run, as ``F.linear(x, weight, bias)``; ``source`` is the tensor the weight comes from
    (``_source``: the weight, or the ``other`` of ``mm`` whose transpose it is, or what either is a whole view
    of), which keys its kept quantisation and its amax history: a transpose made per call is a new tensor each
    time."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    source: torch.Tensor


def _eligible(t: object, device_type: str) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and t.device.type == device_type
        and t.layout is torch.strided
    )


def _source(t: torch.Tensor) -> torch.Tensor:
    """The tensor a call's weight comes from: ``t``, or the tensor ``t`` is a whole view of (``w.t()`` made per
    call), so that the same weight keys the same kept quantisation and history from call to call. A view of
    part of a buffer (FSDP1's parameters in its flat parameter) is its own source."""
    base = t._base
    return base if base is not None and base.numel() == t.numel() else t


def _positional(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's positional parameters (by the op's schema) given positionally, as the dispatcher passes them:
    a Python-level call (``explain``'s mode sees them) may name them, ``F.linear(input=x, weight=w)``, and
    torch's functions name the schema's ``self`` ``input``."""
    if not kwargs:
        return args, kwargs
    given, rest = list(args), dict(kwargs)
    for parameter in [a for a in op._schema.arguments if not a.kwarg_only][len(given):]:
        key = parameter.name if parameter.name in rest else "input" if parameter.name == "self" else None
        if key not in rest:
            break
        given.append(rest.pop(key))
    return tuple(given), rest


def fit(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> Gemm | str:
    """``Gemm(x, weight, bias, source)`` such that the call is ``F.linear(x, weight, bias)`` and fp8 can run it:
    a linear, mm, addmm (beta = alpha = 1, a 1-D bias) or matmul of a 2-D second operand, on float32, bfloat16
    or float16 tensors of the region's device whose GEMM sizes are multiples of 16; for any other call, why not
    (it runs in the region's dtype instead). The kernels and ``explain`` both ask this."""
    name = op.overloadpacket.__name__
    if op._overloadname != "default":
        return f"the {op._overloadname} overload is not a plain GEMM"
    args, kwargs = _positional(op, args, kwargs)
    if name == "linear":
        x, weight, bias = (*args, None, None)[:3] if not kwargs else (args[0], args[1], kwargs.get("bias"))
        source = _source(weight)
    elif name in ("mm", "matmul") and len(args) + len(kwargs) == 2:
        x, other = args[0], args[1]
        if not (isinstance(other, torch.Tensor) and other.dim() == 2):
            return "its second operand is not 2-D (a batched matmul)"
        weight, bias, source = other.t(), None, _source(other)
    elif name == "addmm" and len(args) == 3:
        bias, x, other = args
        if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            return "addmm with beta or alpha other than 1"
        if not (isinstance(other, torch.Tensor) and isinstance(bias, torch.Tensor) and bias.dim() == 1):
            return "addmm whose bias is not 1-D"
        weight, source = other.t(), _source(other)
    else:
        return f"{name} with these arguments is not a linear"
    if not (_eligible(x, device_type) and _eligible(weight, device_type)) or weight.dim() != 2 or x.dim() < 2:
        return f"an operand is not a float32, bfloat16 or float16 matrix on the {device_type} device"
    if bias is not None and (not _eligible(bias, device_type) or bias.shape != (weight.shape[0],)):
        return "its bias is not a vector of the output's size on the device"
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() == 0:
        return "its operands' sizes do not match, or it is empty"
    m = x.numel() // k
    if not aligned(m, k, n):
        return f"its GEMM is {m} x {k} x {n}, not multiples of {ALIGNMENT}"
    return Gemm(x, weight, bias, source)


def as_linear(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str) -> Gemm | None:
    """``fit``'s ``Gemm``, or None where fp8 cannot run the call."""
    found = fit(op, args, kwargs, device_type)
    return None if isinstance(found, str) else found


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8Recipe,
    out_dtype: torch.dtype,
    source: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in fp8 under ``recipe``, the output in ``out_dtype``.
    The caller checks ``aligned`` first (an unaligned call runs in the region's dtype instead). ``source``
    (default: the weight) keys the weight's kept quantisation and, under a delayed recipe, its amax history
    (``_amax``)."""
    if source is weight or _compat.tracing():  # (a compiled graph keeps nothing per weight; and dynamo refuses
        source = None  # a tensor given to a Function twice)
    y = _Fp8Linear.apply(x, weight, bias, recipe, out_dtype, source)
    # An autograd Function's output that is a view refuses in-place ops (``y += 1`` after a layer, as native
    # allows), and FSDP2 warns of a module returning one: shaped out here, by a view autograd knows.
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])  # type: ignore[no-any-return]
