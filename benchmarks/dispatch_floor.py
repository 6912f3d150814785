"""What a TorchFunctionMode costs by itself, and what a minimal mode-based autocast could reach.

Two questions behind the eager-overhead goals (``eager_overhead.py``):

* **dispatch**: how much slower is a step when a pass-through ``TorchFunctionMode``
  is on the stack, with no autocast at all (``fp32_pass / fp32``)? Every
  mode-based autocast pays at least this on every intercepted call, before it
  casts anything; native autocast pays none of it.
* **ideal** (mlp only): the least a mode-based autocast can do on the mlp: a mode
  whose handler casts the three tensors of each ``linear`` to bfloat16 and passes
  every other call through (no region object, no state, no cache, no policy).

Contenders run the cases of ``eager_overhead.py`` interleaved in one process, in
rotating order; a sample is the mean of ``inner`` steps (about ``--sample-ms``);
the table gives medians and each contender's ratio to native autocast.

Usage::

    python benchmarks/dispatch_floor.py [--repeats 100] [--sample-ms 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eager_overhead as common

import mixprec

BF16 = torch.bfloat16
_linear = torch._C._nn.linear


class IdealLinearAutocast(TorchFunctionMode):
    """linear on bfloat16 casts of its three tensors; every other call passes through (mlp only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.linear or func is _linear:
            x, weight, bias = args
            return _linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
        return func(*args, **(kwargs or {}))


CONTENDERS: dict[str, Callable[[], Any]] = {
    "native": lambda: torch.autocast("cpu", dtype=BF16),
    "mixprec": lambda: mixprec.autocast("cpu", dtype=BF16),
    "native_pass": common.floor_region,
    "fp32": contextlib.nullcontext,
    "fp32_pass": common._PassThrough,
}


Contenders = dict[str, Callable[[], Any]]


def run(case: common.Case, contenders: Contenders, repeats: int, sample_ms: float) -> dict[str, float]:
    for region in contenders.values():
        common._time(case, region, 5)
    slowest = max(min(common._time(case, region, 1) for _ in range(3)) for region in contenders.values())
    inner = max(1, round(sample_ms / 1e3 / slowest))
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(common._time(case, contenders[name], inner))
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--sample-ms", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {args.threads}, repeats {args.repeats}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name in ("mlp", "bert"):
        case = common.CASES[name]()
        contenders = dict(CONTENDERS)
        if name == "mlp":
            contenders["ideal"] = IdealLinearAutocast
            with IdealLinearAutocast():
                if case.step(contextlib.nullcontext).dtype != BF16:
                    raise RuntimeError("the ideal contender does not autocast the mlp")
        medians = run(case, contenders, args.repeats, args.sample_ms)
        native = medians["native"]
        print(f"\n{name}: {case.description}")
        for contender, median in medians.items():
            print(f"  {contender:<12} {median * 1e3:8.3f} ms  / native {median / native:6.3f}")
        print(f"  dispatch alone: fp32_pass / fp32 = {medians['fp32_pass'] / medians['fp32']:.3f}, "
              f"{(medians['fp32_pass'] - medians['fp32']) * 1e6:.0f} us per step "
              f"= {(medians['fp32_pass'] - medians['fp32']) / native:.3f} of the native step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
