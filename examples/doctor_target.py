"""A target for `mixprec doctor`: raw 0..1023 inputs and attention scores not scaled by 1/sqrt(d).

Run: mixprec doctor examples/doctor_target.py:build --dtype float16
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)  # missing / sqrt(width): overflows float16
        return torch.softmax(scores.float(), dim=-1).to(x.dtype) @ self.v(x)


class Model(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.encoder = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.decoder = nn.ModuleDict({"attention": Attention(width), "head": nn.Linear(width, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x))
        return self.decoder["head"](self.decoder["attention"](h))


def build() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    """(model, example_inputs, loss_fn): what `mixprec doctor` calls."""
    torch.manual_seed(0)
    x = torch.rand(2, 32, 16) * 1023  # raw 10-bit sensor counts, never normalised
    return Model(), (x,), lambda out: out.float().square().mean()
