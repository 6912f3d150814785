"""fp8 against bf16: an MLP block and a Llama-style training step, eager and under torch.compile.

Contenders, timed interleaved in one process (medians of ``--repeats`` samples, each the mean of enough steps
to fill ``--sample-ms``):

* ``bf16``: ``torch.autocast(device, torch.bfloat16)`` (native autocast, the baseline);
* ``fp8``:  ``mixprec.autocast(device, torch.bfloat16, policy=mixprec.policies.FP8)``: the matmul family's
  three GEMMs through ``torch._scaled_mm`` (tensorwise dynamic scaling, e4m3 / e5m2 gradients; with
  ``--fast-accum``, the forward GEMMs without the accumulator's promotion to float32).

Cases:

* ``mlp-<name>``: ``x -> linear -> gelu -> linear``, forward and backward, at the shapes of issue 25's table
  (tokens x in -> hidden): Llama-3-8B 8192 x 4096 -> 14336, Llama-70B 16384 x 8192 -> 28672, GPT-2 small
  4096 x 768 -> 3072; eager and compiled (one ``torch.compile`` per contender). Each step sets the
  gradients to None first, as a training step's ``zero_grad`` does (before 2026-11-28 they accumulated
  across steps: five extra float32 additions a step in both contenders, 0.42 ms of 8.4 on an H200).
* ``llama``: a training step (forward, cross-entropy, backward, AdamW) of a Llama-style decoder of about 1B
  parameters (16 layers, width 2048, SwiGLU 8192, vocabulary 32000, 4 x 2048 tokens), compiled, with
  ``mixprec.choose_fp8_layers`` choosing the fp8 layers; then ``--loss-steps`` steps of each from the same
  start on the same synthetic data, comparing the final losses (mean of the last 10).

On CPU every case runs at a small size (``--device cpu``, the default) to check the benchmark itself: fp8 is
emulated there (a float32 product of the fp8 values), so its times are no speed figure, and the GPU goals are
reported as not measured.

Goals (an H100, compiled): Llama-3-8B MLP block >= 1.35x bf16, the ~1B step >= 1.2x bf16, its loss within 1%
of bf16's after 200 steps.

Usage::

    python benchmarks/fp8.py --device cuda [--repeats 20] [--cases mlp-llama3-8b llama] [--json out.json]
    python benchmarks/fp8.py                   # CPU: the small sizes

The exit status is 1 where a measured goal is missed (never on CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eager_overhead as common

import mixprec

BF16 = torch.bfloat16

#: tokens, in, hidden: (GPU shape, CPU shape)
MLP_SHAPES = {
    "llama3-8b": ((8192, 4096, 14336), (256, 256, 512)),
    "llama-70b": ((16384, 8192, 28672), (256, 512, 1024)),
    "gpt2-small": ((4096, 768, 3072), (128, 96, 384)),
}
#: layers, width, SwiGLU hidden, vocabulary, batch, sequence: (GPU, CPU)
LLAMA = ((16, 2048, 8192, 32000, 4, 2048), (2, 128, 384, 256, 2, 64))
#: AdamW's learning rate: (GPU, CPU; the small CPU model learns in --loss-steps 20)
LR = (3e-4, 3e-3)
GOALS = {"mlp-llama3-8b-compiled": 1.35, "llama-compiled": 1.2}
LOSS_GOAL = 0.01


#: The fp8 contender's recipe: the default, or with ``use_fast_accum`` (``--fast-accum``).
FP8_RECIPE = {"use_fast_accum": False}


def regions(use_fast_accum: bool | None = None) -> dict[str, Callable[[], Any]]:
    device = common._device()
    fast = FP8_RECIPE["use_fast_accum"] if use_fast_accum is None else use_fast_accum
    policy = mixprec.policies.FP8.with_fp8_recipe(use_fast_accum=fast) if fast else mixprec.policies.FP8
    return {
        "bf16": lambda: torch.autocast(device, dtype=BF16),
        "fp8": lambda: mixprec.autocast(device, dtype=BF16, policy=policy),
    }


@dataclass
class Case:
    name: str
    description: str
    steps: dict[str, Callable[[], Any]]  # contender -> one step
    samples: dict[str, list[float]] = field(default_factory=dict)
    inner: int = 1


def _timed(step: Callable[[], Any], inner: int) -> float:
    common._sync()
    start = time.perf_counter()
    for _ in range(inner):
        step()
    common._sync()
    return (time.perf_counter() - start) / inner


def mlp_block(name: str, bias: bool = True) -> tuple[nn.Module, torch.Tensor]:
    """The ``mlp-<name>`` block (``x -> linear -> gelu -> linear``, with biases unless ``bias`` is False) and
    its input, on the benchmark's device."""
    gpu_shape, cpu_shape = MLP_SHAPES[name]
    tokens, width, hidden = gpu_shape if common._gpu() else cpu_shape
    device = common._device()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(width, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, width, bias=bias))
    return block.to(device), torch.randn(tokens, width, device=device, requires_grad=True)


