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


class _MatrixPower(torch.nn.Module):
    def __init__(self, n: int, how: str) -> None:
        super().__init__()
        self.n, self.how = n, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x + 4 * torch.eye(4)  # well conditioned, so negative powers are finite
        if self.how == "method":
            return a.matrix_power(self.n)
        return {"linalg": torch.linalg.matrix_power, "torch": torch.matrix_power}[self.how](a, self.n)


class _GRU(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(5, 7, **options)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(x)  # type: ignore[no-any-return]


GRU_OPTIONS: dict[str, dict[str, Any]] = {
    "1-layer": {},
    "2-layers": {"num_layers": 2},
    "bidirectional": {"bidirectional": True},
    "2-layers-bidirectional-batch-first": {"num_layers": 2, "bidirectional": True, "batch_first": True},
    "3-layers-dropout": {"num_layers": 3, "dropout": 0.3},
    "no-bias-bidirectional": {"bias": False, "num_layers": 2, "bidirectional": True},
}

CASES = {
    **{
        f"matrix_power-{how}-{n}": (
            lambda n=n, how=how: (_MatrixPower(n, how), torch.randn(2, 4, 4, requires_grad=True))
        )
        for n in (-5, -2, -1, 0, 1, 2, 3, 6, 7)
        for how in ("linalg", "torch", "method")
    },
    **{
        f"gru-{name}": (lambda o=options: (_GRU(**o), torch.randn(4, 3, 5, requires_grad=True)))
        for name, options in GRU_OPTIONS.items()
    },
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
    ours = _run(CASES[case], mixprec.autocast("cpu", dtype=dtype, compute="native"))
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


def test_packed_gru_runs_uncast_as_documented() -> None:
    torch.manual_seed(0)
    gru = torch.nn.GRU(5, 7)
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 5), torch.tensor([4, 2]))
    with mixprec.autocast("cpu"):
        got, _ = gru(packed)
    expected, _ = gru(packed)
    with torch.autocast("cpu"):
        native, _ = gru(packed)
    assert got.data.dtype == torch.float32
    assert torch.equal(got.data, expected.data)
    assert not torch.equal(native.data, expected.data)  # the divergence in docs/policies.md
