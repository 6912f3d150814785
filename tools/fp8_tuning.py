"""Ways of writing the compiled fp8 linear's quantisation, timed against bf16: for tuning fp8's speed on a GPU.

``benchmarks/fp8_profile.py`` says where the compiled fp8 block's time goes: on an H200 (2026-11-28) the
inductor kernels around the fp8 GEMMs gave back 1.16 ms of the 3.0 ms the GEMMs saved, most of it in one
reduction kernel that did gelu's backward, the bias gradient, the e5m2 quantisation and its transposed copy.
This script times other ways of writing the two places that kernel comes from, each by swapping one function
of ``mixprec.engine._fp8`` for this process (the project's code is the ``engine`` variant):

* ``engine``: mixprec as it is;
* ``column-amax``: a tensorwise amax taken per column, then the largest of those (the same value: a max is
  exact), so a bias gradient's sum over the tokens can fuse into the amax pass, leaving the quantisation and
  its transposed copy a pointwise kernel, which inductor tiles in two dimensions;
* ``opaque-transpose``: the transposed copies the backward GEMMs take made by an opaque op (ATen's copy), so
  inductor's quantisation kernel writes the row-major copy alone;
* ``column-amax+opaque-transpose``: both;
* ``tile-reductions``, ``nd-tiling``: the engine under inductor's ``triton.tile_reductions`` and
  ``triton.prefer_nd_tiling`` (settings a user can turn on; the script reads whether they pay).

Cases, each both contenders compiled, interleaved, medians (``benchmarks/fp8.py``'s timing): the Llama-3-8B
MLP block (``fp8.py``'s ``mlp-llama3-8b``) with biases and without, per variant; then the ~1B Llama-style
step (``fp8.py``'s ``llama``) under the variant fastest on the block with biases, and under ``engine``.
With ``--out DIR``: ``tuning.json``, and inductor's generated code for the block with biases under
``engine`` and ``column-amax`` (``code-<variant>.py``), to read the kernels by.

Usage::

    python tools/fp8_tuning.py --device cuda --out DIR [--variants engine column-amax ...] [--no-llama]
    python tools/fp8_tuning.py                # CPU, small sizes: checks the script (fp8 is emulated there)
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import eager_overhead as common  # noqa: E402
import fp8 as bench  # noqa: E402

from mixprec.engine import _fp8  # noqa: E402


def column_absmax(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    if dim is None and t.dim() == 2:
        return t.abs().amax(dim=0).amax()
    return ENGINE["absmax"](t, dim)


@torch.library.custom_op("mixprec_tuning::transposed", mutates_args=())
def opaque_transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


@opaque_transposed.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty((t.shape[1], t.shape[0]))


ENGINE: dict[str, Callable[..., torch.Tensor]] = {"absmax": _fp8.absmax, "transposed": _fp8.transposed}
#: variant -> (functions of _fp8 swapped, inductor settings)
VARIANTS: dict[str, tuple[dict[str, Callable[..., torch.Tensor]], dict[str, Any]]] = {
    "engine": ({}, {}),
    "column-amax": ({"absmax": column_absmax}, {}),
    "opaque-transpose": ({"transposed": opaque_transposed}, {}),
    "column-amax+opaque-transpose": ({"absmax": column_absmax, "transposed": opaque_transposed}, {}),
    "tile-reductions": ({}, {"triton.tile_reductions": True}),
    "nd-tiling": ({}, {"triton.prefer_nd_tiling": True}),
}


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    swaps, settings = VARIANTS[name]
    torch._dynamo.reset()
    for attr, fn in swaps.items():
        setattr(_fp8, attr, fn)
    try:
        with torch._inductor.config.patch(settings):
            yield
    finally:
        for attr, fn in ENGINE.items():
            setattr(_fp8, attr, fn)
        torch._dynamo.reset()


def generated(cache: str) -> set[str]:
    return set(glob.glob(os.path.join(cache, "**", "*.py"), recursive=True))


def block(name: str, bias: bool, repeats: int, sample_ms: float, cache: str, code: str | None) -> dict[str, Any]:
    before = generated(cache)
    with variant(name):
        case = bench.mlp_cases("llama3-8b", bias)[1]
        bench.run(case, repeats, 3, sample_ms)
    if code is not None:  # the compiled graphs' wrappers, each with its kernels' source
        with open(code, "w") as f:
            for path in sorted(generated(cache) - before):
                with open(path) as src:
                    text = src.read()
                if "def call(" in text:
                    f.write(f"# ===== {os.path.basename(path)}\n{text}\n")
    return bench.summarize(case)


def llama(name: str, repeats: int, sample_ms: float) -> dict[str, Any]:
    with variant(name):
        case = bench.llama_case()[0]
        bench.run(case, repeats, 1, sample_ms)
    return bench.summarize(case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="variants to time (default: all)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per case (default 5)")
    parser.add_argument("--no-llama", action="store_true", help="time the blocks only")
    parser.add_argument("--out", metavar="DIR", help="write tuning.json and the generated code there")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median. Received: {args.repeats}")
    common.DEVICE["device"] = args.device
    gpu = common._gpu()
    sample_ms = 40.0 if gpu else 5.0
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.mkdtemp(prefix="fp8-tuning-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # (read as inductor compiles: a fresh one shows our code alone)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    info = common.machine()
    where = f"GPU: {info['gpu']}, CUDA {info['cuda']}" if gpu else f"CPU: {info['cpu']} (fp8 emulated)"
    print(f"{where}; torch {info['torch']}; repeats {args.repeats}\n", flush=True)
    results: dict[str, Any] = {"machine": info, "blocks": {}, "llama": {}}

    def save() -> None:
        if args.out:
            with open(os.path.join(args.out, "tuning.json"), "w") as f:
                json.dump(results, f, indent=1)

    print(f"{'variant':30} {'biases':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'speed-up':>9} {'(paired)':>9}", flush=True)
    for name in args.variants:
        for bias in (True, False):
            code = None
            if args.out and bias and name in ("engine", "column-amax"):
                code = os.path.join(args.out, f"code-{name}.py")
            try:
                row = block(name, bias, args.repeats, sample_ms, cache, code)
            except Exception as error:  # (a variant inductor refuses is a finding, not the end of the run)
                print(f"{name:30} {bias!s:>6} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            results["blocks"][f"{name}{'' if bias else ' (no biases)'}"] = row
            med = row["median_ms"]
            print(f"{name:30} {bias!s:>6} {med['bf16']:9.3f} {med['fp8']:9.3f} {row['speedup']:8.3f}x "
                  f"{row['paired_speedup']:8.3f}x", flush=True)  # fmt: skip
            save()
    timed = {key: row["paired_speedup"] for key, row in results["blocks"].items() if "(no biases)" not in key}
    if not args.no_llama and timed:
        best = max(timed, key=timed.__getitem__)
        for name in dict.fromkeys([best, "engine"]):
            row = llama(name, 3, 0.0 if not gpu else 300.0)
            results["llama"][name] = row
            med = row["median_ms"]
            print(f"llama step, {name}: bf16 {med['bf16']:.2f} ms, fp8 {med['fp8']:.2f} ms, "
                  f"{row['speedup']:.3f}x (paired {row['paired_speedup']:.3f}x)", flush=True)  # fmt: skip
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