def block_step(model: nn.Module, x: torch.Tensor, region: Callable[[], Any]) -> Callable[[], Any]:
    """One forward and backward of ``model`` on ``x`` in ``region``, gradients set to None first, as a
    training step's ``zero_grad`` leaves them (so no step adds into the last one's)."""

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with region():
            out = model(x)
        out.float().sum().backward()
        return out

    return step


def mlp_cases(name: str, bias: bool = True) -> list[Case]:
    block, x = mlp_block(name, bias)
    tokens, width = x.shape
    hidden = block[0].out_features
    made = regions()
    desc = f"x -> linear -> gelu -> linear, {tokens} x {width} -> {hidden}{'' if bias else ', no biases'}, fwd+bwd"
    eager = Case(f"mlp-{name}-eager", desc + ", eager", {n: block_step(block, x, r) for n, r in made.items()})
    compiled = Case(f"mlp-{name}-compiled", desc + ", compiled",
                    {n: block_step(torch.compile(block), x, r) for n, r in made.items()})  # fmt: skip
    return [eager, compiled]


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, w))
        h = self.mlp_norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, layers: int, width: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, hidden, max(1, width // 128)) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _llama(seed: int = 0) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    layers, width, hidden, vocab, batch, seq = LLAMA[0] if common._gpu() else LLAMA[1]
    torch.manual_seed(seed)
    model = Llama(layers, width, hidden, vocab).to(common._device())

    def batch_of(step: int) -> torch.Tensor:
        """Synthetic text a model learns: runs of tokens with a per-sequence stride."""
        gen = torch.Generator().manual_seed(step)
        start, stride = (
            torch.randint(0, vocab, (batch, 1), generator=gen),
            torch.randint(1, 8, (batch, 1), generator=gen),
        )
        return ((start + stride * torch.arange(seq + 1)) % vocab).to(common._device())  # (inputs: seq tokens)

    return model, batch_of


def _train_step(model: nn.Module, region: Callable[[], Any], optimizer: torch.optim.Optimizer,
                ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    with region():
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def llama_case() -> tuple[Case, dict[str, Any]]:
    made = regions()
    steps, choices = {}, {}
    models = {}
    for name, region in made.items():
        model, batch_of = _llama()
        if name == "fp8":
            layers = mixprec.choose_fp8_layers(model, min_features=2048 if common._gpu() else 0)
            with torch.no_grad():
                sites = mixprec.explain(model, common._device(), mixprec.policies.FP8, example=(batch_of(0)[:, :-1],))
            in_fp8 = sum(site.runs_in.startswith("float8") for site in sites)
            if not in_fp8:
                raise RuntimeError(
                    f"no call site of the fp8 contender runs in fp8, so the comparison is void:\n{sites}"
                )
            choices = {"fp8": len(layers.fp8), "kept": list(layers.kept), "sites": f"{in_fp8} of {len(sites)}"}
        compiled = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR[0] if common._gpu() else LR[1], fused=common._gpu())
        ids = batch_of(0)
        steps[name] = lambda c=compiled, r=region, o=optimizer, i=ids: _train_step(c, r, o, i)
        models[name] = model
    layers_, width, hidden, vocab, batch, seq = LLAMA[0] if common._gpu() else LLAMA[1]
    params = sum(p.numel() for p in models["bf16"].parameters())
    desc = (f"Llama-style, {layers_} layers, width {width}, SwiGLU {hidden}, vocabulary {vocab}, {params / 1e6:.1f}M "
            f"parameters, {batch} x {seq} tokens, AdamW, compiled; fp8 layers {choices.get('fp8')} (call sites in fp8: "
            f"{choices.get('sites')}), kept {', '.join(choices.get('kept', []))}")  # fmt: skip
    return Case("llama-compiled", desc, steps), choices


def loss_comparison(loss_steps: int) -> dict[str, Any]:
    """``loss_steps`` steps of bf16 and fp8 from the same start on the same data: the final losses."""
    ends = {}
    for name, region in regions().items():
        model, batch_of = _llama()
        if name == "fp8":
            layers = mixprec.choose_fp8_layers(model, min_features=2048 if common._gpu() else 0)
        compiled = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR[0] if common._gpu() else LR[1], fused=common._gpu())
        losses = [float(_train_step(compiled, region, optimizer, batch_of(step))) for step in range(loss_steps)]
        ends[name] = statistics.mean(losses[-10:])
        if name == "fp8":
            layers.remove()
        mixprec.engine.reset()
    relative = abs(ends["fp8"] - ends["bf16"]) / ends["bf16"]
    return {"steps": loss_steps, "bf16": ends["bf16"], "fp8": ends["fp8"], "relative": relative}


