"""Eager overhead of mixprec.autocast against native torch.autocast and float32.

Three contenders run the same step on the same model and inputs:

* ``mixprec``: ``mixprec.autocast("cpu", dtype=torch.bfloat16)`` (the case's policy, if it has one)
* ``native``:  ``torch.autocast("cpu", dtype=torch.bfloat16)``
* ``fp32``:    no autocast

on four cases, all forward+backward: a small MLP (overhead-dominated), an
``nn.TransformerEncoderLayer``, a small Hugging Face BERT (built from a config,
nothing downloaded), all three under the default policy, where mixprec registers
no kernel and torch's own autocast does the work; and a GELU MLP under
``policies.CPU.with_ops(promote=["gelu"])``, which puts a mixprec kernel on every
GELU without changing a dtype: the cost of one Python kernel per op. That case
runs last: kernels stay registered for the process, and BERT's GELUs would pay
for it too.

Algorithm::

    for each case:
        warm up every contender; pick `inner` so one sample takes ~--sample-ms
        for r in range(repeats):                       # interleaved
            for contender in permutations(contenders)[r % n]:  # every order in turn
                t = perf_counter(); step x inner; sample = (perf_counter() - t) / inner
        report the median sample per contender, the ratios of the medians, and
        (paired) the median over repetitions of mixprec/native within one repetition

Absolute times drift on a shared machine; the ratios of contenders measured
side by side in one process are what to read.

Usage::

    python benchmarks/eager_overhead.py [--repeats 100] [--sample-ms 10] [--threads 1] [--json out.json]

The exit status is 1 if a mixprec/native goal is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mixprec

BF16 = torch.bfloat16

#: mixprec's ``compute`` argument (``--compute``): "auto" emulates bfloat16 on a CPU without bf16 units, where
#: torch.autocast runs its slow bf16 kernels; "native" times the same compute as torch's there.
COMPUTE = {"compute": "auto"}

CONTENDERS: dict[str, Callable[[], Any]] = {
    "mixprec": lambda: mixprec.autocast("cpu", dtype=BF16, **COMPUTE),
    "native": lambda: torch.autocast("cpu", dtype=BF16),
    "fp32": contextlib.nullcontext,
}


@dataclass
class Case:
    """One benchmark case: ``step(region)`` runs one iteration inside ``region()``."""

    name: str
    description: str
    step: Callable[[Callable[[], Any]], torch.Tensor]
    goal: float  # the mixprec/native ratio to stay under
    policy: Any = None  # the mixprec contender's policy (None: the default)
    inner: int = 1
    samples: dict[str, list[float]] = field(default_factory=dict)


def _train_step(model: nn.Module, *inputs: torch.Tensor) -> Callable[[Callable[[], Any]], torch.Tensor]:
    """Forward inside the region, backward outside it (as the AMP recipes do)."""

    def step(region: Callable[[], Any]) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with region():
            out = model(*inputs)
        out.float().sum().backward()
        return out

    return step


def _bert_step(model: nn.Module, **inputs: torch.Tensor) -> Callable[[Callable[[], Any]], torch.Tensor]:
    def step(region: Callable[[], Any]) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with region():
            out = model(**inputs).last_hidden_state
        out.float().sum().backward()
        return out  # type: ignore[no-any-return]

    return step


def mlp_case() -> Case:
    width, batch = 64, 32
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)
    )
    x = torch.randn(batch, width)
    return Case("mlp", f"MLP 3x Linear({width}, {width}) + ReLU, batch {batch}, fwd+bwd", _train_step(model, x), 1.03)


def gelu_kernel_case() -> Case:
    width, batch = 64, 32
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
    )
    x = torch.randn(batch, width)
    desc = f"MLP 3x Linear({width}, {width}) + GELU, batch {batch}, fwd+bwd, a mixprec kernel on every GELU"
    policy = mixprec.policies.CPU.with_ops(promote=["gelu"])
    return Case("gelu_kernel", desc, _train_step(model, x), 1.10, policy=policy)


def encoder_case() -> Case:
    d_model, nhead, seq, batch = 256, 4, 64, 8
    model = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
    x = torch.randn(batch, seq, d_model)
    desc = f"nn.TransformerEncoderLayer d_model {d_model}, nhead {nhead}, ff {4 * d_model}, seq {seq}, batch {batch}"
    return Case("encoder", desc + ", fwd+bwd", _train_step(model, x), 1.03)


def small_bert() -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """A small HF BertModel in eval mode (built from a config, nothing downloaded), its inputs and a description."""
    from transformers import BertConfig, BertModel

    hidden, layers, heads, seq, batch = 128, 2, 2, 64, 4
    config = BertConfig(
        vocab_size=1000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq,
    )
    model = BertModel(config).eval()  # eval: no dropout, so the contenders compute the same
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
    }
    desc = f"HF BertModel hidden {hidden}, {layers} layers, {heads} heads, seq {seq}, batch {batch}"
    return model, inputs, desc


def bert_case() -> Case:
    model, inputs, desc = small_bert()
    return Case("bert", desc + ", fwd+bwd", _bert_step(model, **inputs), 1.03)


#: In this order: the last case registers a kernel that the others would then pay for.
CASES: dict[str, Callable[[], Case]] = {
    "mlp": mlp_case,
    "encoder": encoder_case,
    "bert": bert_case,
    "gelu_kernel": gelu_kernel_case,
}


def contenders(case: Case) -> dict[str, Callable[[], Any]]:
    if case.policy is None:
        return dict(CONTENDERS)
    return {**CONTENDERS, "mixprec": lambda: mixprec.autocast("cpu", dtype=BF16, policy=case.policy, **COMPUTE)}


def _check_dtypes(case: Case) -> None:
    """Every autocast contender must produce native's output dtype (bfloat16), fp32 must not."""
    got = {name: case.step(region).dtype for name, region in contenders(case).items()}
    if any(dtype != got["native"] for name, dtype in got.items() if name != "fp32") or got["fp32"] != torch.float32:
        raise RuntimeError(f"{case.name}: output dtypes disagree, so the comparison is void: {got}")


