"""Python ports of C++ composites, so that the listed ops inside them are autocast.

Native autocast sits in the dispatcher, below C++ composites such as
``aten::pad``, and so casts the ops they reach. The interception mode sits
above them and sees only the composite. Where a composite reaches a listed op
on some paths only, it cannot be given one category; its port runs the same
inner ops, op for op, as the C++ source does, and the mode intercepts each.

A port is used as the composite's twin (see ``mixprec._expand``): it runs with
the mode pushed, and a call it makes back to the composite itself (for the
error paths) runs natively.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_KINDS = {"reflect": "reflection_pad", "replicate": "replication_pad", "circular": None}


def pad(input: torch.Tensor, pad: Any, mode: str = "constant", value: float | None = None) -> torch.Tensor:
    """``aten::pad`` (aten/src/ATen/native/PadNd.cpp).

    Algorithm::

        constant                       -> constant_pad_nd(input, pad, value or 0)
        reflect/replicate/circular with len(pad) == 2k (k = 1, 2, 3) and input.dim() in (k + 1, k + 2)
                                       -> reflection_padkd / replication_padkd / _pad_circular
        anything else                  -> aten::pad itself, which raises ATen's error
    """
    if mode == "constant":
        return torch.constant_pad_nd(input, pad, 0.0 if value is None else value)
    k = len(pad) // 2
    if mode in _KINDS and (value is None or value == 0) and len(pad) in (2, 4, 6) and input.dim() in (k + 1, k + 2):
        kind = _KINDS[mode]
        if kind is None:
            return torch._C._nn._pad_circular(input, pad)  # type: ignore[attr-defined]
        return getattr(torch._C._nn, f"{kind}{k}d")(input, pad)
    return torch._C._nn.pad(input, pad, mode, value)


def _cell_ok(input: Any, hiddens: Any, w_ih: Any, w_hh: Any) -> bool:
    """The shape checks of ATen's RNN cells (check_rnn_cell_forward_input/hidden) hold: the port may run."""
    tensors = (input, *hiddens, w_ih, w_hh)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors):
        return False
    return input.size(1) == w_ih.size(1) and all(
        h.size(0) == input.size(0) and h.size(1) == w_hh.size(1) for h in hiddens
    )


def lstm_cell(
    input: torch.Tensor, hx: Any, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Any = None, b_hh: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::lstm_cell`` on CPU tensors (aten/src/ATen/native/RNN.cpp, ``LSTMCell``).

    Algorithm::

        gates = linear(h, w_hh, b_hh).add_(linear(input, w_ih, b_ih))
        i, f, g, o = gates.unsafe_chunk(4, 1) -> sigmoid_, sigmoid_, tanh_, sigmoid_
        cy = (f * cx).add_(i * g);  hy = o * cy.tanh()
    """
    if len(hx) != 2 or not input.is_cpu or not _cell_ok(input, hx, w_ih, w_hh):
        return torch.lstm_cell(input, hx, w_ih, w_hh, b_ih, b_hh)  # ATen's own path and errors
    h, c = hx
    gates = torch._C._nn.linear(h, w_hh, b_hh).add_(torch._C._nn.linear(input, w_ih, b_ih))
    i, f, g, o = gates.unsafe_chunk(4, 1)
    i, f, g, o = i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = (f * c).add_(i * g)
    return o * cy.tanh(), cy


def gru_cell(
    input: torch.Tensor, hx: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Any = None, b_hh: Any = None
) -> torch.Tensor:
    """``aten::gru_cell`` on CPU tensors (aten/src/ATen/native/RNN.cpp, ``GRUCell``).

    Algorithm::

        ri, zi, ni = linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
        rh, zh, nh = linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
        r = rh.add_(ri).sigmoid_();  z = zh.add_(zi).sigmoid_();  n = ni.add(nh.mul_(r)).tanh_()
        hy = (hx - n).mul_(z).add_(n)
    """
    if not input.is_cpu or not _cell_ok(input, (hx,), w_ih, w_hh):
        return torch.gru_cell(input, hx, w_ih, w_hh, b_ih, b_hh)
    ri, zi, ni = torch._C._nn.linear(input, w_ih, b_ih).unsafe_chunk(3, 1)
    rh, zh, nh = torch._C._nn.linear(hx, w_hh, b_hh).unsafe_chunk(3, 1)
    reset = rh.add_(ri).sigmoid_()
    update = zh.add_(zi).sigmoid_()
    new = ni.add(nh.mul_(reset)).tanh_()
    return (hx - new).mul_(update).add_(new)


def _gru_layer(x: torch.Tensor, h: torch.Tensor, cell: tuple[Any, ...], reverse: bool) -> tuple[torch.Tensor, Any]:
    """ATen's ``FullLayer`` on CPU: the input projection for all steps at once, then one cell per step."""
    w_ih, w_hh, b_ih, b_hh = cell
    steps = list(torch._C._nn.linear(x, w_ih, b_ih).unbind(0))
    outputs = []
    for step in reversed(steps) if reverse else steps:
        ri, zi, ni = step.unsafe_chunk(3, 1)
        rh, zh, nh = torch._C._nn.linear(h, w_hh, b_hh).unsafe_chunk(3, 1)
        reset = rh.add_(ri).sigmoid_()
        update = zh.add_(zi).sigmoid_()
        new = ni.add(nh.mul_(reset)).tanh_()
        h = (h - new).mul_(update).add_(new)
        outputs.append(h)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), h


