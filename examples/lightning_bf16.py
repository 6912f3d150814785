"""Lightning with mixprec: ``Trainer(precision="bf16-mixed")`` under ``mixprec.install()``, or the plugin.

Trains a 3-layer MLP on a small synthetic regression task made here, in float32,
in bfloat16 under ``mixprec.install()`` (Lightning's own ``precision="bf16-mixed"``
regions, now following mixprec) and with ``MixprecPrecision`` as a plugin, and
prints the median step time against float32 and the final loss.

    pip install -e ".[examples]"   # Lightning
    python examples/lightning_bf16.py [--steps 60] [--native]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch

import mixprec
from mixprec.integrations.lightning import MixprecPrecision

WIDTH = 1024


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
            torch.nn.Linear(WIDTH, 1),
        )  # fmt: skip
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def make_data(n: int = 2048, seed: int = 0) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, WIDTH, generator=gen)
    y = torch.tanh(x[:, :8].sum(1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256)


def train(steps: int, precision: str | None = None, plugin: Any = None, install: bool = False) -> tuple[float, float]:
    """One run: (median step seconds after the first two, final loss)."""
    torch.manual_seed(0)
    module, timer = MLP(), StepTimer()
    options: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": precision or "32-true"}
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], **options,
    )  # fmt: skip
    handle = mixprec.install() if install else None
    try:
        trainer.fit(module, make_data())
    finally:
        if handle is not None:
            handle.remove()
    return statistics.median(timer.times[2:] or timer.times), module.losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--native", action="store_true", help="also run torch's bf16 autocast (slow off bf16 units)")
    args = parser.parse_args()
    print(mixprec.kernel_support("cpu", torch.bfloat16))
    fp32_time, fp32_loss = train(args.steps)
    runs = {
        "float32": (fp32_time, fp32_loss),
        "bf16-mixed, install()": train(args.steps, "bf16-mixed", install=True),
        "MixprecPrecision plugin": train(args.steps, plugin=MixprecPrecision()),
    }
    if args.native:
        runs["bf16-mixed, torch's"] = train(args.steps, "bf16-mixed")
    for name, (seconds, loss) in runs.items():
        print(f"{name:24} step {seconds * 1e3:8.1f} ms  ({seconds / fp32_time:5.2f}x float32)  final loss {loss:.4f}")


if __name__ == "__main__":
    main()