def _time(case: Case, region: Callable[[], Any], inner: int) -> float:
    step = case.step
    start = time.perf_counter()
    for _ in range(inner):
        step(region)
    return (time.perf_counter() - start) / inner


def run_case(case: Case, repeats: int, warmup: int, sample_ms: float) -> None:
    _check_dtypes(case)
    regions = contenders(case)
    slowest = 0.0
    for region in regions.values():
        _time(case, region, warmup)
        slowest = max(slowest, min(_time(case, region, 1) for _ in range(3)))
    case.inner = max(1, round(sample_ms / 1e3 / slowest))
    # Every order of the contenders in turn: a rotation would keep each contender right behind the same one
    # (mixprec always after fp32), and the first autocast step after a float32 one runs colder.
    orders = list(itertools.permutations(regions))
    case.samples = {name: [] for name in regions}
    for r in range(repeats):
        for name in orders[r % len(orders)]:
            case.samples[name].append(_time(case, regions[name], case.inner))


def medians_ms(case: Case) -> dict[str, float]:
    return {name: statistics.median(s) * 1e3 for name, s in case.samples.items()}


def spread_pct(samples: list[float]) -> float:
    """Interquartile range relative to the median, in percent."""
    q = statistics.quantiles(samples, n=4)
    return 100 * (q[2] - q[0]) / statistics.median(samples)


def paired_ratio(case: Case, a: str, b: str) -> float:
    """Median over repetitions of the per-repetition ratio a/b (robust to drift between repetitions)."""
    return statistics.median(x / y for x, y in zip(case.samples[a], case.samples[b], strict=True))


def machine() -> dict[str, Any]:
    """What the numbers were measured on (CPU model and bf16 flags from /proc/cpuinfo where there is one)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            found.setdefault(key.strip(), value.strip())
    model = found.get("model name") or platform.processor() or "unknown"
    flags = found.get("flags", "").split()
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_cpu_flags": [f for f in flags if "bf16" in f or f.startswith("amx")],
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "torch": torch.__version__,
        "mixprec": mixprec.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
    }


def summarize(case: Case) -> dict[str, Any]:
    med = medians_ms(case)
    ratio = med["mixprec"] / med["native"]
    row: dict[str, Any] = {
        "case": case.name,
        "description": case.description,
        "inner": case.inner,
        "median_ms": med,
        "iqr_pct": {name: spread_pct(s) for name, s in case.samples.items()},
        "ratio_mixprec_native": ratio,
        "paired_ratio_mixprec_native": paired_ratio(case, "mixprec", "native"),
        "ratio_mixprec_fp32": med["mixprec"] / med["fp32"],
        "goal_mixprec_native": case.goal,
        "goal_met": ratio <= case.goal,
        "samples_s": case.samples,
    }
    return row


def report(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'case':11} {'mixprec ms':>10} {'native ms':>10} {'fp32 ms':>9} "
        f"{'mix/nat':>8} {'(paired)':>9} {'mix/fp32':>9}  goal mix/nat"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        med = row["median_ms"]
        verdict = "met" if row["goal_met"] else "MISSED"
        print(
            f"{row['case']:11} {med['mixprec']:10.3f} {med['native']:10.3f} {med['fp32']:9.3f} "
            f"{row['ratio_mixprec_native']:8.3f} {row['paired_ratio_mixprec_native']:9.3f} "
            f"{row['ratio_mixprec_fp32']:9.3f}  <= {row['goal_mixprec_native']:.2f} {verdict}"
        )
    print("\nmix/nat is the ratio of the medians; (paired) is the median of the per-repetition ratios.")
    for row in rows:
        iqr = ", ".join(f"{name} {pct:.0f}%" for name, pct in row["iqr_pct"].items())
        print(f"{row['case']:8} {row['description']}; {row['inner']} steps per sample; IQR/median: {iqr}")


COMPUTE_HELP = "mixprec's compute argument (default auto; native compares like with like on a CPU without bf16 units)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100, help="interleaved repetitions per case (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per contender (default 5)")
    parser.add_argument("--sample-ms", type=float, default=10.0, help="target time of one sample, ms (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases to run")
    parser.add_argument("--compute", choices=["auto", "native", "emulated"], default="auto", help=COMPUTE_HELP)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median and quartiles. Received: {args.repeats}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    COMPUTE["compute"] = args.compute
    info = machine()
    print(
        f"torch {info['torch']}, mixprec {info['mixprec']}, {info['cpu']} ({info['logical_cpus']} logical CPUs, "
        f"{info['cpu_capability']}, bf16 flags {info['bf16_cpu_flags'] or 'none'}), threads {info['threads']}, "
        f"repeats {args.repeats}, mixprec compute={args.compute!r}, load average {info['loadavg'][0]:.2f}\n"
    )
    cases = []
    for name in [c for c in CASES if c in args.cases]:
        case = CASES[name]()
        run_case(case, args.repeats, args.warmup, args.sample_ms)
        cases.append(case)
    rows = [summarize(case) for case in cases]
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": info, "args": vars(args), "cases": rows}, f, indent=1)
    return 0 if all(row["goal_met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
