"""fp8 on a GPU: the CPU suite's fp8 checks (``tests/test_fp8*.py``) on CUDA, where ``torch._scaled_mm`` runs
the GEMMs (compute capability 8.9 or later: Ada, Hopper and newer).

Against the same independent emulation: forward values and both gradients for every dynamic recipe; a region
under ``policies.FP8`` runs the fp8 GEMMs with the region's dtype out; checkpointing is bit-equal to none;
compiled (inductor, fullgraph) equals eager; an exported graph rewritten by ``apply_policy`` equals eager bit
for bit; ``choose_fp8_layers`` keeps a layer out; a GPT-2 trained 150 steps
in fp8 ends within 3% of bf16.
"""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.engine import _fp8
from test_fp8 import RECIPES, _emulated, _inputs, checkpoint_grads, fx_pass_runs
from test_fp8_training import _gpt2_losses

FP8 = mixprec.policies.FP8


@pytest.fixture(autouse=True)
def _fp8_capable(device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"torch._scaled_mm needs compute capability 8.9; this GPU has {torch.cuda.get_device_capability()}")
    mixprec.engine.reset()
    yield
    mixprec.engine.reset()


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_forward_and_both_gradients_match_the_emulation(device, recipe, monkeypatch):
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w, b, g = (t.to(device) for t in _inputs(m=64, k=128, n=96))
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = _fp8.linear(*leaves, recipe, torch.float32)
    y.backward(g)
    expected = _emulated(x, w, b, g, recipe)
    for name, got, want in zip(("y", "grad_x", "grad_w", "grad_b"), (y, *(t.grad for t in leaves)), expected,
                               strict=True):  # fmt: skip
        if device != "cuda":
            rtol = atol = 1e-4  # the CPU's float32 product: the emulation up to the order of summation
        elif recipe.scaling == "rowwise":
            rtol = atol = 1e-2  # CUDA's rowwise GEMM gives a float32 output through bfloat16 (_compat.scaled_mm)
        else:
            # Hopper's fp8 tensor cores keep about 14 bits in their accumulator (measured on an H200: 1.3e-3 off
            # an output of magnitude 5.6): an error of order 2^-14 of the sums' size, not of each element
            rtol, atol = 1e-3, 1e-3 * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    assert len(calls) == (3 if device == "cuda" else 0)  # CUDA runs torch._scaled_mm; the CPU a float32 product


def test_fast_accumulation_reaches_the_forward_gemm_and_stays_close(device, monkeypatch):
    # use_fast_accum skips the accumulator's promotion to float32 in the forward GEMM only: on a GPU the output
    # moves by the accumulator's rounding, the gradients not at all (their GEMMs are the same calls)
    flags = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: flags.append(k.get("use_fast_accum")) or real(*a, **k))
    x, w, b, g = (t.to(device) for t in _inputs(m=64, k=1024, n=96))
    results = {}
    for fast in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = _fp8.linear(*leaves, mixprec.policies.Fp8Recipe(use_fast_accum=fast), torch.float32)
        y.backward(g)
        results[fast] = [y, *(t.grad for t in leaves)]
    assert flags == ([False] * 3 + [True, False, False] if device == "cuda" else [])
    (plain_y, *plain_grads), (fast_y, *fast_grads) = results[False], results[True]
    torch.testing.assert_close(fast_y, plain_y, rtol=1e-2, atol=1e-2 * float(plain_y.abs().max()))
    for plain, fast in zip(plain_grads, fast_grads, strict=True):
        assert torch.equal(plain, fast)


def test_a_region_runs_the_fp8_gemms_with_the_output_in_the_region_dtype(device):
    torch.manual_seed(0)
    x, w, b = (torch.randn(*shape, device=device) for shape in ((64, 128), (96, 128), (96,)))
    with mixprec.autocast(device, dtype=torch.bfloat16, policy=FP8):
        out = torch.nn.functional.linear(x, w, b)
        unaligned = torch.nn.functional.linear(x[:30], w, b)
    assert out.dtype is unaligned.dtype is torch.bfloat16
    assert torch.equal(out, _fp8.linear(x, w, b, FP8.fp8_recipe, torch.bfloat16))
    with torch.autocast(device, dtype=torch.bfloat16):
        assert torch.equal(unaligned, torch.nn.functional.linear(x[:30], w, b))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_checkpointing_is_bit_equal_to_none(device, deterministic, scaling):
    policy = FP8.with_fp8_recipe(scaling=scaling)
    plain = checkpoint_grads(policy, "plain", device)
    for mode in ("reentrant", "non-reentrant"):
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpoint_grads(policy, mode, device), strict=True)), mode


def test_compiled_equals_eager_with_no_graph_break(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128)).to(device)
    x = torch.randn(64, 128, device=device)

    def step(inputs):
        with mixprec.autocast(device, dtype=torch.bfloat16, policy=FP8):
            return net(inputs)

    eager = step(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=True)(x)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=1e-1)
    torch._dynamo.reset()


def test_choose_fp8_layers_keeps_a_layer_out(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3))).to(device)
    x = torch.randn(64, 2048, device=device)
    with mixprec.choose_fp8_layers(model) as layers:
        sites = mixprec.explain(model, device, FP8, dtype=torch.bfloat16, example=(x,))  # (CUDA's default: float16)
        with mixprec.autocast(device, dtype=torch.bfloat16, policy=FP8):
            first = model[0](x)
    assert layers.fp8 == ("1",) and [s.runs_in for s in sites] == ["bfloat16", "float8_e4m3fn", "bfloat16"]
    with torch.autocast(device, dtype=torch.bfloat16):
        assert torch.equal(first, model[0](x))


def test_gpt2_trained_150_steps_in_fp8_ends_within_3_percent_of_bf16(device):
    pytest.importorskip("transformers")
    bf16 = _gpt2_losses(mixprec.policies.CUDA, 150, device)
    fp8 = _gpt2_losses(FP8, 150, device)
    end_bf16, end_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10
    assert end_bf16 < 0.5 * bf16[0]
    assert abs(end_fp8 - end_bf16) <= 0.03 * end_bf16, (end_fp8, end_bf16)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_fx_pass_writes_fp8_calls_that_equal_eager_bit_for_bit(device, deterministic, scaling):
    runs, _ = fx_pass_runs(device, FP8.with_fp8_recipe(scaling=scaling))
    for step, ((eager, eager_grads), (got, grads)) in enumerate(zip(runs["eager"], runs["graph"], strict=True)):
        assert got.dtype is torch.bfloat16 and torch.equal(got, eager), step
        assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads, strict=True)), step
