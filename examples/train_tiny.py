"""Train a tiny classifier under mixprec.autocast and show each layer's dtypes.

Run: python examples/train_tiny.py [--dtype bfloat16|float16] [--steps N]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import mixprec


def make_data(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Two interleaved spirals: a small task that a float32 model learns in a few hundred steps."""
    generator = torch.Generator().manual_seed(0)
    t = torch.rand(n, generator=generator) * 3 * torch.pi
    label = torch.randint(0, 2, (n,), generator=generator)
    radius = t / (3 * torch.pi)
    angle = t + label * torch.pi
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return x + 0.02 * torch.randn(x.shape, generator=generator), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_data()

    for step in range(args.steps):
        with mixprec.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    print(f"\nPer-layer dtypes under mixprec.autocast('cpu', dtype=torch.{args.dtype}):")
    print(f"{'layer':<16}{'input':<12}{'output':<12}{'weight':<10}")
    rows = []
    hooks = [
        module.register_forward_hook(lambda m, i, o, name=name: rows.append((name, i[0].dtype, o.dtype, m)))
        for name, module in model.named_children()
    ]
    with torch.no_grad(), mixprec.autocast("cpu", dtype=dtype):
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    for hook in hooks:
        hook.remove()
    for name, inp, out, module in rows:
        weight = getattr(module, "weight", None)
        label = f"{name} ({type(module).__name__})"
        weight_dtype = str(weight.dtype)[6:] if weight is not None else "-"
        print(f"{label:<16}{str(inp)[6:]:<12}{str(out)[6:]:<12}{weight_dtype:<10}")
    print(f"\ntrain accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
