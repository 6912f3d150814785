"""Eager overhead of mixprec.autocast against native torch.autocast and float32.

Three contenders run the same step on the same model and inputs:

* ``mixprec``: ``mixprec.autocast(device, dtype=torch.bfloat16)`` (the case's policy, if it has one)
* ``native``:  ``torch.autocast(device, dtype=torch.bfloat16)``
* ``fp32``:    no autocast

on these cases, all forward+backward: a small MLP (overhead-dominated), an
``nn.TransformerEncoderLayer``, a small Hugging Face BERT and GPT-2 (built from a
config, nothing downloaded), all under the default policy, where mixprec registers
no kernel and torch's own autocast does the work; a GELU MLP under the device's
default policy ``.with_ops(promote=["gelu"])``, which puts a mixprec kernel on
every GELU without changing a dtype: the cost of one Python kernel per op; and
``mlp_kernels`` and ``gpt2_kernels``, where the mixprec contender runs with every
overload torch registers at the Autocast key given a mixprec kernel (registered
before each of its samples and dropped before the others'): what a policy that
changes every op pays. The kernel cases run last: kernels registered for the
process would be paid by the other cases' GELUs too.

``--device cuda`` runs the same on a GPU, with sizes where the GPU has work (an MLP
of 6 layers 512 wide, an encoder layer of width 768 on 8x512 tokens, BERT base on
16x256, GPT-2 small on 8x512), synchronising before and after each timed loop.

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

    python benchmarks/eager_overhead.py [--device cpu] [--repeats 100] [--sample-ms 10] [--threads 1]
        [--json out.json]

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
#: ``--device``: where the models, inputs and regions are.
DEVICE = {"device": "cpu"}


def _device() -> str:
    return DEVICE["device"]


def _gpu() -> bool:
    return _device() == "cuda"


def _sync() -> None:
    if _gpu():
        torch.cuda.synchronize()


CONTENDERS: dict[str, Callable[[], Any]] = {
    "mixprec": lambda: mixprec.autocast(_device(), dtype=BF16, **COMPUTE),
    "native": lambda: torch.autocast(_device(), dtype=BF16),
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
    kernels: bool = False  # the mixprec contender runs with every native autocast op as a mixprec kernel
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


def _mlp(layers: int, width: int, act: Callable[[], nn.Module]) -> nn.Module:
    body: list[nn.Module] = []
    for _ in range(layers - 1):
        body += [nn.Linear(width, width), act()]
    return nn.Sequential(*body, nn.Linear(width, width)).to(_device())


def mlp_case() -> Case:
    layers, width, batch = (6, 512, 64) if _gpu() else (3, 64, 32)
    model, x = _mlp(layers, width, nn.ReLU), torch.randn(batch, width, device=_device())
    desc = f"MLP {layers}x Linear({width}, {width}) + ReLU, batch {batch}, fwd+bwd"
    return Case("mlp", desc, _train_step(model, x), 1.03)


def mlp_kernels_case() -> Case:
    case = mlp_case()
    desc = case.description + ", every native autocast op a mixprec kernel"
    return Case("mlp_kernels", desc, case.step, 1.05, kernels=True)


def gelu_kernel_case() -> Case:
    width, batch = 64, 32
    model, x = _mlp(3, width, nn.GELU), torch.randn(batch, width, device=_device())
    desc = f"MLP 3x Linear({width}, {width}) + GELU, batch {batch}, fwd+bwd, a mixprec kernel on every GELU"
    policy = (mixprec.policies.CUDA if _gpu() else mixprec.policies.CPU).with_ops(promote=["gelu"])
    return Case("gelu_kernel", desc, _train_step(model, x), 1.10, policy=policy)


def encoder_case() -> Case:
    d_model, nhead, seq, batch = (768, 12, 512, 8) if _gpu() else (256, 4, 64, 8)
    model = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
    model = model.to(_device())
    x = torch.randn(batch, seq, d_model, device=_device())
    desc = f"nn.TransformerEncoderLayer d_model {d_model}, nhead {nhead}, ff {4 * d_model}, seq {seq}, batch {batch}"
    return Case("encoder", desc + ", fwd+bwd", _train_step(model, x), 1.03)


def small_bert() -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """A small HF BertModel in eval mode (built from a config, nothing downloaded), its inputs and a description."""
    from transformers import BertConfig, BertModel

    hidden, layers, heads, seq, batch = (768, 12, 12, 256, 16) if _gpu() else (128, 2, 2, 64, 4)
    config = BertConfig(
        vocab_size=30522 if _gpu() else 1000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq,
    )
    model = BertModel(config).eval().to(_device())  # eval: no dropout, so the contenders compute the same
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(_device()),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=_device()),
    }
    desc = f"HF BertModel hidden {hidden}, {layers} layers, {heads} heads, seq {seq}, batch {batch}"
    return model, inputs, desc


def bert_case() -> Case:
    model, inputs, desc = small_bert()
    return Case("bert", desc + ", fwd+bwd", _bert_step(model, **inputs), 1.03)


def gpt2_case() -> Case:
    """GPT-2 (HF ``GPT2LMHeadModel`` from a config, eval mode: no dropout), language-model loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hidden, layers, heads, seq, batch = (768, 12, 12, 512, 8) if _gpu() else (128, 2, 2, 64, 4)
    vocab = 50257 if _gpu() else 1000
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=seq, vocab_size=vocab)
    model = GPT2LMHeadModel(config).eval().to(_device())
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(_device())

    def step(region: Callable[[], Any]) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with region():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits  # type: ignore[no-any-return]

    desc = f"HF GPT2LMHeadModel hidden {hidden}, {layers} layers, {heads} heads, seq {seq}, batch {batch}, fwd+bwd"
    return Case("gpt2", desc, step, 1.03)


