"""Ports of C++ composites (mixprec._ports): outputs and gradients bit for bit against native autocast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mixprec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _run(make: Callable[[], tuple[torch.nn.Module, torch.Tensor]], region: Any) -> tuple[list[torch.Tensor], ...]:
    torch.manual_seed(0)
    module, x = make()
    with region:
        out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outs).backward()
    grads = [p.grad for p in module.parameters()] + [x.grad]
    return [o.detach() for o in outs], grads


def _cell(cls: type[torch.nn.Module], bias: bool) -> Callable[[], tuple[torch.nn.Module, torch.Tensor]]:
    return lambda: (cls(6, 5, bias=bias), torch.randn(4, 6, requires_grad=True))


class _Pad(torch.nn.Module):
    def __init__(self, pad: tuple[int, ...], mode: str) -> None:
        super().__init__()
        self.pad, self.mode = pad, mode
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(self.linear(x), self.pad, mode=self.mode)


CASES = {
    "lstm_cell": _cell(torch.nn.LSTMCell, True),
    "lstm_cell-no-bias": _cell(torch.nn.LSTMCell, False),
    "gru_cell": _cell(torch.nn.GRUCell, True),
    "gru_cell-no-bias": _cell(torch.nn.GRUCell, False),
    **{
        f"pad-{mode}": (lambda mode=mode: (_Pad((1, 2), mode), torch.randn(2, 3, 8, requires_grad=True)))
        for mode in ("constant", "reflect", "replicate", "circular")
    },
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES)
def test_port_matches_native_forward_and_backward(case: str, dtype: torch.dtype) -> None:
    native = _run(CASES[case], torch.autocast("cpu", dtype=dtype))
    ours = _run(CASES[case], mixprec.autocast("cpu", dtype=dtype))
    for got, expected in zip([*ours[0], *ours[1]], [*native[0], *native[1]], strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.lstm_cell(torch.randn(3, 4), (torch.randn(3, 5),), torch.randn(20, 4), torch.randn(20, 5)),
        lambda: torch.gru_cell(torch.randn(3, 4), torch.randn(2, 5), torch.randn(15, 4), torch.randn(15, 5)),
        lambda: F.pad(torch.randn(2, 3), (1, 1, 1, 1, 1, 1, 1, 1), mode="reflect"),
        lambda: F.pad(torch.randn(2, 3, 4), (1, 1), mode="replicate", value=1.0),
    ],
    ids=["lstm_cell-one-hidden", "gru_cell-batch-mismatch", "pad-too-many-dims", "pad-value-with-replicate"],
)
def test_port_raises_what_native_raises(call: Callable[[], Any]) -> None:
    with pytest.raises(Exception) as native, torch.autocast("cpu"):
        call()
    with pytest.raises(type(native.value)), mixprec.autocast("cpu"):
        call()
