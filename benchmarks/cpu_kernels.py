"""Which low-precision matrix kernels are fast on this CPU: the measurements behind compute="auto".

Times one call of each op in float32, bfloat16 and float16 (no autocast: the
kernels themselves), interleaved: in every repetition each dtype runs once, in
an order that rotates. Prints the median time per dtype and the ratio to
float32, and what ``mixprec.kernel_support`` decides for this CPU.

Run it under different oneDNN ISA caps to see the CPUs this machine can
imitate (oneDNN reads the variable once, at start-up)::

    python benchmarks/cpu_kernels.py
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python benchmarks/cpu_kernels.py   # AVX512 without BF16 instructions
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_kernels.py          # an AVX2-only CPU

Usage::

    python benchmarks/cpu_kernels.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mixprec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# op name -> (function, input shapes): every input is drawn in the dtype under test.
CASES: dict[str, tuple[Callable[..., object], tuple[tuple[int, ...], ...]]] = {
    "mm 256x128 @ 128x512": (torch.mm, ((256, 128), (128, 512))),
    "mm 512^3": (torch.mm, ((512, 512), (512, 512))),
    "bmm 16 x 64x32 @ 32x64": (torch.bmm, ((16, 64, 32), (16, 32, 64))),
    "linear 256x128 -> 512": (F.linear, ((256, 128), (512, 128))),
    "conv2d 8x32x32x32 k3": (lambda x, w: F.conv2d(x, w, padding=1), ((8, 32, 32, 32), (32, 32, 3, 3))),
    "sdpa 4x4x256x64 causal": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        ((4, 4, 256, 64),) * 3,
    ),
}


def _bind(fn: Callable[..., object], shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> Callable[[], object]:
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=g).to(dtype) for shape in shapes]
    return lambda: fn(*inputs)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    names = list(DTYPES)
    for case in CASES:
        calls = {name: _bind(*CASES[case], dtype) for name, dtype in DTYPES.items()}
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            calls[name]()  # warm-up
        for r in range(repeats):
            for name in names[r % 3 :] + names[: r % 3]:
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
        results[case] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    print(f"torch {torch.__version__}, {args.threads} thread(s), ONEDNN_MAX_CPU_ISA={cap!r}")
    for dtype in (torch.bfloat16, torch.float16):
        print(" ", mixprec.kernel_support("cpu", dtype))
    print("| op | fp32 ms | bf16 ms | bf16 / fp32 | fp16 ms | fp16 / fp32 |")
    print("|----|--------:|--------:|------------:|--------:|------------:|")
    for case, row in measure(args.repeats).items():
        f32, b16, f16 = row["fp32"], row["bf16"], row["fp16"]
        print(f"| {case} | {f32:.3f} | {b16:.3f} | {b16 / f32:.2f} | {f16:.3f} | {f16 / f32:.2f} |")


if __name__ == "__main__":
    main()