def gpt2_kernels_case() -> Case:
    case = gpt2_case()
    desc = case.description + ", every native autocast op a mixprec kernel"
    return Case("gpt2_kernels", desc, case.step, 1.05, kernels=True)


#: In this order: the last cases register kernels that the others would then pay for.
CASES: dict[str, Callable[[], Case]] = {
    "mlp": mlp_case,
    "encoder": encoder_case,
    "bert": bert_case,
    "gpt2": gpt2_case,
    "gelu_kernel": gelu_kernel_case,
    "mlp_kernels": mlp_kernels_case,
    "gpt2_kernels": gpt2_kernels_case,
}


#: The cases a run without ``--cases`` measures, per device (the kernel cases and GPT-2 on request on a CPU).
DEFAULT_CASES = {
    "cpu": ("mlp", "encoder", "bert", "gelu_kernel"),
    "cuda": ("mlp", "encoder", "bert", "gpt2", "mlp_kernels", "gpt2_kernels"),
}


def contenders(case: Case) -> dict[str, Callable[[], Any]]:
    if case.policy is None:
        return dict(CONTENDERS)
    return {**CONTENDERS, "mixprec": lambda: mixprec.autocast(_device(), dtype=BF16, policy=case.policy, **COMPUTE)}


def _kernels_for(case: Case, contender: str) -> None:
    """A kernels case: every native autocast op a mixprec kernel for the mixprec contender, none for the others."""
    if not case.kernels:
        return
    from mixprec.engine import _kernels, _tables

    mixprec.engine.reset()
    if contender == "mixprec":
        key = _tables.autocast_key(_device())
        _kernels.register(key, _device(), frozenset(_tables.native(_device())))  # type: ignore[arg-type]


def _check_dtypes(case: Case) -> None:
    """Every autocast contender must produce native's output dtype (bfloat16), fp32 must not."""
    got = {}
    for name, region in contenders(case).items():
        _kernels_for(case, name)
        got[name] = case.step(region).dtype
    if any(dtype != got["native"] for name, dtype in got.items() if name != "fp32") or got["fp32"] != torch.float32:
        raise RuntimeError(f"{case.name}: output dtypes disagree, so the comparison is void: {got}")


def _time(case: Case, region: Callable[[], Any], inner: int) -> float:
    step = case.step
    _sync()
    start = time.perf_counter()
    for _ in range(inner):
        step(region)
    _sync()
    return (time.perf_counter() - start) / inner


def run_case(case: Case, repeats: int, warmup: int, sample_ms: float) -> None:
    _check_dtypes(case)
    regions = contenders(case)
    slowest = 0.0
    for name, region in regions.items():
        _kernels_for(case, name)
        _time(case, region, warmup)
        slowest = max(slowest, min(_time(case, region, 1) for _ in range(3)))
    case.inner = max(1, round(sample_ms / 1e3 / slowest))
    # Every order of the contenders in turn: a rotation would keep each contender right behind the same one
    # (mixprec always after fp32), and the first autocast step after a float32 one runs colder.
    orders = list(itertools.permutations(regions))
    case.samples = {name: [] for name in regions}
    for r in range(repeats):
        for name in orders[r % len(orders)]:
            if case.kernels:  # (kernels registered or dropped: the first step rebuilds the tables, untimed)
                _kernels_for(case, name)
                case.step(regions[name])
            case.samples[name].append(_time(case, regions[name], case.inner))
    if case.kernels:
        mixprec.engine.reset()


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
    gpu = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if _gpu() else {}
    return {
        **gpu,
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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--repeats", type=int, default=100, help="interleaved repetitions per case (default 100)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per contender (default 5)")
    parser.add_argument("--sample-ms", type=float, default=10.0, help="target time of one sample, ms (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), help=f"cases to run (default: {', '.join(DEFAULT_CASES['cpu'])}; "
        f"with --device cuda: {', '.join(DEFAULT_CASES['cuda'])})",
    )  # fmt: skip
    parser.add_argument("--compute", choices=["auto", "native", "emulated"], default="auto", help=COMPUTE_HELP)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median and quartiles. Received: {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    DEVICE["device"] = args.device

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    COMPUTE["compute"] = args.compute
    info = machine()
    if _gpu():
        print(f"GPU: {info['gpu']}, CUDA {info['cuda']}")
    print(
        f"torch {info['torch']}, mixprec {info['mixprec']}, {info['cpu']} ({info['logical_cpus']} logical CPUs, "
        f"{info['cpu_capability']}, bf16 flags {info['bf16_cpu_flags'] or 'none'}), threads {info['threads']}, "
        f"repeats {args.repeats}, mixprec compute={args.compute!r}, load average {info['loadavg'][0]:.2f}\n"
    )
    cases = []
    chosen = args.cases or DEFAULT_CASES[args.device]
    for name in [c for c in CASES if c in chosen]:
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
