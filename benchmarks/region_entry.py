"""What entering and leaving a region costs when its policy is a fresh object equal to one used before.

A policy written inline in a training step (``mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["gelu"]))``)
is a new object on every step. mixprec's caches key a policy by its content, so such a step pays what a step
with one policy object pays. Contenders, each ``with region: gelu(x)`` on a 16-element tensor:

* ``native``: ``torch.autocast("cpu")``
* ``same``:   ``mixprec.autocast("cpu", policy=p)``, one policy object for every step
* ``fresh``:  ``mixprec.autocast("cpu", policy=q)``, ``q`` a new object equal to ``p`` on every step (built
  before the timer starts: building it is not the region's cost)

Algorithm::

    warm up every contender
    for r in range(repeats):                      # interleaved, every order in turn
        for contender in permutations(contenders)[r % 6]:
            t = perf_counter(); `inner` steps; sample = (perf_counter() - t) / inner
    report the median per contender, and fresh - same and same - native in ms

Usage::

    python benchmarks/region_entry.py [--repeats 30] [--inner 200] [--json out.json]

The exit status is 1 if ``fresh`` costs more than 0.05 ms over ``same`` (the goal of issue 23).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import mixprec

GOAL_MS = 0.05


def _policy() -> mixprec.Policy:
    return mixprec.policies.CPU.with_ops(fp32=["gelu"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="interleaved repetitions (default 30)")
    parser.add_argument("--inner", type=int, default=200, help="steps per sample (default 200)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.randn(16)
    same = _policy()

    def native(n: int) -> None:
        for _ in range(n):
            with torch.autocast("cpu"):
                torch.nn.functional.gelu(x)

    def same_policy(n: int) -> None:
        for _ in range(n):
            with mixprec.autocast("cpu", policy=same):
                torch.nn.functional.gelu(x)

    def fresh_policy(n: int) -> None:
        fresh = [_policy() for _ in range(n)]
        start = time.perf_counter()
        for policy in fresh:
            with mixprec.autocast("cpu", policy=policy):
                torch.nn.functional.gelu(x)
        fresh_policy.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    contenders: dict[str, Callable[[int], None]] = {"native": native, "same": same_policy, "fresh": fresh_policy}
    for run in contenders.values():
        run(20)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    orders = list(itertools.permutations(contenders))
    for r in range(args.repeats):
        for name in orders[r % len(orders)]:
            start = time.perf_counter()
            contenders[name](args.inner)
            elapsed = time.perf_counter() - start
            if name == "fresh":
                elapsed = fresh_policy.elapsed  # type: ignore[attr-defined]
            samples[name].append(elapsed / args.inner * 1e3)
    median = {name: statistics.median(values) for name, values in samples.items()}
    extra = median["fresh"] - median["same"]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    for name, value in median.items():
        print(f"  {name:7s} {value:.4f} ms per step")
    print(f"  fresh - same   {extra:+.4f} ms (goal <= {GOAL_MS})")
    print(f"  same - native  {median['same'] - median['native']:+.4f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_ms": median, "fresh_minus_same_ms": extra}, f, indent=1)
    return 0 if extra <= GOAL_MS else 1


if __name__ == "__main__":
    sys.exit(main())
