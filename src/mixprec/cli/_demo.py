"""``mixprec demo``: one small CNN trained three ways on scikit-learn's digits, side by side.

Every run starts from the same seed (same weights, same batches): float32,
bfloat16 autocast, and float16 autocast with mixprec.GradScaler. The runs are
interleaved step by step in one process, so load from other processes hits them
alike; time per step is the median. The first step of each run is a warm-up: it
is not timed, and it is where casts and memory are counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.cli._common import device_type, out_dir
from mixprec.diagnostics import CastCounter

BATCH = 128
#: On a GPU the CNN is launch-bound (lower precision only adds casts), so the demo trains a model whose matrix
#: multiplies fill the GPU, where lower precision pays: an MLP 4096 wide on a batch of 4096 images.
GPU_BATCH, GPU_WIDTH = 4096, 4096
SEED = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """One contender: its label and low-precision dtype (None: float32, no autocast)."""

    label: str
    dtype: torch.dtype | None
    scaler: bool = False


SETUPS = (
    Setup("float32", None),
    Setup("bf16 autocast", torch.bfloat16),
    Setup("fp16 autocast + GradScaler", torch.float16, scaler=True),
)


@dataclasses.dataclass
class Result:
    setup: Setup
    losses: list[float]
    scales: list[float]
    skipped: list[bool]
    seconds_per_step: float
    peak_bytes: int
    casts_per_step: int
    accuracy: float


def load_digits(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits (1797 images, no download): 80 % train, 20 % test, fixed split."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SEED))
    x, y = x[order].to(device), y[order].to(device)
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def batch_size(device: str) -> int:
    return GPU_BATCH if device == "cuda" else BATCH


def make_model(device: str = "cpu") -> nn.Module:
    """On a CPU: two 3x3 convolutions, a pool and two linear layers (about 140k parameters). On a GPU: an MLP
    of three hidden layers ``GPU_WIDTH`` wide (about 34M parameters), the work lower precision speeds up there."""
    if device == "cuda":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, GPU_WIDTH), nn.ReLU(), nn.Linear(GPU_WIDTH, GPU_WIDTH), nn.ReLU(),
            nn.Linear(GPU_WIDTH, GPU_WIDTH), nn.ReLU(), nn.Linear(GPU_WIDTH, 10),
        )  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def _region(setup: Setup, device: str) -> mixprec.autocast:
    return mixprec.autocast(device, dtype=setup.dtype or torch.float32, enabled=setup.dtype is not None)


class _Saved:
    """Bytes held for backward (tensors saved by autograd, each storage once): the peak of a training step."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class Trainer:
    """One contender's model, optimizer and scaler, stepped by :func:`train_all`."""

    def __init__(self, setup: Setup, device: str, data: tuple[torch.Tensor, ...]) -> None:
        self.setup, self.device, self.data = setup, device, data
        torch.manual_seed(SEED)
        self.model = make_model(device).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        self.scaler = mixprec.GradScaler(device, init_scale=2.0**16, enabled=setup.scaler)
        self.batches = torch.Generator().manual_seed(SEED)
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.times: list[float] = []
        self.peak_bytes = 0
        self.casts = 0

    def step(self, warmup: bool) -> None:
        """One training step; the warm-up step counts casts and memory and is not timed."""
        x_train, y_train = self.data[0], self.data[1]
        index = torch.randint(0, len(y_train), (batch_size(self.device),), generator=self.batches).to(self.device)
        saved, counter = _Saved(), CastCounter()
        if warmup and self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if warmup:
                stack.enter_context(counter)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))
            stack.enter_context(_region(self.setup, self.device))
            loss = nn.functional.cross_entropy(self.model(x_train[index]), y_train[index])
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        value = loss.item()
        if warmup:
            self.casts, self.peak_bytes = counter.casts, self._peak(saved)
            return
        self.times.append(time.perf_counter() - start)
        self.losses.append(value)
        self.scales.append(self.scaler.get_scale() if self.setup.scaler else float("nan"))

    def _peak(self, saved: _Saved) -> int:
        if self.device == "cuda":
            return int(torch.cuda.max_memory_allocated())
        return saved.total + sum(p.numel() * p.element_size() * 2 for p in self.model.parameters())  # + grads

    def result(self) -> Result:
        history = self.scaler.history[1:] if self.setup.scaler else []
        with torch.no_grad(), _region(self.setup, self.device):
            accuracy = float((self.model(self.data[2]).argmax(1) == self.data[3]).float().mean())
        return Result(self.setup, self.losses, self.scales, [r.skipped for r in history],
                      statistics.median(self.times), self.peak_bytes, self.casts, accuracy)  # fmt: skip


