"""Where the time of a compiled fp8 MLP block goes, against bf16: a profile by kernel, for tuning fp8 on a GPU.

``benchmarks/fp8.py`` says how fast fp8 is; this says why. It compiles the block of ``fp8.py``'s ``mlp-<name>``
case (``x -> linear -> gelu -> linear``, forward and backward) under each contender, runs ``--steps`` steps
under ``torch.profiler`` (contenders: ``bf16``, ``fp8``, and ``fp8-fast``, fp8 whose forward GEMMs use
``Fp8Recipe(use_fast_accum=True)``) and sums the device time of each kernel per step, in groups:

* ``gemm``: the matrix multiplies (cuBLAS/CUTLASS kernels, ``mm``/``_scaled_mm`` on CPU);
* ``fused``: the kernels inductor generated (on a GPU ``triton_red``/``triton_per`` reductions, such as an
  amax, and ``triton_poi`` pointwise kernels, such as a quantisation or a transposed copy);
* ``other``: every other kernel (copies torch launches itself, fills, ...).

fp8 pays where its GEMMs save more than its extra passes cost: the table gives both, and the largest kernels
by name (inductor names a fused kernel after the ops in it). Usage::

    python benchmarks/fp8_profile.py --device cuda [--shape llama3-8b] [--steps 10] [--json out.json]
    python benchmarks/fp8_profile.py        # CPU, the small shape: checks the script (fp8 is emulated there)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eager_overhead as common
import fp8 as bench

#: Substrings of a GEMM kernel's name (cuBLAS, cuBLASLt, CUTLASS, and the CPU ops that run one).
GEMM_NAMES = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm100_", "aten::mm", "aten::_scaled_mm",
              "aten::addmm", "aten::bmm")  # fmt: skip


def group(name: str) -> str:
    """A kernel's group: ``gemm``, ``fused`` (inductor's), or ``other``."""
    low = name.lower()
    if any(key in low for key in GEMM_NAMES):
        return "gemm"
    if "triton" in low or "cpp_fused" in low:
        return "fused"
    return "other"


def kernels(prof: Any, steps: int, gpu: bool) -> dict[str, dict[str, float]]:
    """Per kernel name: calls and device microseconds per step (on CPU: the self CPU time of each op and of
    each of inductor's kernels, which ``cpp.enable_kernel_profile`` names)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for event in prof.events():
        if gpu:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        else:
            if event.device_type != torch.autograd.DeviceType.CPU:
                continue
            us = event.self_cpu_time_total
        row = out[event.name]
        row["calls"] += 1 / steps
        row["us"] += us / steps
    return dict(out)


def profile_contender(region: Any, model: nn.Module, x: torch.Tensor, steps: int) -> dict[str, Any]:
    step = bench.block_step(torch.compile(model), x, region)
    for _ in range(3):  # compile, then warm
        step()
    common._sync()
    gpu = common._gpu()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        common._sync()
    per_kernel = kernels(prof, steps, gpu)
    groups: dict[str, float] = defaultdict(float)
    for kernel, row in per_kernel.items():
        groups[group(kernel)] += row["us"]
    torch._dynamo.reset()
    return {"groups": dict(groups), "total_us": sum(groups.values()), "kernels": per_kernel}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--shape", choices=list(bench.MLP_SHAPES), default="llama3-8b",
                        help="the MLP block's shape, as fp8.py's mlp-<shape> (default llama3-8b)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per contender (default 10)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per contender (default 15)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1. Received: {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    common.DEVICE["device"] = args.device
    gpu = common._gpu()
    if not gpu:
        torch._inductor.config.cpp.enable_kernel_profile = True  # (a record_function per generated kernel)
    tokens, width, hidden = bench.MLP_SHAPES[args.shape][0 if gpu else 1]
    info = common.machine()
    where = f"GPU: {info['gpu']}, CUDA {info['cuda']}" if gpu else f"CPU: {info['cpu']} (fp8 emulated)"
    print(f"{where}; torch {info['torch']}; block {tokens} x {width} -> {hidden}, compiled, {args.steps} steps\n")
    model, x = bench.mlp_block(args.shape)
    contenders = {**bench.regions(), "fp8-fast": bench.regions(use_fast_accum=True)["fp8"]}
    results = {name: profile_contender(region, model, x, args.steps) for name, region in contenders.items()}
    unit = "device" if gpu else "CPU self"
    print(f"{unit} time per step, ms    " + "".join(f"{name:>10}" for name in results))
    for key in ("gemm", "fused", "other"):
        print(f"  {key:24}" + "".join(f"{r['groups'].get(key, 0.0) / 1e3:10.3f}" for r in results.values()))
    print(f"  {'total':24}" + "".join(f"{r['total_us'] / 1e3:10.3f}" for r in results.values()))
    for name, result in results.items():
        print(f"\n{name}: the {args.top} largest kernels (ms per step, calls per step)")
        ranked = sorted(result["kernels"].items(), key=lambda item: -item[1]["us"])[: args.top]
        for kernel, row in ranked:
            print(f"  {row['us'] / 1e3:8.3f} {row['calls']:5.1f}  {group(kernel):5}  {kernel[:110]}")
    if not gpu:
        print("\nCPU: fp8 is emulated and inductor's CPU kernels fuse differently: this checks the script only.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": info, "shape": [tokens, width, hidden],
                       "steps": args.steps, "results": results}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
