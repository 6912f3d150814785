"""torch.compile(model) under mixprec.autocast against the same under native torch.autocast.

Contenders, each calling one shared ``torch.compile(model)`` (inductor; dynamo
keeps one graph per autocast state, selected by its guards):

* ``mixprec``: the compiled model called inside ``mixprec.autocast("cpu", dtype=torch.bfloat16)``
* ``native``:  the same inside ``torch.autocast("cpu", dtype=torch.bfloat16)``
* ``fp32``:    the same outside any region

Cases: ``nn.TransformerEncoderLayer`` forward+backward (training mode) and a Hugging
Face ``BertModel`` from a small config, eval forward under ``no_grad``. ``--device cuda``
runs them on a GPU at ``eager_overhead.py``'s GPU sizes (encoder width 768 on 8x512
tokens, BERT base on 16x256), synchronising around each timed loop.

Algorithm::

    for each case:
        compile and warm up every contender (dtypes checked: both autocast ones bf16)
        count cast nodes: the aten forward graph each contender compiles to (AOT),
            and the exported graphs: native torch.autocast's vs mixprec.graph.apply_policy's
        for r in range(repeats):                       # interleaved, rotating order
            for contender in rotate(contenders, r):
                sample = mean time of `inner` steps
        report medians, mixprec/native (ratio of medians and median of paired ratios)
        region cost (--region-steps N): N more interleaved steps of each autocast contender, timing
            inside each step the region's making + entering and its leaving (perf_counter_ns), medians:
            what the region adds to a step, where the two contenders differ (their graphs are one)

Usage::

    python benchmarks/compiled.py [--device cpu] [--repeats 50] [--sample-ms 20] [--threads 1] [--json out.json]
    python benchmarks/compiled.py --alone mixprec   # one contender per process, as a cross-check
    python benchmarks/compiled.py --region-steps 0  # skip the region cost

The exit status is 1 if the goal mixprec/native <= 1.0 (the ratio of the medians) is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eager_overhead as common

import mixprec
from mixprec.graph import apply_policy

BF16 = torch.bfloat16
CONTENDERS: dict[str, Callable[[], Any]] = {
    "mixprec": lambda: mixprec.autocast(common._device(), dtype=BF16, **common.COMPUTE),
    "native": lambda: torch.autocast(common._device(), dtype=BF16),
    "fp32": contextlib.nullcontext,
}
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default, torch.ops.aten.to.dtype)


def casts_in(gm: torch.fx.GraphModule) -> int:
    """Dtype casts in an aten graph (``_to_copy``, ``convert_element_type``, ``to.dtype``)."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.target in _CASTS
        and (n.target is not torch.ops.aten._to_copy.default or "dtype" in n.kwargs)
    )


def aot_forward_casts(model: nn.Module, call: Callable[[nn.Module], Any], region: Callable[[], Any]) -> int:
    """Cast nodes in the aten forward graph that torch.compile builds for ``model`` under ``region``."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture))
    with region():
        call(compiled)
    torch._dynamo.reset()
    return sum(casts_in(g) for g in graphs)


def export_casts(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
    """Casts in native torch.autocast's exported graph and in apply_policy's rewrite of the fp32 export."""

    class Native(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, *a: Any, **k: Any) -> Any:
            with torch.autocast(common._device(), dtype=BF16):
                return self.inner(*a, **k)

    native = torch.export.export(Native(), args, kwargs, strict=False).run_decompositions({})
    plain = torch.export.export(model, args, kwargs, strict=False)
    policy = mixprec.policies.CUDA if common._gpu() else mixprec.policies.CPU
    rewritten = apply_policy(plain.module(), policy, BF16, device_type=common._device())
    with torch.no_grad():
        ours, theirs = rewritten(*args, **kwargs), native.module()(*args, **kwargs)
    same = all(
        a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs), strict=True)
    )
    return {"native_export": casts_in(native.graph_module), "apply_policy": casts_in(rewritten), "same": same}


def encoder_case() -> tuple[common.Case, dict[str, int]]:
    d_model, nhead, seq, batch = (768, 12, 512, 8) if common._gpu() else (256, 4, 64, 8)
    model = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
    model = model.to(common._device())
    x = torch.randn(batch, seq, d_model, device=common._device())
    counts = {f"aot_{n}": aot_forward_casts(model, lambda m: m(x), r) for n, r in CONTENDERS.items() if n != "fp32"}
    counts.update(export_casts(model.eval(), (x,), {}))
    model.train()
    desc = f"nn.TransformerEncoderLayer d_model {d_model}, nhead {nhead}, ff {4 * d_model}, seq {seq}, batch {batch}"
    return common.Case("encoder", desc + ", fwd+bwd", common._train_step(torch.compile(model), x), 1.0), counts


def bert_case() -> tuple[common.Case, dict[str, int]]:
    model, inputs, desc = common.small_bert()

    def call(m: nn.Module) -> Any:
        with torch.no_grad():
            return m(**inputs)

    counts = {f"aot_{n}": aot_forward_casts(model, call, r) for n, r in CONTENDERS.items() if n != "fp32"}
    counts.update(export_casts(model, (), inputs))
    return common.Case("bert", desc + ", eval fwd (no_grad)", _eval_step(torch.compile(model), **inputs), 1.0), counts


def _eval_step(model: nn.Module, **inputs: torch.Tensor) -> Callable[[Callable[[], Any]], torch.Tensor]:
    def step(region: Callable[[], Any]) -> torch.Tensor:
        with torch.no_grad(), region():
            return model(**inputs).last_hidden_state  # type: ignore[no-any-return]

    return step


CASES = {"encoder": encoder_case, "bert": bert_case}


class _Timed:
    """A contender's region, timed from before it is made to after it is entered, and around its exit."""

    def __init__(self, make: Callable[[], Any], record: list[int]) -> None:
        self.make, self.record = make, record

    def __enter__(self) -> None:
        start = time.perf_counter_ns()
        self.inner = self.make()
        self.inner.__enter__()
        self.entered = time.perf_counter_ns() - start

    def __exit__(self, *exc_info: Any) -> None:
        start = time.perf_counter_ns()
        self.inner.__exit__(*exc_info)
        self.record.append(self.entered + time.perf_counter_ns() - start)


