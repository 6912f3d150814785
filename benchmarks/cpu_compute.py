"""Emulated low precision on CPU: a GPT-2 training step against float32 and native autocast.

Contenders, each training its own copy of the same model (same initial weights,
same batches, same dropout seed per step):

* ``fp32``:           no autocast
* ``torch bf16``:     ``torch.autocast("cpu", dtype=torch.bfloat16)``
* ``mixprec emu bf16``: ``mixprec.autocast("cpu", dtype=torch.bfloat16, compute="emulated")``
* ``mixprec auto bf16``: the same with ``compute="auto"`` (native where the CPU has fast bfloat16 kernels)
* with ``--fp16``: ``torch fp16`` and ``mixprec auto fp16`` (``compute="auto"``, which
  picks emulated where the CPU has no native float16 matrix kernels)

The model is Hugging Face ``GPT2LMHeadModel`` from a small config (n_embd 128,
2 layers, 4 heads, the GPT-2 vocabulary; nothing is downloaded), batch 4 x 64,
AdamW. One step is forward (inside the region) + backward + optimizer step.

Algorithm::

    warm up every contender (2 steps)
    for r in range(repeats):                          # interleaved
        for contender in rotate(contenders, r):       # rotating order
            seed(r); t = perf_counter(); step(); time[contender].append(perf_counter() - t)
    report median step time per contender and its ratio to fp32 and to torch bf16
    loss: median over repetitions of |loss - torch bf16 loss| / torch bf16 loss (same seed, same batch)
    memory: one more step per contender under torch.profiler(profile_memory=True);
        peak = max over time of the running sum of the CPU allocator's alloc/free events,
        i.e. the step's peak bytes above what was live when it started (weights, optimizer state)

Usage::

    python benchmarks/cpu_compute.py [--repeats 20] [--threads 1] [--fp16] [--json out.json]

The exit status is 1 if a goal is missed: mixprec emu bf16 <= 1.25x fp32, loss within 1 %
of torch bf16's, peak step memory <= torch bf16's and < fp32's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import mixprec

BF16, FP16 = torch.bfloat16, torch.float16
EMU = "mixprec emu bf16"


def contenders(fp16: bool) -> dict[str, Callable[[], Any]]:
    found: dict[str, Callable[[], Any]] = {
        "fp32": contextlib.nullcontext,
        "torch bf16": lambda: torch.autocast("cpu", dtype=BF16),
        EMU: lambda: mixprec.autocast("cpu", dtype=BF16, compute="emulated"),
        "mixprec auto bf16": lambda: mixprec.autocast("cpu", dtype=BF16, compute="auto"),
    }
    if fp16:
        found["torch fp16"] = lambda: torch.autocast("cpu", dtype=FP16)
        found["mixprec auto fp16"] = lambda: mixprec.autocast("cpu", dtype=FP16, compute="auto")
    return found


@dataclass
class Trainer:
    """One contender's model, optimizer and measurements."""

    region: Callable[[], Any]
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def step(self, ids: torch.Tensor) -> float:
        with self.region():
            loss = self.model(ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())


def build(fp16: bool) -> dict[str, Trainer]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=64)).train()
    trainers = {}
    for name, region in contenders(fp16).items():
        copied = copy.deepcopy(model)
        trainers[name] = Trainer(region, copied, torch.optim.AdamW(copied.parameters(), lr=1e-4))
    return trainers


def batch(r: int, vocab: int = 50257) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(r))


@contextlib.contextmanager
def _quiet_stdio() -> Iterator[None]:
    """Silence file descriptors 1 and 2: the profiler's C++ side prints start/stop lines there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def peak_bytes(trainer: Trainer, ids: torch.Tensor) -> int:
    """The step's peak CPU allocation above what was live at its start (profiler memory events)."""
    with _quiet_stdio(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(ids)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def run(repeats: int, fp16: bool) -> dict[str, Any]:
    trainers = build(fp16)
    names = list(trainers)
    for name in names:  # warm-up, and it checks the region does what it says
        for w in range(2):
            torch.manual_seed(10_000 + w)
            trainers[name].step(batch(10_000 + w))
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            torch.manual_seed(r)
            ids = batch(r)
            start = time.perf_counter()
            loss = trainers[name].step(ids)
            trainers[name].times.append(time.perf_counter() - start)
            trainers[name].losses.append(loss)
    peaks = {}
    for name in names:
        torch.manual_seed(repeats)
        peaks[name] = peak_bytes(trainers[name], batch(repeats))
    return summarize(trainers, peaks)


def summarize(trainers: dict[str, Trainer], peaks: dict[str, int]) -> dict[str, Any]:
    fp32 = statistics.median(trainers["fp32"].times)
    native = statistics.median(trainers["torch bf16"].times)
    ref = trainers["torch bf16"].losses
    rows = {}
    for name, t in trainers.items():
        ms = statistics.median(t.times)
        loss_gap = [abs(a - b) / abs(b) for a, b in zip(t.losses, ref, strict=True)]
        rows[name] = {
            "median_ms": ms * 1e3,
            "vs_fp32": ms / fp32,
            "vs_torch_bf16": ms / native,
            "loss_median": statistics.median(t.losses),
            "loss_gap_vs_torch_bf16": statistics.median(loss_gap),
            "peak_mib": peaks[name] / 2**20,
        }
    emu = rows[EMU]
    goals = {
        "emu_time_le_1.25x_fp32": emu["vs_fp32"] <= 1.25,
        "emu_loss_within_1pct_of_torch_bf16": emu["loss_gap_vs_torch_bf16"] <= 0.01,
        "emu_peak_le_torch_bf16": emu["peak_mib"] <= rows["torch bf16"]["peak_mib"],
        "emu_peak_lt_fp32": emu["peak_mib"] < rows["fp32"]["peak_mib"],
    }
    return {"rows": rows, "goals": goals}


def report(result: dict[str, Any], repeats: int) -> None:
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} thread(s), "
        f"{repeats} interleaved repetitions"
    )
    for dtype in (BF16, FP16):
        print(" ", mixprec.kernel_support("cpu", dtype))
    print("| contender | median step ms | / fp32 | / torch bf16 | median loss | loss gap vs torch bf16 | peak MiB |")
    print("|-----------|---------------:|-------:|-------------:|------------:|-----------------------:|---------:|")
    for name, row in result["rows"].items():
        print(
            f"| {name} | {row['median_ms']:.1f} | {row['vs_fp32']:.3f} | {row['vs_torch_bf16']:.3f} | "
            f"{row['loss_median']:.4f} | {row['loss_gap_vs_torch_bf16']:.2e} | {row['peak_mib']:.1f} |"
        )
    for goal, met in result["goals"].items():
        print(f"{goal}: {'met' if met else 'MISSED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp16", action="store_true", help="add torch fp16 and mixprec auto fp16 (slow: native fp16)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args.repeats, args.fp16)
    report(result, args.repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
