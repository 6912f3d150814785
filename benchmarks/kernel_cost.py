"""What a mixprec kernel costs over torch's own autocast kernel, per call and per training step.

Two contenders run the same code under a plain ``torch.autocast(device)``:

* ``native``:  torch's C++ kernels at the Autocast key (``mixprec.engine.reset()``: no mixprec kernel);
* ``kernels``: every overload torch registers at the device's Autocast key given a mixprec kernel, which
  reproduces torch's category for it (what a policy that changes every op, a module policy or emulated
  compute pays on each call);
* ``floor`` (reported, not judged): the least any Python kernel can add, for comparison: ``aten::mm`` and
  ``aten::linear`` only, each casting its float32 tensors to the region's dtype by the cheapest call
  (``Tensor.bfloat16``) and calling the op with the Autocast key excluded (no setting, table, cache or
  checkpoint bookkeeping).

Cases:

* ``mm``: one ``torch.mm`` of two 16x16 float32 tensors, per call (goal: at most +5 µs);
* ``mlp``: an MLP of 4 ``Linear(128, 128)`` + ReLU, batch 32, forward and backward (goal: at most 1.05x).

Algorithm::

    for r in range(repeats):                       # interleaved, the order alternating
        for contender in (native, kernels) or (kernels, native):
            install the contender's kernels; warm up
            t = perf_counter(); run `calls` times; [synchronize on CUDA]; sample = elapsed / calls
    report the median sample per contender, their difference (mm) and ratio (mlp)

Usage::

    python benchmarks/kernel_cost.py [--device cpu] [--repeats 7] [--threads 1]

The exit status is 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

import mixprec
from mixprec.engine import _kernels, _tables


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_CONTENDERS = ("native", "kernels", "floor")
_floor: list[torch.library.Library] = []


def _install(contender: str, device: str) -> None:
    mixprec.engine.reset()
    while _floor:
        _floor.pop()._destroy()
    key = _tables.autocast_key(device)
    if contender == "kernels":
        _kernels.register(key, device, frozenset(_tables.native(device)))  # type: ignore[arg-type]
    elif contender == "floor":
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch warns that the kernel replaces its own)
            for name, op in (("mm", torch.ops.aten.mm.default), ("linear", torch.ops.aten.linear.default)):
                library.impl(name, _floor_kernel(op, device, key), key)  # type: ignore[arg-type]
        _floor.append(library)


def _floor_kernel(op: torch._ops.OpOverload, device: str, key: str) -> Callable[..., object]:
    exclude = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    guard = torch._C._ExcludeDispatchKeyGuard
    f32 = torch.float32
    method = {torch.bfloat16: torch.Tensor.bfloat16, torch.float16: torch.Tensor.half}
    call = op._op

    def kernel(*args: object) -> object:
        to = method[torch.get_autocast_dtype(device)]
        with guard(exclude):
            return call(*[to(a) if isinstance(a, torch.Tensor) and a.dtype is f32 else a for a in args])

    return kernel


def _time(run: Callable[[], object], calls: int, device: str, region: bool) -> float:
    """Seconds per ``run()``; inside one ``torch.autocast(device)`` region if ``region``, else each run opens
    its own."""
    with torch.autocast(device, enabled=region):
        for _ in range(max(3, calls // 10)):
            run()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        return (time.perf_counter() - start) / calls


def _cases(device: str) -> dict[str, tuple[Callable[[], object], int, bool]]:
    """``{case: (run, calls per sample, whether the calls share one region)}``."""
    torch.manual_seed(0)
    a, b = torch.randn(16, 16, device=device), torch.randn(16, 16, device=device)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(32, 128, device=device)

    def mm() -> object:  # (inside the one region _time opens: the call alone)
        return torch.mm(a, b)

    def mlp() -> object:
        with torch.autocast(device):
            out = model(x)
        out.float().sum().backward()
        return out

    return {"mm": (mm, 20000, True), "mlp": (mlp, 200, False)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    torch.set_num_threads(args.threads)
    cases = _cases(args.device)
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for contender in _CONTENDERS if r % 2 == 0 else _CONTENDERS[::-1]:
            _install(contender, args.device)
            for name, (run, calls, region) in cases.items():
                samples.setdefault((name, contender), []).append(_time(run, calls, args.device, region))
    mixprec.engine.reset()
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"torch {torch.__version__}, {where}, repeats {args.repeats}")
    med = {key: statistics.median(values) for key, values in samples.items()}
    mm_native, mm_kernels = med[("mm", "native")] * 1e6, med[("mm", "kernels")] * 1e6
    added = mm_kernels - mm_native
    ratio = med[("mlp", "kernels")] / med[("mlp", "native")]
    print(
        f"mm   16x16 per call: native {mm_native:.2f} us, kernels {mm_kernels:.2f} us, added {added:+.2f} us"
        f"  goal <= +5 us {'met' if added <= 5 else 'MISSED'}"
        f"  (floor {med[('mm', 'floor')] * 1e6 - mm_native:+.2f} us)"
    )
    print(
        f"mlp  4x Linear(128) fwd+bwd: native {med[('mlp', 'native')] * 1e3:.3f} ms, "
        f"kernels {med[('mlp', 'kernels')] * 1e3:.3f} ms, ratio {ratio:.3f}"
        f"  goal <= 1.05 {'met' if ratio <= 1.05 else 'MISSED'}"
        f"  (floor {med[('mlp', 'floor')] / med[('mlp', 'native')]:.3f})"
    )
    return 0 if added <= 5 and ratio <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