def run(case: Case, repeats: int, warmup: int, sample_ms: float) -> None:
    for step in case.steps.values():
        for _ in range(warmup):
            step()
    slowest = max(min(_timed(step, 1) for _ in range(2)) for step in case.steps.values())
    case.inner = max(1, round(sample_ms / 1e3 / slowest))
    orders = list(itertools.permutations(case.steps))
    case.samples = {name: [] for name in case.steps}
    for r in range(repeats):
        for name in orders[r % len(orders)]:
            case.samples[name].append(_timed(case.steps[name], case.inner))


def summarize(case: Case) -> dict[str, Any]:
    med = {name: statistics.median(s) * 1e3 for name, s in case.samples.items()}
    paired = statistics.median(b / f for b, f in zip(case.samples["bf16"], case.samples["fp8"], strict=True))
    goal = GOALS.get(case.name) if common._gpu() else None
    speedup = med["bf16"] / med["fp8"]
    return {"case": case.name, "description": case.description, "median_ms": med, "speedup": speedup,
            "paired_speedup": paired, "inner": case.inner, "goal": goal,
            "goal_met": None if goal is None else speedup >= goal}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved repetitions per case (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="target time of one sample, ms (default 50)")
    cases = [f"mlp-{name}" for name in MLP_SHAPES] + ["llama", "loss"]
    parser.add_argument("--cases", nargs="+", choices=cases, default=cases,
                        help="cases to run (default: all; 'loss' is the Llama loss comparison)")  # fmt: skip
    parser.add_argument("--loss-steps", type=int, help="steps of the loss comparison (default 200 on a GPU, 20 on CPU; "
                        "0 skips it)")  # fmt: skip
    parser.add_argument("--fast-accum", action="store_true",
                        help="the fp8 contender's forward GEMMs with Fp8Recipe.use_fast_accum")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    FP8_RECIPE["use_fast_accum"] = args.fast_accum
    if args.repeats < 3:
        parser.error(f"--repeats must be at least 3 for a median. Received: {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    common.DEVICE["device"] = args.device
    loss_steps = args.loss_steps if args.loss_steps is not None else (200 if common._gpu() else 20)
    info = common.machine()
    where = f"GPU: {info['gpu']}, CUDA {info['cuda']}" if common._gpu() else f"CPU: {info['cpu']} (fp8 emulated)"
    fast = ", fp8 with use_fast_accum" if args.fast_accum else ""
    print(f"{where}; torch {info['torch']}, mixprec {info['mixprec']}, repeats {args.repeats}{fast}\n")
    rows: list[dict[str, Any]] = []
    losses = None

    def save() -> None:  # after every case, so what finished survives a time limit
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": " ".join(sys.argv), "machine": info, "cases": rows, "loss": losses}, f, indent=1)

    for name in (name for name in args.cases if name != "loss"):
        built = llama_case()[0:1] if name == "llama" else mlp_cases(name.removeprefix("mlp-"))
        for case in built:
            run(case, args.repeats, args.warmup, args.sample_ms)
            rows.append(summarize(case))
            med = rows[-1]["median_ms"]
            print(f"measured {case.name}: bf16 {med['bf16']:.2f} ms, fp8 {med['fp8']:.2f} ms", flush=True)
            save()
            torch._dynamo.reset()
            mixprec.engine.reset()
    header = "" if not rows else f"{'case':26} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8 speed-up':>13} {'(paired)':>9}  goal"
    if rows:
        print(header)
        print("-" * len(header))
    for row in rows:
        med = row["median_ms"]
        goal = "-" if row["goal"] is None and common._gpu() else (
            "not measured (CPU)" if row["goal"] is None else
            f">= {row['goal']:.2f}x {'met' if row['goal_met'] else 'MISSED'}")  # fmt: skip
        print(f"{row['case']:26} {med['bf16']:9.2f} {med['fp8']:9.2f} {row['speedup']:12.2f}x "
              f"{row['paired_speedup']:8.2f}x  {goal}")  # fmt: skip
    for row in rows:
        print(f"{row['case']}: {row['description']}; {row['inner']} steps per sample")
    if loss_steps and "loss" in args.cases:
        losses = loss_comparison(loss_steps)
        verdict = (f"goal <= {LOSS_GOAL:.0%} {'met' if losses['relative'] <= LOSS_GOAL else 'MISSED'}"
                   if common._gpu() else "goal not measured (CPU)")  # fmt: skip
        print(
            f"\nloss after {loss_steps} steps (mean of the last 10): bf16 {losses['bf16']:.4f}, fp8 "
            f"{losses['fp8']:.4f}, difference {losses['relative']:.2%}; {verdict}"
        )
    if not common._gpu():
        print(
            "\nCPU: fp8 is emulated (a float32 product of the fp8 values): these times check the benchmark, "
            "they are no fp8 speed figure."
        )
    save()
    missed = any(row["goal_met"] is False for row in rows)
    missed = missed or (common._gpu() and losses is not None and losses["relative"] > LOSS_GOAL)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
