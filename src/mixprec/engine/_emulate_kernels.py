"""Matrix products and convolutions in float32, with their backward written out.

Used by ``mixprec.engine._emulate`` for ``compute="emulated"``. A call of an ATen overload (as the kernels at
the Autocast keys make it) is first bound to its op's signature, giving ``(params, tensors)``; a kernel then
runs ``forward(params, *tensors32)`` and, for backward,
``backward(params, needs, shapes, grad32, *saved32)``. Calls that do not bind
(e.g. a convolution with ``padding="same"``) return None here and are
emulated by recomputation instead.

Backward, with ``g`` the float32 gradient of the output::

    linear(x, w, b):        gx = g @ w           gw = g2ᵀ @ x2         gb = Σ g2      (2: rows folded)
    addmm(c, a, b; β, α):   ga = α g @ bᵀ        gb = α aᵀ @ g         gc = β g summed to c's shape
    baddbmm:                as addmm, batched, transposing the last two dimensions
    matmul(a, b):           as mm, with 1-D operands unsqueezed and broadcast dimensions summed;
                            an N-D @ 2-D product is folded to one mm as torch folds it
    convolution:            aten.convolution_backward

A bias of 2 or more dimensions gets ``g`` summed to its shape; the gradient of a column-major (transposed)
matrix operand is column-major, as torch's mm backward lays it out (``_laid_out``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mixprec import _compat

Tensor = torch.Tensor
Grads = tuple[Tensor | None, ...]


def r32(t: Any, low: torch.dtype) -> Any:
    """A tensor's low-precision value in float32: upcast a low tensor, round a float32 one; None stays."""
    if t is None:
        return None
    return t.float() if t.dtype is low else t.to(low).float()