def train_all(
    setups: tuple[Setup, ...], steps: int, device: str, data: tuple[torch.Tensor, ...],
    advance: Callable[[int], object] | None = None,
) -> list[Result]:  # fmt: skip
    """Train every contender ``steps`` steps (+1 warm-up), interleaved step by step so that they share the
    machine's load alike; ``advance(i)`` after contender i's step. Time per step is the median."""
    trainers = [Trainer(setup, device, data) for setup in setups]
    for step in range(steps + 1):
        for i, trainer in enumerate(trainers):
            trainer.step(warmup=step == 0)
            if advance is not None:
                advance(i)
    return [trainer.result() for trainer in trainers]


def train(setup: Setup, steps: int, device: str, data: tuple[torch.Tensor, ...]) -> Result:
    """Train one contender alone."""
    return train_all((setup,), steps, device, data)[0]


def compute_note(device: str, dtype: torch.dtype | None) -> str:
    """How ``compute="auto"`` runs this dtype's matrix ops here: on native kernels or emulated."""
    if dtype is None:
        return "-"
    return "native" if mixprec.kernel_support(device, dtype).native else "emulated"


def plot(results: list[Result], path: Path) -> None:
    """Loss curves of every run, and the float16 run's loss scale with its skipped steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    for result in results:
        top.plot(range(1, len(result.losses) + 1), result.losses, label=result.setup.label, linewidth=1.2)
    top.set_yscale("log")
    top.set_ylabel("training loss")
    top.set_title("mixprec demo: a small CNN on scikit-learn digits")
    top.legend()
    for result in results:
        if result.setup.scaler:
            steps = range(1, len(result.scales) + 1)
            bottom.plot(steps, result.scales, color="tab:green", label="loss scale")
            skipped = [s for s, skip in zip(steps, result.skipped, strict=False) if skip]
            bottom.scatter(skipped, [result.scales[s - 1] for s in skipped], color="red", marker="x", label="skipped")
    bottom.set_yscale("log", base=2)
    bottom.set_xlabel("step")
    bottom.set_ylabel("GradScaler scale")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(steps: int, device: str, out: Path) -> None:
    """The ``mixprec demo`` command."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    device = device_type(device)
    out = out_dir(out)
    console = Console(width=max(Console().width, 132))  # the table needs ~128 columns
    data = load_digits(device)
    model = "an MLP 4096 wide" if device == "cuda" else "a small CNN"
    console.print(f"Digits: {len(data[1])} train / {len(data[3])} test images, {model}, batch {batch_size(device)}, "
                  f"{steps} steps per run, {_where(device)}")  # fmt: skip
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tasks = [progress.add_task(setup.label, total=steps + 1) for setup in SETUPS]
        results = train_all(SETUPS, steps, device, data, lambda i: progress.advance(tasks[i]))
    console.print(_table(results, device))
    os.makedirs(out, exist_ok=True)
    plot(results, out / "demo.png")
    console.print(f"Wrote {out / 'demo.png'}", highlight=False, markup=False)


def _where(device: str) -> str:
    """What ran the demo: the GPU's name, or the CPU's thread count."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{torch.get_num_threads()} threads"


def _table(results: list[Result], device: str) -> object:
    from rich.table import Table

    table = Table(title=f"mixprec demo ({device}, {_where(device)})")
    for name in ("run", "time/step", "vs fp32", "peak memory*", "final loss", "test acc", "skipped", "casts/step"):
        table.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    table.add_column("compute", no_wrap=True)
    base = results[0].seconds_per_step
    for r in results:
        table.add_row(
            r.setup.label, f"{r.seconds_per_step * 1e3:.1f} ms", f"{r.seconds_per_step / base:.2f}x",
            f"{r.peak_bytes / 2**20:.2f} MiB", f"{r.losses[-1]:.4f}", f"{r.accuracy:.1%}", str(sum(r.skipped)),
            str(r.casts_per_step), compute_note(device, r.setup.dtype),
        )  # fmt: skip
    units = "the GPU's tensor cores" if device == "cuda" else "the CPU's low-precision units"
    notes = [f'compute: how compute="auto" runs matrix ops (mixprec.kernel_support): "native" on {units}; '
             '"emulated" (float32 kernels between low-precision roundings) where it has none, '
             "as torch's own kernels for that dtype are slow fallbacks there."]
    notes += [str(mixprec.kernel_support(device, r.setup.dtype)) for r in results if r.setup.dtype is not None]
    if device != "cuda":
        notes.append("* CPU has no allocator statistics: the bytes autograd holds for backward (a step's peak) "
                     "plus weights and gradients.")
    table.caption = "\n".join(notes)  # fmt: skip
    return table
