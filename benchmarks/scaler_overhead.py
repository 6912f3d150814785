"""Overhead of mixprec.GradScaler against torch.amp.GradScaler: unscale_ + step + update.

One model (a stack of ``Linear(1024, 1024)`` layers, ~25M parameters) and one
SGD optimizer are shared by both contenders. Its float32 gradients are filled
once with random values and restored (untimed) before every iteration, so each
iteration unscales the same gradients by the same scale::

    for r in range(repeats):                            # interleaved
        for name in rotate([mixprec, torch], r):        # alternating order
            for i in range(inner):
                restore the gradients                   # untimed
                t = perf_counter()
                scaler.unscale_(opt); scaler.step(opt); scaler.update()
                timed += perf_counter() - t
            sample = timed / inner
    report the median per contender and the ratio of the medians (goal <= 1.05)

Absolute times drift on a shared machine; the ratio of contenders measured side
by side in one process is what to read. ``--device cuda`` keeps the model, its
gradients and both scalers on the GPU and synchronises around each timed call.

Usage::

    python benchmarks/scaler_overhead.py [--device cpu] [--repeats 30] [--inner 4] [--threads 1] [--layers 24]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import mixprec

WIDTH = 1024
GOAL = 1.05
CONTENDERS = {"mixprec": mixprec.GradScaler, "torch": torch.amp.GradScaler}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(layers: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """The model, its optimizer, and the saved gradients to restore before every sample."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    saved = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return model, torch.optim.SGD(model.parameters(), lr=1e-9), saved


def sample(
    scaler: Any,
    opt: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    saved: list[torch.Tensor],
    inner: int,
    device: str = "cpu",
) -> float:
    """Mean time of ``inner`` iterations, each on freshly restored gradients."""
    timed = 0.0
    for _ in range(inner):
        torch._foreach_copy_(grads, saved)
        _sync(device)
        start = time.perf_counter()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        _sync(device)
        timed += time.perf_counter() - start
    return timed / inner


def run(
    layers: int, repeats: int, warmup: int, inner: int, device: str = "cpu"
) -> tuple[int, dict[str, list[float]]]:
    model, opt, saved = build(layers, device)
    grads = [p.grad for p in model.parameters()]
    # growth_interval out of reach: the scale stays 2**16 (a real multiply, never 1.0) in every sample.
    scalers = {name: cls(device, growth_interval=10**9) for name, cls in CONTENDERS.items()}
    for scaler in scalers.values():
        scaler.scale(torch.ones((), device=device))  # makes the scale tensor
    for scaler in scalers.values():
        sample(scaler, opt, grads, saved, warmup, device)  # type: ignore[arg-type]
    samples: dict[str, list[float]] = {name: [] for name in scalers}
    names = list(scalers)
    for r in range(repeats):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(sample(scalers[name], opt, grads, saved, inner, device))  # type: ignore[arg-type]
    for name, scaler in scalers.items():
        if scaler.get_scale() != 2.0**16:
            raise RuntimeError(f"{name}: the scale moved ({scaler.get_scale()}), so samples are not alike")
    return sum(p.numel() for p in model.parameters()), samples


def spread_pct(samples: list[float]) -> float:
    """Interquartile range relative to the median, in percent."""
    q = statistics.quantiles(samples, n=4)
    return 100 * (q[2] - q[0]) / statistics.median(samples)


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "logical_cpus": torch.multiprocessing.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "mixprec": mixprec.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def report(n_params: int, layers: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    med = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    ratio = med["mixprec"] / med["torch"]
    paired = statistics.median(a / b for a, b in zip(samples["mixprec"], samples["torch"], strict=True))
    print(f"{layers} x Linear({WIDTH}, {WIDTH}): {n_params / 1e6:.1f}M parameters, float32 grads, SGD\n")
    header = f"{'contender':10} {'median ms':>10} {'IQR/median':>11}"
    print(header)
    print("-" * len(header))
    for name, s in samples.items():
        print(f"{name:10} {med[name]:10.2f} {spread_pct(s):10.1f}%")
    ok = "ok" if ratio <= GOAL else "MISS"
    print(f"\nmixprec/torch: {ratio:.3f} (paired {paired:.3f}), goal <= {GOAL}: {ok}")
    return {
        "params": n_params,
        "layers": layers,
        "median_ms": med,
        "iqr_pct": {name: spread_pct(s) for name, s in samples.items()},
        "ratio_mixprec_torch": ratio,
        "paired_ratio_mixprec_torch": paired,
        "goal": GOAL,
        "goal_met": ratio <= GOAL,
        "samples_s": samples,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved samples per contender (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up samples per contender (default 3)")
    parser.add_argument("--inner", type=int, default=4, help="iterations averaged per sample (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--layers", type=int, default=24, help="Linear(1024, 1024) layers (default 24: ~25M params)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median and quartiles. Received: {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")

    torch.set_num_threads(args.threads)
    info = machine()
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
    print(
        f"torch {info['torch']}, mixprec {info['mixprec']}, {info['cpu']} ({info['logical_cpus']} logical CPUs, "
        f"{info['cpu_capability']}), threads {info['threads']}, repeats {args.repeats} x inner {args.inner}"
    )
    n_params, samples = run(args.layers, args.repeats, args.warmup, args.inner, args.device)
    row = report(n_params, args.layers, samples)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": info, "args": vars(args), "result": row}, f, indent=1)
    return 0 if row["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