def region_cost(case: common.Case, steps: int) -> dict[str, float]:
    """Median µs per step that making, entering and leaving each autocast contender's region takes, in the
    case's own step (the compiled call between entry and exit leaves the caches cold, as in the timed runs)."""
    names = [name for name in CONTENDERS if name != "fp32"]
    records: dict[str, list[int]] = {name: [] for name in names}
    for i in range(steps):
        for name in names if i % 2 else names[::-1]:
            case.step(lambda name=name: _Timed(CONTENDERS[name], records[name]))
    return {name: statistics.median(r) / 1e3 for name, r in records.items()}


def alone(args: argparse.Namespace) -> int:
    """Time one contender with no other graph compiled in the process (a cross-check of the interleaved run)."""
    region = CONTENDERS[args.alone]
    for name in args.cases:
        case, _ = CASES[name]()
        common._time(case, region, args.warmup)
        inner = max(1, round(args.sample_ms / 1e3 / min(common._time(case, region, 1) for _ in range(3))))
        samples = [common._time(case, region, inner) for _ in range(args.repeats)]
        median, best = statistics.median(samples) * 1e3, min(samples) * 1e3
        print(f"{name:8} {args.alone}: median {median:.3f} ms, min {best:.3f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--repeats", type=int, default=50, help="interleaved repetitions per case (default 50)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--sample-ms", type=float, default=20.0, help="target time of one sample, ms (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases to run")
    parser.add_argument(
        "--alone",
        choices=list(CONTENDERS),
        help="cross-check: time only this contender in this process (median and minimum of --repeats samples)",
    )
    parser.add_argument(
        "--region-steps",
        type=int,
        default=1000,
        help="steps per autocast contender timing the region itself (default 1000; 0 skips it)",
    )
    parser.add_argument("--compute", choices=["auto", "native", "emulated"], default="auto", help=common.COMPUTE_HELP)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median and quartiles. Received: {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    common.DEVICE["device"] = args.device

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    common.CONTENDERS.clear()
    common.CONTENDERS.update(CONTENDERS)
    common.COMPUTE["compute"] = args.compute
    info = common.machine()
    if common._gpu():
        print(f"GPU: {info['gpu']}, CUDA {info['cuda']}")
    print(
        f"torch {info['torch']}, mixprec {info['mixprec']}, {info['cpu']}, threads {info['threads']}, "
        f"bf16 flags {info['bf16_cpu_flags'] or 'none'}, mixprec compute={args.compute!r}, "
        f"repeats {args.repeats}, load average {info['loadavg'][0]:.2f}\n"
    )
    if args.alone:
        return alone(args)
    rows = []
    for name in args.cases:
        case, counts = CASES[name]()
        common.run_case(case, args.repeats, args.warmup, args.sample_ms)
        row = common.summarize(case)
        row["cast_nodes"] = counts
        if args.region_steps:
            row["region_us"] = region_cost(case, args.region_steps)
        rows.append(row)
    common.report(rows)
    print()
    for row in rows:
        c = row["cast_nodes"]
        print(
            f"{row['case']:8} cast nodes: compiled forward (AOT) mixprec {c['aot_mixprec']}, native {c['aot_native']}; "
            f"exported: native torch.autocast {c['native_export']}, mixprec.graph.apply_policy {c['apply_policy']} "
            f"(outputs {'bit-identical' if c['same'] else 'DIFFER'})"
        )
    for row in rows:
        if "region_us" in row:
            cost, step_ms = row["region_us"], row["median_ms"]["native"]
            print(
                f"{row['case']:8} region (make + enter + exit, median of {args.region_steps} steps): "
                f"mixprec {cost['mixprec']:.2f} µs, native {cost['native']:.2f} µs; "
                f"difference {cost['mixprec'] - cost['native']:+.2f} µs = "
                f"{100 * (cost['mixprec'] - cost['native']) / (step_ms * 1e3):+.3f} % of the native step"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": info, "args": vars(args), "cases": rows}, f, indent=1)
    return 0 if all(row["goal_met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
