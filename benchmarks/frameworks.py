"""Frameworks under mixprec.install(): Hugging Face Trainer and Lightning, bf16 step time against float32.

Contenders, each a fresh training run of the same model from the same seed on the same data:

* HF ``Trainer`` (``examples/hf_trainer.py``: a 2-layer GPT-2 classifier): ``bf16=False``;
  ``bf16=True`` with torch's own autocast; ``bf16=True`` under ``mixprec.install()``.
* Accelerate: the same GPT-2 classifier in a hand-written loop, ``Accelerator(mixed_precision=...,
  cpu=True)`` with ``accelerator.autocast()``: ``"no"``; ``"bf16"`` with torch's own autocast;
  ``"bf16"`` under ``mixprec.install()``.
* Lightning (``examples/lightning_bf16.py``: a 3-layer MLP): ``precision="32-true"``;
  ``"bf16-mixed"`` with torch's own autocast; ``"bf16-mixed"`` under ``mixprec.install()``;
  the ``MixprecPrecision`` plugin.

Algorithm::

    for round in range(rounds):                        # interleaved: every contender once per round
        for contender in rotate(contenders, round):
            run --steps steps; keep the per-step times after the first two
    report the median step time per contender, its ratio to float32, and the final loss
    (median over rounds) against torch's bf16 run

Run it where bf16 has no fast kernels to see what install() is for, e.g. on a CPU
with them, capped the way oneDNN sees an AVX2-only CPU:

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/frameworks.py [--rounds 3] [--steps 20] [--threads 2]

The exit status is 1 if a goal is missed: mixprec's bf16 step <= 1.3x the float32 step,
final loss within 1 % of torch's bf16 run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import hf_trainer
import lightning_bf16

import mixprec

Run = Callable[[int], tuple[float, float]]


def hf_contenders() -> dict[str, Run]:
    return {
        "float32": lambda steps: hf_trainer.train(False, steps),
        "torch bf16": lambda steps: hf_trainer.train(True, steps, install=False),
        "mixprec bf16": lambda steps: hf_trainer.train(True, steps),
    }


def accelerate_run(bf16: bool, steps: int, install: bool = True) -> tuple[float, float]:
    """A hand-written Accelerate loop over the HF example's model and data: (median step s, final loss)."""
    import time

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if bf16 else "no"
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=True)
    model = hf_trainer.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = hf_trainer.make_data()
    ids = torch.stack([d["input_ids"] for d in data])
    labels = torch.tensor([d["labels"] for d in data])
    times, loss = [], float("nan")
    handle = mixprec.install() if bf16 and install else None
    try:
        for step in range(steps):
            rows = slice((step * 16) % len(data), (step * 16) % len(data) + 16)
            start = time.perf_counter()
            with accelerator.autocast():
                out = model(input_ids=ids[rows], labels=labels[rows])
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            loss = out.loss.item()
    finally:
        if handle is not None:
            handle.remove()
    return statistics.median(times[2:] or times), loss


def accelerate_contenders() -> dict[str, Run]:
    return {
        "float32": lambda steps: accelerate_run(False, steps),
        "torch bf16": lambda steps: accelerate_run(True, steps, install=False),
        "mixprec bf16": lambda steps: accelerate_run(True, steps),
    }


def lightning_contenders() -> dict[str, Run]:
    from mixprec.integrations.lightning import MixprecPrecision

    return {
        "float32": lambda steps: lightning_bf16.train(steps),
        "torch bf16": lambda steps: lightning_bf16.train(steps, "bf16-mixed"),
        "mixprec bf16": lambda steps: lightning_bf16.train(steps, "bf16-mixed", install=True),
        "mixprec plugin": lambda steps: lightning_bf16.train(steps, plugin=MixprecPrecision()),
    }


def measure(contenders: dict[str, Run], rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            seconds, loss = contenders[name](steps)
            times[name].append(seconds)
            losses[name].append(loss)
    return {n: (statistics.median(times[n]), statistics.median(losses[n])) for n in names}


def report(title: str, results: dict[str, tuple[float, float]]) -> bool:
    fp32, native_loss = results["float32"][0], results["torch bf16"][1]
    print(f"\n{title}")
    print("| contender | median step ms | / float32 | final loss | loss gap vs torch bf16 |")
    print("|---|---:|---:|---:|---:|")
    ok = True
    for name, (seconds, loss) in results.items():
        gap = abs(loss - native_loss) / abs(native_loss)
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / fp32:.2f} | {loss:.4f} | {gap:.2e} |")
        if name.startswith("mixprec"):
            ok &= seconds / fp32 <= 1.3 and gap <= 0.01
    print("goals (mixprec step <= 1.3x float32, loss within 1 % of torch bf16):", "met" if ok else "MISSED")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    frameworks = ["hf", "accelerate", "lightning"]
    parser.add_argument("--frameworks", nargs="+", choices=frameworks, default=frameworks)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds of {args.steps} steps")
    print(mixprec.kernel_support("cpu", torch.bfloat16))
    ok = True
    if "hf" in args.frameworks:
        ok &= report("HF Trainer, 2-layer GPT-2 classifier", measure(hf_contenders(), args.rounds, args.steps))
    if "accelerate" in args.frameworks:
        ok &= report("Accelerate loop, the same GPT-2", measure(accelerate_contenders(), args.rounds, args.steps))
    if "lightning" in args.frameworks:
        ok &= report("Lightning, 3-layer MLP", measure(lightning_contenders(), args.rounds, args.steps))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