def _down(t: Tensor | None, low: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(low)


class Kernel:
    """One family of ops.

    ``forward`` gets the low-precision inputs; ``backward`` gets the saved
    inputs (``keep`` says which), each either low-precision or the float32
    parameter it was cast from, and returns low-precision gradients.
    """

    keep: tuple[bool, ...] = ()

    def forward(self, params: Any, low: torch.dtype, *tensors: Any) -> Tensor:
        raise NotImplementedError

    def backward(
        self, params: Any, low: torch.dtype, needs: Sequence[bool], shapes: Sequence[Any], g: Tensor, *saved: Any
    ) -> Grads:
        raise NotImplementedError


def _laid_out(grad: Tensor | None, operand: Tensor) -> Tensor | None:
    """``grad`` in the layout torch's mm backward gives a matrix operand's gradient: a column-major operand (a
    transposed weight) gets a column-major one (``mm_mat1_backward``, ``mm_mat2_backward``), any other a
    row-major one."""
    if grad is None or operand.dim() != 2 or operand.stride(0) != 1 or operand.stride(1) != operand.shape[0]:
        return grad
    return grad.mT.contiguous().mT


def _mm_backward(g: Tensor, a: Tensor, b: Tensor, needs: Sequence[bool]) -> tuple[Tensor | None, Tensor | None]:
    ga = _laid_out(g @ b.mT, a) if needs[0] else None
    gb = _laid_out(a.mT @ g, b) if needs[1] else None
    return ga, gb


def _matmul_backward(g: Tensor, a: Tensor, b: Tensor, needs: Sequence[bool]) -> tuple[Tensor | None, Tensor | None]:
    if a.dim() >= 2 and b.dim() == 2:
        g2, a2 = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
        ga, gb = _mm_backward(g2, a2, b, needs)
        return (None if ga is None else ga.reshape(a.shape)), gb
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    g2 = g.unsqueeze(-1) if b.dim() == 1 else g
    g2 = g2.unsqueeze(-2) if a.dim() == 1 else g2
    ga, gb = _mm_backward(g2, a2, b2, needs)
    return (
        None if ga is None else ga.sum_to_size(a2.shape).reshape(a.shape),
        None if gb is None else gb.sum_to_size(b2.shape).reshape(b.shape),
    )


# A linear layer whose float32 output would exceed this many elements is computed
# in slices of output features, so that no float32 copy of the whole output,
# weight or output gradient exists at once (an LM head: 256 x 50257 logits).
CHUNK_ELEMENTS = 1 << 20


def _slices(rows: int, features: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(rows, 1))
    return [slice(j, min(j + step, features)) for j in range(0, features, step)]


def _in_slices(m: int, n: int, vector_bias: bool, probe: Tensor) -> bool:
    """Whether a linear's ``m x n`` output is computed in slices of its columns: where it is large, and its bias
    is none or a vector (a 0-dim or 1-element one broadcast; a 2-D one, as ``addmm`` takes, in one piece). Not
    under a vmap (``probe``: an input, or the output's gradient), torch.func's or the legacy one of
    ``autograd.grad(..., is_grads_batched=True)``: the slices are written in place into buffers without its
    batch dimension."""
    if not vector_bias or len(_slices(m, n)) == 1:
        return False
    return not _compat.functorch_active() and not _compat.batched(probe)


def _linear_forward_sliced(low: torch.dtype, x: Tensor, w: Tensor, c: Tensor | None) -> Tensor:
    c = None if c is None else c.expand(w.shape[0])  # (a 0-dim or 1-element bias broadcast, as F.linear does)
    x32 = x.float()
    out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=low, device=x.device)
    for j in _slices(x32.numel() // max(x.shape[-1], 1), w.shape[0]):
        out[..., j] = torch._C._nn.linear(x32, r32(w[j], low), r32(None if c is None else c[j], low))
    return out


def _linear_backward_sliced(low: torch.dtype, needs: Sequence[bool], g: Tensor, x: Tensor, w: Tensor) -> Grads:
    g2 = g.reshape(-1, g.shape[-1])
    x32 = r32(x, low).reshape(-1, x.shape[-1]) if needs[2] else None
    gx = torch.zeros(x.shape, dtype=torch.float32, device=g.device).reshape(-1, x.shape[-1]) if needs[1] else None
    gw = torch.empty(w.shape, dtype=low, device=g.device) if needs[2] else None
    gc = torch.empty(w.shape[0], dtype=torch.float32, device=g.device) if needs[0] else None  # (summed, then down)
    for j in _slices(g2.shape[0], g2.shape[1]):
        gj = g2[:, j].float()
        if gx is not None:
            gx.addmm_(gj, r32(w[j], low))
        if gw is not None and x32 is not None:
            gw[j] = gj.mT @ x32
        if gc is not None:
            gc[j] = gj.sum(0)
    return gc, _down(None if gx is None else gx.reshape(x.shape), low), gw


class _Product(Kernel):
    """mm, addmm, bmm, baddbmm, matmul, linear: tensors ``(c, a, b)``, params ``(kind, beta, alpha)``."""

    keep = (False, True, True)

    def forward(self, params: Any, low: torch.dtype, *tensors: Any) -> Tensor:
        kind, beta, alpha = params
        c, a, b = tensors
        if kind == "linear" and _in_slices(a.numel() // max(a.shape[-1], 1), b.shape[0], c is None or c.dim() <= 1, a):
            return _linear_forward_sliced(low, a, b, c)
        c, a, b = (r32(t, low) for t in tensors)
        if kind == "linear":
            out = torch._C._nn.linear(a, b, c)
        elif kind == "matmul":
            out = torch.matmul(a, b)
        elif c is None:
            out = torch.mm(a, b) if kind == "mm" else torch.bmm(a, b)
        else:
            add = torch.addmm if kind == "mm" else torch.baddbmm
            out = add(c, a, b, beta=beta, alpha=alpha)
        return out.to(low)

    def backward(
        self, params: Any, low: torch.dtype, needs: Sequence[bool], shapes: Sequence[Any], g: Tensor, *saved: Any
    ) -> Grads:
        kind, beta, alpha = params
        _, a, b = saved
        vector = shapes[0] is None or len(shapes[0]) <= 1
        if kind == "linear" and _in_slices(g.numel() // max(g.shape[-1], 1), g.shape[-1], vector, g):
            gc, ga, gb = _linear_backward_sliced(low, needs, g, a, b)
            gc = None if gc is None else _down(gc.sum_to_size(shapes[0]), low)
            return gc, _laid_out(ga, a), _laid_out(gb, b)
        g, a, b = g.float(), r32(a, low), r32(b, low)
        if kind == "linear":
            g2 = g.reshape(-1, g.shape[-1])
            # (a bias of 2 or more dimensions, as addmm takes: its gradient summed to its shape, not over rows first)
            gc = (g2.sum(0) if vector else g).sum_to_size(shapes[0]) if needs[0] else None
            ga = _laid_out(g @ b, a) if needs[1] else None
            gb = _laid_out(g2.mT @ a.reshape(-1, a.shape[-1]), b) if needs[2] else None
        elif kind == "matmul":
            gc, (ga, gb) = None, _matmul_backward(g, a, b, needs[1:])
        else:
            ga, gb = _mm_backward(g, a, b, needs[1:])
            if alpha != 1:
                ga, gb = (None if t is None else t * alpha for t in (ga, gb))
            gc = (g * beta if beta != 1 else g).sum_to_size(shapes[0]) if needs[0] else None
        return _down(gc, low), _down(ga, low), _down(gb, low)


class _Conv(Kernel):
    """convolution: tensors ``(input, weight, bias)``, params as ``aten.convolution`` takes them."""

    keep = (True, True, False)

    def forward(self, params: Any, low: torch.dtype, *tensors: Any) -> Tensor:
        stride, padding, dilation, transposed, output_padding, groups, unbatched = params
        x, w, c = (r32(t, low) for t in tensors)
        x = x.unsqueeze(0) if unbatched else x
        y = torch.convolution(x, w, c, stride, padding, dilation, transposed, output_padding, groups)
        return (y.squeeze(0) if unbatched else y).to(low)

    def backward(
        self, params: Any, low: torch.dtype, needs: Sequence[bool], shapes: Sequence[Any], g: Tensor, *saved: Any
    ) -> Grads:
        stride, padding, dilation, transposed, output_padding, groups, unbatched = params
        g, x, w = g.float(), r32(saved[0], low), r32(saved[1], low)
        if unbatched:
            x, g = x.unsqueeze(0), g.unsqueeze(0)
        bias_sizes = list(shapes[2]) if needs[2] else None
        gx, gw, gc = torch.ops.aten.convolution_backward(
            g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, list(needs)
        )
        if unbatched and gx is not None:
            gx = gx.squeeze(0)
        return _down(gx, low), _down(gw, low), _down(gc, low)


PRODUCT = _Product()
CONV = _Conv()

Bound = tuple[Any, tuple[Any, ...]]


def _expand(value: Any, n: int) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    return values * n if len(values) == 1 else values


def _conv_params(n: int, transposed: bool) -> Callable[..., Bound]:
    def bind(
        input: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, out_pad: Any, groups: Any
    ) -> Bound:
        if isinstance(padding, str) or not isinstance(input, Tensor):
            return None, ()
        expand = functools.partial(_expand, n=n)
        unbatched = input.dim() == n + 1
        params = (expand(stride), expand(padding), expand(dilation), transposed, expand(out_pad), groups, unbatched)
        return params, (input, weight, bias)

    return bind


def _conv(n: int) -> Callable[..., Bound]:
    params = _conv_params(n, transposed=False)

    def conv(
        input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1
    ) -> Bound:
        return params(input, weight, bias, stride, padding, dilation, 0, groups)

    return conv


def _conv_transpose(n: int) -> Callable[..., Bound]:
    params = _conv_params(n, transposed=True)

    def conv_transpose(
        input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
        output_padding: Any = 0, groups: int = 1, dilation: Any = 1,
    ) -> Bound:  # fmt: skip
        return params(input, weight, bias, stride, padding, dilation, output_padding, groups)

    return conv_transpose


def _convolution(
    input: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
    transposed: bool, output_padding: Any, groups: int,
) -> Bound:  # fmt: skip
    n = weight.dim() - 2
    return _conv_params(n, transposed)(input, weight, bias, stride, padding, dilation, output_padding, groups)


def _mm(input: Any, mat2: Any) -> Bound:
    return ("mm", 1, 1), (None, input, mat2)


def _addmm(input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1) -> Bound:
    return ("mm", beta, alpha), (input, mat1, mat2)


def _bmm(input: Any, mat2: Any) -> Bound:
    return ("bmm", 1, 1), (None, input, mat2)


def _baddbmm(input: Any, batch1: Any, batch2: Any, *, beta: Any = 1, alpha: Any = 1) -> Bound:
    return ("bmm", beta, alpha), (input, batch1, batch2)


def _matmul(input: Any, other: Any) -> Bound:
    return ("matmul", 1, 1), (None, input, other)


def _linear(input: Any, weight: Any, bias: Any = None) -> Bound:
    if not isinstance(weight, Tensor) or weight.dim() != 2:  # (a 1-D weight: recomputed instead)
        return None, ()
    return ("linear", 1, 1), (bias, input, weight)


_BINDERS: dict[str, tuple[Kernel, Callable[..., Bound]]] = {
    "mm": (PRODUCT, _mm),
    "addmm": (PRODUCT, _addmm),
    "bmm": (PRODUCT, _bmm),
    "baddbmm": (PRODUCT, _baddbmm),
    "matmul": (PRODUCT, _matmul),
    "linalg_matmul": (PRODUCT, _matmul),
    "linear": (PRODUCT, _linear),
    "convolution": (CONV, _convolution),
    **{f"conv{n}d": (CONV, _conv(n)) for n in (1, 2, 3)},
    **{f"conv_transpose{n}d": (CONV, _conv_transpose(n)) for n in (1, 2, 3)},
}


@functools.cache
def _table() -> dict[torch._ops.OpOverloadPacket, tuple[Kernel, Callable[..., Bound]]]:
    """The ATen packets a binder serves: the kernels at the Autocast keys reach ``_emulate`` with an overload of
    one of these, never with a Python-level callable such as ``torch.mm``."""
    packets = ((getattr(torch.ops.aten, name, None), entry) for name, entry in _BINDERS.items())
    return {packet: entry for packet, entry in packets if isinstance(packet, torch._ops.OpOverloadPacket)}


def explicit(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Kernel, Any, tuple[Any, ...]] | None:
    """The kernel, params and tensors of a call of the overload ``op`` that has a written-out backward, else
    None."""
    entry = _table().get(getattr(op, "overloadpacket", None))  # type: ignore[arg-type]
    if entry is None:
        return None
    kernel, binder = entry
    if "self" in kwargs:
        kwargs = {("input" if k == "self" else k): v for k, v in kwargs.items()}
    try:
        params, tensors = binder(*args, **kwargs)
    except (TypeError, AttributeError):
        return None
    if params is None:
        return None
    return kernel, params, tensors
