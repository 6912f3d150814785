"""Cost of per-module policies and of AutocastModule, against a plain region and native equivalents.

One small MLP (``--blocks`` blocks of Linear+GELU+LayerNorm, width 64, batch 8)
forward+backward per step, where per-call overhead dominates. Contenders:

* ``region``:         ``with mixprec.autocast("cpu")`` around the model (the reference)
* ``edited``:         the same with ``policy=CPU.with_ops(fp32=["exp"]).without_ops("cat")``
* ``module_policy``:  the region, plus ``set_module_policy(block, edited)`` on every block
* ``fp32_block``:     the region, plus ``set_module_policy(block 0, "fp32")``
* ``native_fp32``:    ``torch.autocast`` with block 0 wrapped in ``torch.autocast(enabled=False)`` on float32 inputs
* ``AutocastModule``: ``mixprec.AutocastModule(model, "cpu")``
* ``native_wrapper``: a module whose forward is ``with torch.autocast("cpu"): model(x)``

Algorithm::

    warm up; pick `inner` so one sample takes ~--sample-ms
    for r in range(repeats):                      # interleaved, rotating order
        for contender in rotate(contenders, r):
            sample = time(step x inner) / inner
    print the median sample per contender and its ratio to `region`

Usage::

    python benchmarks/module_policy_overhead.py [--repeats 60] [--sample-ms 20] [--threads 1] [--blocks 4]
                                                [--compute auto]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import mixprec


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))


class _NativeFP32(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.module(x.float())


class _NativeWrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu"):
            return self.module(x)


def contenders(blocks: int, compute: str = "auto") -> dict[str, Callable[[torch.Tensor], None]]:
    """Each contender runs one forward+backward step on its own copy of the same model."""
    torch.manual_seed(0)
    base = nn.Sequential(*[_block() for _ in range(blocks)], nn.Linear(64, 8))
    edited = mixprec.policies.CPU.with_ops(fp32=["exp"]).without_ops("cat")

    def fresh() -> nn.Sequential:
        model = nn.Sequential(*[_block() for _ in range(blocks)], nn.Linear(64, 8))
        model.load_state_dict(base.state_dict())
        return model

    def step(model: nn.Module, region: Callable[[], contextlib.AbstractContextManager[object]]):
        def run(x: torch.Tensor) -> None:
            with region():
                out = model(x)
            out.float().sum().backward()

        return run

    region = fresh()
    with_policies = fresh()
    for block in list(with_policies)[:blocks]:
        mixprec.set_module_policy(block, edited)
    fp32_block = fresh()
    mixprec.set_module_policy(fp32_block[0], "fp32")
    native_fp32 = fresh()
    native_fp32[0] = _NativeFP32(native_fp32[0])
    return {
        "region": step(region, lambda: mixprec.autocast("cpu", compute=compute)),
        "edited": step(fresh(), lambda: mixprec.autocast("cpu", policy=edited, compute=compute)),
        "module_policy": step(with_policies, lambda: mixprec.autocast("cpu", compute=compute)),
        "fp32_block": step(fp32_block, lambda: mixprec.autocast("cpu", compute=compute)),
        "native_fp32": step(native_fp32, lambda: torch.autocast("cpu")),
        "AutocastModule": step(mixprec.AutocastModule(fresh(), "cpu", compute=compute), contextlib.nullcontext),
        "native_wrapper": step(_NativeWrapper(fresh()), contextlib.nullcontext),
    }


def measure(runs: dict[str, Callable[[torch.Tensor], None]], repeats: int, sample_ms: float) -> dict[str, list[float]]:
    x = torch.randn(8, 64)
    for run in runs.values():
        for _ in range(5):
            run(x)
    t = time.perf_counter()
    for _ in range(10):
        runs["region"](x)
    inner = max(1, int(sample_ms / 1e3 / ((time.perf_counter() - t) / 10)))
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(inner):
                runs[name](x)
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument(
        "--compute", default="auto", choices=("auto", "native", "emulated"),
        help="mixprec's compute; 'native' compares like with like on a CPU where 'auto' emulates",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    samples = measure(contenders(args.blocks, args.compute), args.repeats, args.sample_ms)
    reference = statistics.median(samples["region"])
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {args.threads} thread(s), "
          f"{args.blocks} blocks, {args.repeats} interleaved repetitions, compute={args.compute!r}")
    print("| contender | median us/step | ratio to region |")
    print("|-----------|---------------:|----------------:|")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e6:.1f} | {median / reference:.3f} |")


if __name__ == "__main__":
    main()
