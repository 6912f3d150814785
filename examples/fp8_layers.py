"""A target for `mixprec policy layers`: a one-block Llama-style decoder, to see which layers fp8 runs.

Run: mixprec policy layers examples/fp8_layers.py:build --min-features 256
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.v_proj, self.o_proj = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        b, t, w = h.shape
        q, k, v = (p(h).view(b, t, 4, w // 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, w))
        h = self.norm2(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 512, width: int = 256, hidden: int = 688) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([Block(width, hidden)])
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Decoder(), (torch.randint(0, 512, (2, 32)),)