def _gru_ok(input: Any, hx: Any, params: Any, has_biases: Any, num_layers: Any, bidirectional: Any) -> bool:
    """The dense-input overload with consistent shapes on CPU: the port may run (else ATen runs and checks)."""
    if not (isinstance(input, torch.Tensor) and isinstance(hx, torch.Tensor) and isinstance(params, (list, tuple))):
        return False
    cells = num_layers * (2 if bidirectional else 1)
    return (
        input.is_cpu and input.dim() == 3 and input.size(0) > 0 and hx.dim() == 3 and hx.size(0) == cells
        and len(params) == cells * (4 if has_biases else 2)
    )


def gru(
    input: Any, hx: Any, params: Any, has_biases: Any, num_layers: Any, dropout: Any, train: Any,
    bidirectional: Any, batch_first: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::gru.input`` on CPU tensors (aten/src/ATen/native/RNN.cpp, ``_rnn_impl_with_concat``).

    Algorithm::

        x = input (time-major); for each layer l:
            each direction: x_proj = linear(x, w_ih, b_ih); step GRU cells over x_proj (backwards
            for the reverse direction); stack the hidden states; directions are concatenated
            dropout(x) between layers when training
        return x, stack(final hidden of every layer and direction)
    """
    if not _gru_ok(input, hx, params, has_biases, num_layers, bidirectional):
        return torch.gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    x = input.transpose(0, 1) if batch_first else input
    step = 4 if has_biases else 2
    biases = (lambda i: params[i + 2 : i + 4]) if has_biases else (lambda i: (None, None))
    cells = [(*params[i : i + 2], *biases(i)) for i in range(0, len(params), step)]
    hiddens, finals = hx.unbind(0), []
    directions = 2 if bidirectional else 1
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            out, final = _gru_layer(x, hiddens[k], cells[k], reverse=d == 1)
            outputs.append(out)
            finals.append(final)
        x = torch.cat(outputs, outputs[0].dim() - 1) if bidirectional else outputs[0]
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    if batch_first:
        x = x.transpose_(0, 1)
    return x, torch.stack(finals, 0)


def matrix_power(input: Any, n: Any, *, out: Any = None) -> Any:
    """``aten::linalg_matrix_power`` (aten/src/ATen/native/LinearAlgebra.cpp), without ``out=``.

    Algorithm::

        n == 0: clone(input).copy_(eye)      n == 1: clone(input)      n == -1: linalg_inv(input)
        a = linalg_inv(input) if n < 0 else input;  n = |n|
        n == 2: a @ a     n == 3: (a @ a) @ a
        else: binary powering from the least significant bit, z = z @ z, result = result @ z
    """
    square = isinstance(input, torch.Tensor) and input.dim() >= 2 and input.size(-1) == input.size(-2)
    if out is not None or not square or not isinstance(n, int):
        return torch.linalg.matrix_power(input, n, out=out)
    if n == 0:
        return input.clone(memory_format=torch.contiguous_format).copy_(
            torch.eye(input.size(-2), dtype=input.dtype, device=input.device)
        )
    if n == 1:
        return input.clone(memory_format=torch.contiguous_format)
    if n == -1:
        return torch.linalg.inv(input)
    a = torch.linalg.inv(input) if n < 0 else input
    n = abs(n)
    if n in (2, 3):
        square_of_a = torch.matmul(a, a)
        return square_of_a if n == 2 else torch.matmul(square_of_a, a)
    z = result = None
    while n > 0:
        bit, n = n % 2, n // 2
        z = a if z is None else torch.matmul(z, z)
        if bit:
            result = z if result is None else torch.matmul(result, z)
    return result


@functools.cache
def ports() -> dict[Callable[..., Any], Callable[..., Any]]:
    """``{composite: port}``, built on first use (nothing happens at import time)."""
    return {
        torch._C._nn.pad: pad, torch.lstm_cell: lstm_cell, torch.gru_cell: gru_cell, torch.gru: gru,
        torch.linalg.matrix_power: matrix_power, torch.matrix_power: matrix_power,
        torch.Tensor.matrix_power: matrix_power,
    }
