"""A training loop whose compiled step opens the region inside: mixprec.autocast against torch.autocast.

Each run is a fresh process with empty inductor caches (so every compile is cold, as a user's first run is),
doing::

    @torch.compile(backend=...)          # inductor by default
    def step(x):
        with <region>("cpu"):            # mixprec.autocast or torch.autocast, default policy
            return model(x).float().sum()
    for _ in range(steps): step(x).backward()

It reports the process's compile-and-run time for the loop (the wall time of the steps, the first one
compiling), the number of frames dynamo compiled and the dtype the model ran in. Runs alternate between
the contenders; medians and the mixprec/native ratio are printed.

Usage::

    python benchmarks/compile_time.py [--runs 5] [--steps 20] [--backend inductor] [--graph-break]
                                      [--compute auto]

``--graph-break`` puts a ``torch._dynamo.graph_break()`` inside the region, between the model's layers.
``--compute`` is mixprec's argument: ``auto`` (its default) emulates bfloat16 on a CPU without bf16 units,
where torch.autocast runs its slow bf16 kernels; ``native`` then compares the same compute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = """
import json, time, torch, mixprec
from torch._dynamo.testing import CompileCounterWithBackend
torch.manual_seed(0)
torch.set_num_threads({threads})
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
x = torch.randn(64, 256)
counter = CompileCounterWithBackend({backend!r})
@torch.compile(backend=counter)
def step(x):
    with {region}:
        h = model[1](model[0](x))
        if {graph_break}:
            torch._dynamo.graph_break()
        y = model[2](h)
        return y.float().sum(), y.dtype
start = time.perf_counter()
for _ in range({steps}):
    loss, dtype = step(x)
    loss.backward()
print(json.dumps({{"seconds": time.perf_counter() - start, "frames": counter.frame_count, "dtype": str(dtype)}}))
"""

REGIONS = {"mixprec": "mixprec.autocast('cpu', compute={compute!r})", "native": "torch.autocast('cpu')"}


def run(name: str, args: argparse.Namespace) -> dict[str, object]:
    region = REGIONS[name].format(compute=args.compute)
    code = CHILD.format(region=region, backend=args.backend, steps=args.steps, threads=args.threads,
                        graph_break=args.graph_break)
    with tempfile.TemporaryDirectory() as cache:  # inductor's on-disk caches, empty: every compile is cold
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                              check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--graph-break", action="store_true")
    parser.add_argument("--compute", default="auto", choices=["auto", "native", "emulated"])
    args = parser.parse_args()
    header = subprocess.run(
        [sys.executable, "-c", "import torch, mixprec; print(f'torch {torch.__version__};',"
         " mixprec.kernel_support('cpu', torch.bfloat16))"], capture_output=True, text=True, check=True)
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    print(f"{cpu}; {header.stdout.strip()}; backend {args.backend}, {args.steps} steps, {args.threads} thread(s),"
          f" compute={args.compute!r}{', graph break' if args.graph_break else ''}")
    results: dict[str, list[dict[str, object]]] = {name: [] for name in REGIONS}
    for r in range(args.runs):
        for name in (list(REGIONS) if r % 2 == 0 else list(REGIONS)[::-1]):
            results[name].append(run(name, args))
    medians = {name: statistics.median(float(x["seconds"]) for x in runs) for name, runs in results.items()}
    for name, runs in results.items():
        frames = sorted({int(x["frames"]) for x in runs})
        dtypes = sorted({str(x["dtype"]) for x in runs})
        seconds = ", ".join(f"{float(x['seconds']):.2f}" for x in runs)
        print(f"{name:8s} median {medians[name]:.2f} s ({seconds}); frames compiled {frames}; model dtype {dtypes}")
    print(f"mixprec/native: {medians['mixprec'] / medians['native']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
