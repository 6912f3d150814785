"""fp8 compute (``engine._fp8``) against an independent emulation, on CPU.

The emulation quantises with ``.to(fp8).float()``, multiplies in float32 and rescales, written here from the
recipe's definition (``policies._recipe``), not from mixprec's code. ``torch._scaled_mm`` on CPU matches it to
float32 rounding, so forward values and both gradients are compared at a tight tolerance, for every dynamic
recipe, with saturation and all-zero inputs, and CUDA's size and layout rules are enforced on CPU.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from mixprec.engine import _fp8
from mixprec.policies._recipe import Fp8Recipe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "tensorwise": Fp8Recipe(),
    "tensorwise-pow2": Fp8Recipe(power_of_2=True),
    "rowwise": Fp8Recipe(scaling="rowwise"),
    "rowwise-pow2-e4m3-grads": Fp8Recipe(scaling="rowwise", power_of_2=True, backward="float8_e4m3fn"),
}


def _q(t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, dim: int | None) -> torch.Tensor:
    """``t`` as the fp8 GEMM sees it, back in float32: quantised by the recipe's definition and rescaled."""
    top = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    s = top / amax.clamp(min=recipe.eps)
    if recipe.power_of_2:
        s = 2.0 ** torch.floor(torch.log2(s))
    return (t * s).clamp(-top, top).to(dtype).float() / s


def _emulated(x, w, b, g, recipe):
    """(y, grad_x, grad_w, grad_b) of ``y = x @ w.t() + b`` with the GEMMs emulated in float32."""
    fwd = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}[recipe.forward]
    bwd = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}[recipe.backward]
    rows = recipe.scaling == "rowwise"
    y = _q(x, fwd, recipe, 1 if rows else None) @ _q(w, fwd, recipe, 1 if rows else None).t() + b
    grad_x = _q(g, bwd, recipe, 1 if rows else None) @ _q(w, fwd, recipe, 0 if rows else None)
    grad_w = _q(g, bwd, recipe, 0 if rows else None).t() @ _q(x, fwd, recipe, 0 if rows else None)
    return y, grad_x, grad_w, g.sum(0)


def _inputs(m=32, k=64, n=48, seed=0, outlier=None):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    if outlier is not None:
        x[0, 0] = outlier
    return x, w, torch.randn(n, generator=gen), torch.randn(m, n, generator=gen)


def _run(x, w, b, g, recipe, out_dtype=torch.float32):
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = _fp8.linear(x, w, b, recipe, out_dtype)
    y.backward(g.to(y.dtype))
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize("outlier", [None, 1e6, 1e-30], ids=["plain", "saturating-outlier", "tiny-outlier"])
def test_forward_and_both_gradients_match_the_emulation(recipe, outlier):
    x, w, b, g = _inputs(outlier=outlier)
    ours = _run(x, w, b, g, recipe)
    expected = _emulated(x, w, b, g, recipe)
    for name, a, e in zip(("y", "grad_x", "grad_w", "grad_b"), ours, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert torch.isfinite(a).all(), name


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_all_zero_inputs_give_zeros_not_nans(recipe):
    x, w, b, g = (torch.zeros_like(t) for t in _inputs())
    y, grad_x, grad_w, grad_b = _run(x, w, b, g, recipe)
    for t in (y, grad_x, grad_w, grad_b):
        assert torch.isfinite(t).all() and not t.any()


def test_values_beyond_the_format_saturate_instead_of_overflowing():
    """With a scale forced small (a huge eps), the scaled values exceed e5m2's range: clamped, not inf."""
    recipe = Fp8Recipe(eps=1e30)
    q, inverse = _fp8.quantise(torch.full((16, 16), 3.0), E5M2, recipe, None)
    assert torch.isfinite(q.float()).all() and inverse.item() == pytest.approx(1e30 / torch.finfo(E5M2).max)
    huge = torch.tensor([[1e38, -1e38]]).repeat(16, 8)
    q, _ = _fp8.quantise(huge, E5M2, Fp8Recipe(eps=1e-12), None)
    assert q.float().abs().max() == torch.finfo(E5M2).max


def test_power_of_2_scales_are_powers_of_two():
    _, inverse = _fp8.quantise(torch.randn(32, 32) * 3, E4M3, Fp8Recipe(power_of_2=True), 1)
    exponent = torch.log2(inverse)
    assert torch.equal(exponent, exponent.round())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_output_is_in_the_asked_dtype_and_gradients_in_the_inputs(out_dtype):
    x, w, b, g = _inputs()
    y, grad_x, grad_w, grad_b = _run(x.reshape(2, 16, 64), w, b, g.reshape(2, 16, 48), Fp8Recipe(), out_dtype)
    assert y.dtype is out_dtype and y.shape == (2, 16, 48)
    assert (grad_x.dtype, grad_x.shape, grad_w.dtype, grad_b.dtype) == (
        torch.float32,
        (2, 16, 64),
        torch.float32,
        torch.float32,
    )


def _torch_scaled_mm_runs_on_this_cpu() -> bool:
    try:
        a = torch.zeros(16, 16).to(E4M3)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
    except RuntimeError:  # oneDNN builds no fp8 matmul on an AVX2-only CPU
        return False
    return True


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_the_cpu_gemm_is_torchs_scaled_mm_up_to_float32_summation_order(rowwise):
    """On CPU mixprec multiplies the fp8 values in float32 (torch's CPU kernel is a reference one, ~1000x
    slower): the same GEMM as an exact (float64) product to float32 rounding, and as torch._scaled_mm where this
    CPU runs it (rowwise scales there from torch 2.12)."""
    from mixprec import _compat

    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 128, generator=gen) * 8).to(E4M3)
    b = (torch.randn(32, 128, generator=gen) * 8).to(E4M3).t()
    sa = torch.rand(64, 1, generator=gen) + 0.5 if rowwise else torch.tensor(0.75)
    sb = torch.rand(1, 32, generator=gen) + 0.5 if rowwise else torch.tensor(1.25)
    ours = _compat.scaled_mm(a, b, sa, sb, torch.float32)
    exact = (a.double() @ b.double() * sa.double() * sb.double()).float()
    rounding = 1e-6 * float(exact.abs().max())  # float32 summation of 128 products: a few ulps of the largest
    torch.testing.assert_close(ours, exact, rtol=1e-6, atol=rounding)
    if _torch_scaled_mm_runs_on_this_cpu() and (not rowwise or _compat.RELEASE >= (2, 12)):
        theirs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=rounding)


def test_cuda_rules_are_enforced_on_every_device():
    a, inv = _fp8.quantise(torch.randn(32, 64), E4M3, Fp8Recipe(), None)
    b, _ = _fp8.quantise(torch.randn(48, 64), E4M3, Fp8Recipe(), None)
    assert _fp8.scaled_mm(a, inv, b.t(), inv, torch.float32).shape == (32, 48)
    with pytest.raises(RuntimeError, match="column-major second one"):
        _fp8.scaled_mm(a, inv, b.t().contiguous(), inv, torch.float32)  # a row-major second operand
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _fp8.scaled_mm(a[:30], inv, b.t(), inv, torch.float32)
    assert _fp8.aligned(32, 64, 48) and not _fp8.aligned(32, 64, 40)


def test_error_against_float32_is_fp8s():
    """The block's relative error against float32 is the fp8 one the notes measured (a few percent)."""
    x, w, b, g = _inputs(m=64, k=256, n=128, seed=3)
    y, *_ = _run(x, w, b, g, Fp8Recipe())
    exact = x @ w.t() + b
    error = ((y - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 8e-2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scaling": "blockwise"}, "scaling"),
        ({"power_of_2": 1}, "power_of_2"),
        ({"use_fast_accum": "yes"}, "use_fast_accum"),
        ({"history": 0}, "history"),
        ({"eps": 0.0}, "eps"),
        ({"eps": float("inf")}, "eps"),
        ({"forward": "bfloat16"}, "forward"),
        ({"backward": "float8_e4m3fnuz"}, "backward"),
        ({"forward": "float8_e5m2"}, "at most one e5m2"),  # its gradient GEMMs would take two (CUDA refuses)
        ({"eps": 1e-37}, "finite float32"),  # 448 / eps overflows: a zero tensor would give NaN
    ],
)
def test_bad_recipes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fp8Recipe(**kwargs)


def test_the_smallest_eps_accepted_keeps_a_zero_tensor_finite():
    smallest = 57344.0 / torch.finfo(torch.float32).max
    recipe = Fp8Recipe(eps=smallest * 1.001)
    x, w = torch.zeros(16, 32, requires_grad=True), torch.nn.Parameter(torch.randn(16, 32))
    with _region(policy=FP8.with_fp8_recipe(eps=recipe.eps)):
        out = torch.nn.functional.linear(x, w)
    out.float().sum().backward()
    assert torch.equal(out.float(), torch.zeros(16, 16)) and bool(w.grad.isfinite().all())


def test_two_e5m2_operands_are_refused_as_cuda_refuses_them():
    a, b = torch.zeros(16, 16, dtype=torch.float8_e5m2), torch.zeros(16, 16, dtype=torch.float8_e5m2).t()
    one = torch.ones(())
    with pytest.raises(RuntimeError, match="two e5m2 operands"):
        _fp8.scaled_mm(a, one, b, one, torch.bfloat16)


def test_a_double_backward_through_an_fp8_gemm_raises_instead_of_dropping_terms():
    """fp8's GEMMs take quantised copies, which have no second derivative: a gradient penalty through one
    raises (it was silently zero); a first-order backward with create_graph still runs."""
    x, w = torch.randn(16, 32, requires_grad=True), torch.nn.Parameter(torch.randn(16, 32))
    with _region(policy=FP8):
        out = torch.tanh(torch.nn.functional.linear(x, w)).float().sum()
    gx, = torch.autograd.grad(out, x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gx**2).sum().backward()


def test_a_weight_is_quantised_once_per_step_and_again_after_the_optimizer_moves_it(monkeypatch):
    """The weight's quantisation is kept while its version counter stands still; an optimizer step (an in-place
    update) bumps it, so the next call quantises the new values; a dead weight leaves no entry."""
    from mixprec import engine

    engine.reset()
    calls = []
    real = _fp8.quantise
    monkeypatch.setattr(_fp8, "quantise", lambda t, *a: calls.append(t.shape) or real(t, *a))
    x, w, *_ = _inputs()
    weight = torch.nn.Parameter(w.clone())
    recipe = Fp8Recipe()
    first = _fp8.linear(x, weight, None, recipe, torch.float32)
    again = _fp8.linear(x, weight, None, recipe, torch.float32)
    assert torch.equal(first, again) and calls.count(weight.shape) == 1  # quantised once for both calls
    weight.grad = torch.ones_like(weight)
    torch.optim.SGD([weight], lr=0.5).step()
    moved = _fp8.linear(x, weight, None, recipe, torch.float32)
    assert calls.count(weight.shape) == 2
    fresh = _fp8.linear(x, torch.nn.Parameter(weight.detach().clone()), None, recipe, torch.float32)
    assert torch.equal(moved, fresh) and not torch.equal(moved, first)
    del weight, fresh, first, again, moved  # (the outputs' graphs hold the weight)
    assert not _fp8._weights  # (entries die with their weights)
    engine.reset()


def test_a_weight_written_without_a_version_bump_is_quantised_again_after_an_optimizer_step():
    """FSDP2 gathers each step's weight into the same tensor under ``_unsafe_preserve_version_counter``, while
    the optimizer steps the shards: the step, not the version, must end the kept quantisation."""
    engine.reset()
    x, w, *_ = _inputs()
    gathered = torch.nn.Parameter(w.clone())
    shard = torch.nn.Parameter(torch.zeros(4))
    first = _fp8.linear(x, gathered, None, Fp8Recipe(), torch.float32)
    shard.grad = torch.ones_like(shard)
    torch.optim.SGD([shard], lr=0.1).step()  # the step, on another tensor
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(gathered):
        gathered.mul_(2)  # the next step's gathered weight, version unchanged
    second = _fp8.linear(x, gathered, None, Fp8Recipe(), torch.float32)
    assert torch.equal(second, _fp8.linear(x, gathered.detach().clone(), None, Fp8Recipe(), torch.float32))
    assert not torch.equal(first, second)
    engine.reset()


# ---------------------------------------------------------------- the fp8 category in a region

import mixprec  # noqa: E402
from mixprec import engine  # noqa: E402
from mixprec.engine import _amax  # noqa: E402
from mixprec.policies._recipe import TENSORWISE  # noqa: E402

FP8 = mixprec.policies.CPU.with_ops(fp8=["linear", "mm", "addmm", "matmul"])


def _region(dtype=torch.bfloat16, policy=FP8):
    return mixprec.autocast("cpu", dtype=dtype, policy=policy, compute="native")


def test_a_weight_quantisation_lives_as_long_as_the_region_and_sees_updates_no_version_counter_sees(monkeypatch):
    """Kept for the region (once however often a layer runs in it), as native keeps a weight's cast, and dropped
    as the region ends: so weights changed between regions through ``.data`` (a target network's soft update,
    hand-written SGD), assigned (``p.data = ...``) or converted (``module.to``), none of which moves the
    parameter's version counter, give what a fresh model with those weights gives. A ``torch.autocast`` region
    under ``install`` drops them at its exit too."""
    engine.reset()
    calls = []
    real = _fp8.quantise
    monkeypatch.setattr(_fp8, "quantise", lambda t, *a: calls.append(tuple(t.shape)) or real(t, *a))
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 48), torch.randn(32, 64)

    def fresh_out(dtype=torch.float32):  # type: ignore[no-untyped-def]
        twin = torch.nn.Linear(64, 48).to(dtype)
        twin.load_state_dict(layer.state_dict())
        with torch.no_grad(), _region():
            return twin(x.to(dtype))

    with torch.no_grad(), _region():
        first, again = layer(x), layer(x)
    assert calls.count((48, 64)) == 1 and torch.equal(first, again) and not _fp8._weights
    layer.weight.data.mul_(0.5)  # (the parameter's version counter does not move)
    with torch.no_grad(), _region():
        halved = layer(x)
    assert calls.count((48, 64)) == 2 and torch.equal(halved, fresh_out())
    layer.weight.data = torch.randn(48, 64)
    with torch.no_grad(), _region():
        assigned = layer(x)
    assert torch.equal(assigned, fresh_out())
    layer.to(torch.bfloat16)
    with torch.no_grad(), _region():
        converted = layer(x.bfloat16())
    assert torch.equal(converted, fresh_out(torch.bfloat16))
    handle = mixprec.install(FP8)
    try:
        with torch.no_grad(), torch.autocast("cpu"):
            layer(x.bfloat16())
            assert _fp8._weights
        assert not _fp8._weights
    finally:
        handle.remove()
    engine.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_ops_in_the_fp8_category_run_the_fp8_gemms_with_the_output_in_the_region_dtype(dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 64), torch.randn(48, 64), torch.randn(48)
    with _region(dtype):
        calls = {
            "linear": torch.nn.functional.linear(x, w, b),
            "mm": torch.mm(x, w.t()),  # a transposed (non-contiguous) second operand
            "addmm": torch.addmm(b, x, w.t()),
            "matmul": torch.matmul(x.reshape(2, 16, 64), w.t()),
        }
    expected = {
        "linear": _fp8.linear(x, w, b, TENSORWISE, dtype),
        "mm": _fp8.linear(x, w, None, TENSORWISE, dtype),
        "addmm": _fp8.linear(x, w, b, TENSORWISE, dtype),
        "matmul": _fp8.linear(x.reshape(2, 16, 64), w, None, TENSORWISE, dtype),
    }
    for name, out in calls.items():
        assert out.dtype is dtype, name
        assert torch.equal(out, expected[name]), name


def test_calls_fp8_cannot_run_fall_back_to_the_region_dtype_as_lower_precision_fp():
    torch.manual_seed(0)
    x, w, b = torch.randn(30, 64), torch.randn(48, 64), torch.randn(48)  # 30 rows: not a multiple of 16
    cases = {
        "unaligned": lambda: torch.nn.functional.linear(x, w),
        "float64": lambda: torch.nn.functional.linear(x.double(), w.double()),
        "addmm-scaled": lambda: torch.addmm(b, x[:16], w.t(), beta=0.5),
        "3-d second operand": lambda: torch.matmul(x[:16].reshape(1, 16, 64), w.t().reshape(1, 64, 48)),
    }
    for name, call in cases.items():
        with _region():
            ours = call()
        with _region(policy=mixprec.policies.CPU):
            native = call()
        assert ours.dtype is native.dtype and torch.equal(ours, native), name


def checkpoint_grads(policy, mode: str, device: str = "cpu") -> list[torch.Tensor]:
    """Two steps of a small MLP under ``policy`` (an optimizer step between them), its forward run plainly or
    under activation checkpointing (``mode``: "plain", "reentrant", "non-reentrant"): the second step's
    gradients (parameters, then the input). Also run on a GPU by tests/cuda/test_cuda_fp8.py."""
    engine.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(32, 64, device=device, requires_grad=True)  # (the reentrant checkpoint needs one)
        with mixprec.autocast(device, dtype=torch.bfloat16, policy=policy, compute="native"):
            if mode == "plain":
                out = net(x)
            else:
                out = torch.utils.checkpoint.checkpoint(net, x, use_reentrant=mode == "reentrant")
        out.float().pow(2).mean().backward()
        if step == 0:
            opt.step()
            opt.zero_grad()
    engine.reset()
    return [p.grad for p in net.parameters()] + [x.grad]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_fp8_training_gradients_and_checkpointing_are_bit_equal(scaling):
    """Gradients with activation checkpointing (reentrant and not) equal those without it (the recompute
    quantises the same values with the same recipe, and under delayed scaling with the same history: the second
    step scales by the first's amaxes)."""
    policy = FP8.with_fp8_recipe(scaling=scaling)
    plain = checkpoint_grads(policy, "plain")
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in plain)
    for mode in ("reentrant", "non-reentrant"):
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpoint_grads(policy, mode), strict=True)), mode


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_a_layer_run_under_no_grad_and_with_grad_in_one_checkpointed_step_gives_the_plain_gradients(scaling):
    """A target from the same layer under no_grad, then the layer with grad (FixMatch, BYOL), in a checkpointed
    forward: the recompute, reentrant or not, quantises as the forward did, and both as without checkpointing.
    (A no_grad call taken for an evaluation scaled by the history before the step's roll, and the recompute's by
    the history after it; inside a reentrant checkpoint's forward, which runs under no_grad, the same call counted
    as training.)"""
    policy = FP8.with_fp8_recipe(scaling=scaling, history=3)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(32, 64, generator=gen) * (1 + 3 * i) for i in range(3)]

    class Net(torch.nn.Module):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.a, self.gate, self.b, self.mode = (torch.nn.Linear(64, 64), torch.nn.Linear(64, 64),
                                                    torch.nn.Linear(64, 32), mode)  # fmt: skip

        def body(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                target = self.a(x * 2)
                gate = torch.sigmoid(self.gate(x))
            return self.a(x) * torch.sigmoid(target) * gate

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.mode == "plain":
                return self.b(self.body(x))
            return self.b(torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=self.mode == "reentrant"))

    def run(mode: str) -> list[torch.Tensor]:
        engine.reset()
        torch.manual_seed(0)
        net = Net(mode)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        seen = []
        for x in data:
            with _region(policy=policy):
                loss = net(x.clone().requires_grad_()).float().pow(2).mean()
            loss.backward()
            seen += [loss.detach()] + [p.grad.clone() for p in net.parameters() if p.grad is not None]
            opt.step()
            opt.zero_grad()
        engine.reset()
        return seen

    plain = run("plain")
    for mode in ("reentrant", "non-reentrant"):
        assert all(torch.equal(a, b) for a, b in zip(plain, run(mode), strict=True)), mode


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_a_backward_called_inside_the_region_gives_the_gradients_of_one_called_after_it(scaling):
    """The backward GEMMs run outside any autocast kernel, so inside an enabled CPU region autocast would meet
    the float32 product that stands for ``_scaled_mm`` on CPU and run it in bfloat16."""
    policy = FP8.with_fp8_recipe(scaling=scaling)

    def grads(inside: bool) -> list[torch.Tensor]:
        engine.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        x = torch.randn(32, 64, requires_grad=True)
        with _region(policy=policy):
            loss = net(x).float().pow(2).mean()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        engine.reset()
        return [p.grad for p in net.parameters()] + [x.grad]

    after, inside = grads(False), grads(True)
    assert all(g.dtype is torch.float32 and g.abs().sum() > 0 for g in after)
    assert all(torch.equal(a, b) for a, b in zip(after, inside, strict=True))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_an_inference_mode_pass_before_training_steps_gives_what_a_no_grad_one_gives(scaling):
    """Lightning's sanity check, for one: an evaluation under ``inference_mode`` before the first training step.
    A weight's kept quantisation and a delayed history made there were inference tensors, so the training step
    that reused them failed (saved for backward; updated in place outside inference mode)."""
    policy = FP8.with_fp8_recipe(scaling=scaling)

    def run(evaluation) -> list[torch.Tensor]:
        engine.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(32, 64)
        with evaluation(), _region(policy=policy):
            seen = [net(x)]
        for _ in range(2):
            with _region(policy=policy):
                out = net(x)
            out.float().pow(2).mean().backward()
            seen += [out.detach(), *(p.grad.clone() for p in net.parameters())]
            opt.step()
            opt.zero_grad()
        engine.reset()
        return seen

    inference, no_grad = run(torch.inference_mode), run(torch.no_grad)
    assert all(torch.equal(a, b) for a, b in zip(inference, no_grad, strict=True))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_a_frozen_weight_or_a_data_input_costs_one_backward_gemm_with_the_same_gradients(scaling, monkeypatch):
    """Only the gradients autograd asks for are computed: a layer whose weight is frozen (LoRA's base layers)
    runs only grad_x's GEMM, and a first layer fed data that needs no gradient only grad_w's; the gradients
    that are asked for equal those of a run that asks for all of them."""
    recipe = Fp8Recipe(scaling=scaling)
    calls = []
    real = _fp8.scaled_mm
    monkeypatch.setattr(_fp8, "scaled_mm", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    x, w, b, g = torch.randn(32, 64), torch.randn(48, 64), torch.randn(48), torch.randn(32, 48)

    def grads(*needed: bool) -> list[torch.Tensor | None]:
        engine.reset()
        leaves = [t.clone().requires_grad_(need) for t, need in zip((x, w, b), needed, strict=True)]
        calls.clear()
        _fp8.linear(*leaves, recipe, torch.bfloat16).backward(g.bfloat16())
        engine.reset()
        return [t.grad for t in leaves]

    every = grads(True, True, True)
    assert len(calls) == 3 and all(t is not None for t in every)
    frozen = grads(True, False, False)
    assert len(calls) == 2 and torch.equal(frozen[0], every[0]) and frozen[1] is frozen[2] is None
    data = grads(False, True, True)
    assert len(calls) == 2 and data[0] is None and torch.equal(data[1], every[1]) and torch.equal(data[2], every[2])


def test_fp8_under_a_torch_func_transform_or_forward_ad_is_refused_with_what_to_do():
    """torch.func runs an autograd Function only at its own layer, above the autocast kernels, where fp8's GEMMs
    cannot be one; before, torch's error spoke of a setup_context method the user never wrote."""
    torch.manual_seed(0)
    net, x = torch.nn.Linear(64, 32), torch.randn(32, 64)

    def loss(params):
        with _region():
            return torch.func.functional_call(net, params, (x,)).float().sum()

    params = {name: p.detach() for name, p in net.named_parameters()}
    with pytest.raises(NotImplementedError, match=r"aten::\w+ cannot run in fp8 under a torch.func transform.*"
                       r"Call the transform or the forward-mode AD outside the fp8 region"):  # fmt: skip
        torch.func.grad(loss)(params)
    with _region(policy=FP8.with_ops(lower_precision_fp=["linear", "mm", "addmm", "matmul"])):  # the fix it names
        torch.func.grad(lambda p: torch.func.functional_call(net, p, (x,)).float().sum())(params)
    import torch.autograd.forward_ad as fwAD

    refused = pytest.raises(NotImplementedError, match=r"cannot run in fp8 under forward-mode AD")
    with fwAD.dual_level(), _region(), refused:  # (and forward-mode AD: the Function has no jvp)
        net(fwAD.make_dual(x, torch.randn_like(x)))


def test_a_module_policy_keeps_a_layer_out_of_fp8():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    x = torch.randn(32, 64)
    with _region():
        with mixprec.set_module_policy(net[1], mixprec.policies.CPU):
            out = net(x)
        inner = net[0](x)
    with _region(policy=mixprec.policies.CPU):
        expected = net[1](inner)
    assert torch.equal(out, expected)
    assert torch.equal(inner, _fp8.linear(x, net[0].weight, net[0].bias, TENSORWISE, torch.bfloat16))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fp8_equals_eager_within_float_tolerance(backend):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    x = torch.randn(32, 64)

    def step(model):
        with _region():
            out = model(x)
        out.float().pow(2).mean().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        return out, grads

    eager_out, eager_grads = step(net)
    torch._dynamo.reset()
    compiled_out, compiled_grads = step(torch.compile(net, backend=backend))
    assert compiled_out.dtype is torch.bfloat16
    # bfloat16 outputs of magnitude ~5: one ulp is 0.03-0.06, and inductor may round one element differently
    torch.testing.assert_close(compiled_out.float(), eager_out.float(), rtol=2e-2, atol=1e-1)
    for a, b in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

    def region_inside(inputs):
        with _region():
            return net(inputs)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    inside = torch.compile(region_inside, backend=backend, fullgraph=True)(x)  # fullgraph: no graph break
    torch.testing.assert_close(inside.float(), eager_out.float(), rtol=2e-2, atol=1e-1)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()


def test_explain_and_the_policy_say_what_fp8_does(tmp_path):
    why = mixprec.explain("linear", "cpu", FP8)
    assert (why.category, why.target, why.runs_in) == ("fp8", "float8_e4m3fn", torch.bfloat16)
    assert "float8_e4m3fn through torch._scaled_mm" in why.note
    assert FP8.target("mm") == "float8_e4m3fn" and FP8.ops("fp8") == ("addmm", "linear", "matmul", "mm")
    with pytest.raises(ValueError, match="Cannot put this op in fp8"):
        mixprec.policies.CPU.with_ops(fp8=["conv2d"])
    assert mixprec.Policy.from_dict(FP8.to_dict()) == FP8
    (tmp_path / "fp8.toml").write_text(FP8.to_toml())
    assert mixprec.Policy.from_file(tmp_path / "fp8.toml") == FP8


class _Block(torch.nn.Module):
    """Every GEMM form fp8 runs (linear, mm by a parameter, a 3-D matmul), and a linear of 30 outputs that it
    cannot run (not a multiple of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)
        self.proj = torch.nn.Parameter(torch.randn(32, 48) / 6)
        self.out = torch.nn.Linear(48, 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(x)))
        h = torch.matmul(torch.mm(h, self.proj).unsqueeze(0), torch.eye(48, device=x.device))
        return self.out(h.squeeze(0))


def fx_pass_runs(device: str, policy, compiled: bool = False):
    """Three steps (SGD between them) of ``_Block`` with a dynamic batch (32, 30, 48 rows: 30 is not a multiple
    of 16), eagerly in a region under ``policy`` and as its exported graph rewritten by ``apply_policy`` (on a
    copy of the block; ``compiled``: and then torch.compile'd, fullgraph): for each, the steps' outputs and
    gradients. Also run on a GPU by tests/cuda/test_cuda_fp8.py."""
    engine.reset()
    torch.manual_seed(0)
    block = _Block().to(device)
    copy = _Block().to(device)
    copy.load_state_dict(block.state_dict())
    batch = torch.export.Dim("batch", min=2, max=1024)
    example = torch.randn(32, 64, device=device)
    exported = torch.export.export(copy, (example,), dynamic_shapes={"x": {0: batch}}).module()
    graph = mixprec.graph.apply_policy(exported, policy, torch.bfloat16, device_type=device)
    if compiled:
        torch._dynamo.reset()
        graph = torch.compile(graph, backend="aot_eager", fullgraph=True)
    runs: dict[str, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {"eager": [], "graph": []}
    models = {"eager": block, "graph": graph}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    for rows in (32, 30, 48):
        x = torch.randn(rows, 64, device=device)
        for name, model in models.items():
            if name == "eager":
                with mixprec.autocast(device, dtype=torch.bfloat16, policy=policy, compute="native"):
                    out = model(x)
            else:
                out = model(x)
            out.float().pow(2).mean().backward()
            runs[name].append((out.detach(), [p.grad.clone() for p in model.parameters()]))
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    torch._dynamo.reset()
    engine.reset()
    return runs, graph


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
def test_the_fx_pass_writes_fp8_calls_that_equal_eager_bit_for_bit(scaling):
    """An exported graph rewritten under an fp8 policy gives eager mixprec's outputs and gradients bit for bit
    with every recipe, through optimizer steps (delayed: the same history) and a dynamic batch that is aligned
    in some steps and not in others (each fp8 node decides when it runs, as the kernels decide per call)."""
    policy = FP8.with_fp8_recipe(scaling=scaling, power_of_2=scaling == "rowwise")
    runs, graph = fx_pass_runs("cpu", policy)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    fp8 = [n.args[0] for n in nodes if n.target is mixprec.graph._fp8.scaled_call]
    ops = torch.ops.aten
    # with a dynamic batch these may run in fp8 (their nodes decide per call); `out`, of 30 outputs, never can
    assert fp8 == [ops.linear.default, ops.linear.default, ops.mm.default, ops.matmul.default]
    assert ops.linear.default in {n.target for n in nodes}
    for step, ((eager, eager_grads), (got, grads)) in enumerate(zip(runs["eager"], runs["graph"], strict=True)):
        assert got.dtype is torch.bfloat16 and torch.equal(got, eager), step
        assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads, strict=True)), step


def test_an_fp8_graph_compiles_whole_exports_again_and_runs_inside_a_region():
    runs, _ = fx_pass_runs("cpu", FP8, compiled=True)
    for (eager, eager_grads), (got, grads) in zip(runs["eager"], runs["graph"], strict=True):
        torch.testing.assert_close(got.float(), eager.float(), rtol=2e-2, atol=1e-1)
        for a, b in zip(eager_grads, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(32, 64)
    graph = mixprec.graph.apply_policy(torch.export.export(block, (x,)).module(), FP8, torch.bfloat16)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert sum(n.target is mixprec.graph._fp8.scaled_call for n in nodes) == 4  # static sizes: `out` is cast
    assert torch.ops.aten.linear.default in {n.target for n in nodes} and mixprec.graph.cast_nodes(graph) == 2
    with _region():
        eager = block(x)
    again = torch.export.export(graph, (x,)).module()  # the fp8 calls written out as ATen ops
    assert torch.equal(again(x), eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a graph run in a region: the fp8 calls do not cast again
        assert torch.equal(graph(x), eager)
    assert not mixprec.engine._fp8._weights  # (outside a region a call keeps nothing past it)
    with torch.no_grad():
        graph(x)
        for p in (*graph.parameters(), *block.parameters()):  # seen by no version counter: quantised afresh
            p.data.mul_(0.5)
        with _region():
            assert torch.equal(graph(x), block(x))
    with pytest.raises(RuntimeError, match="fp8 with delayed scaling cannot run under torch"):
        torch.export.export(mixprec.graph.apply_policy(
            torch.export.export(block, (x,)).module(), FP8.with_fp8_recipe(scaling="delayed"), torch.bfloat16
        ), (x,))  # fmt: skip


@pytest.mark.parametrize("release", sorted(importlib.import_module("mixprec.policies.cuda").RELEASES))
def test_the_builtin_fp8_policy_is_cuda_with_the_matmul_family_in_fp8(release):
    fp8, cuda = mixprec.policies.lists("FP8", release), mixprec.policies.lists("CUDA", release)
    family = {"linear", "mm", "addmm", "matmul"}
    assert set(fp8["fp8"]) == family and family <= set(cuda["lower_precision_fp"])
    moved = {c: set(ops) - (family if c == "lower_precision_fp" else set()) for c, ops in cuda.items()}
    assert {category: set(ops) for category, ops in fp8.items() if category != "fp8"} == moved
    policy = mixprec.policies.FP8
    assert policy.ops("fp8") == ("addmm", "linear", "matmul", "mm") and policy.fp8_recipe == TENSORWISE
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    with _region(policy=policy):
        out = torch.nn.functional.linear(x, w)
    assert torch.equal(out, _fp8.linear(x, w, None, TENSORWISE, torch.bfloat16))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fast_accumulation_is_asked_of_the_forward_gemm_alone(monkeypatch, scaling):
    # torch._scaled_mm's use_fast_accum for the forward GEMM only (the gradients' GEMMs keep promoting to
    # float32, as torchao's default does); the CPU's float32 product is the same either way.
    from mixprec import _compat

    asked = []
    real = _compat.scaled_mm
    monkeypatch.setattr(_compat, "scaled_mm", lambda *a: asked.append(a[5]) or real(*a))
    x, w, b, g = _inputs(m=32, k=64, n=48)
    results = {}
    for fast in (False, True):
        asked.clear()
        recipe = Fp8Recipe(scaling=scaling, use_fast_accum=fast)
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        with _region(policy=FP8.with_fp8_recipe(recipe)):
            y = torch.nn.functional.linear(*leaves)
        y.float().backward(g)
        assert asked == [fast, False, False], (fast, asked)  # forward, then grad_x and grad_w
        results[fast] = [y, *(t.grad for t in leaves)]
    for plain, fast in zip(results[False], results[True], strict=True):
        assert torch.equal(plain, fast)
    policy = FP8.with_fp8_recipe(use_fast_accum=True)
    assert policy.to_dict()["fp8"] == {"use_fast_accum": True}
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy


def test_the_policy_chooses_the_recipe_and_carries_it_through_toml(tmp_path):
    torch.manual_seed(0)
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    x[0, 0] = 1e6  # an outlier: tensorwise scaling flushes the other rows to zero, rowwise keeps them
    rowwise = FP8.with_fp8_recipe(scaling="rowwise", power_of_2=True)
    assert rowwise.fp8_recipe == Fp8Recipe(scaling="rowwise", power_of_2=True) and FP8.fp8_recipe == TENSORWISE
    assert rowwise != FP8 and rowwise.with_fp8_recipe(TENSORWISE) == FP8 and FP8.fp8 is None
    assert mixprec.Policy(FP8.name, FP8.table, FP8.base, TENSORWISE) == FP8  # one spelling of the default
    outs = {}
    for name, policy in (("tensorwise", FP8), ("rowwise", rowwise)):
        with _region(policy=policy):
            outs[name] = torch.nn.functional.linear(x, w)
        assert torch.equal(outs[name], _fp8.linear(x, w, None, policy.fp8_recipe, torch.bfloat16)), name
    exact = (x @ w.t())[1:]
    error = {name: ((out.float()[1:] - exact).norm() / exact.norm()).item() for name, out in outs.items()}
    assert error["rowwise"] < error["tensorwise"] / 4, error
    assert rowwise.to_dict()["fp8"] == {"scaling": "rowwise", "power_of_2": True}
    assert "fp8" not in FP8.to_dict()
    (tmp_path / "rowwise.toml").write_text(rowwise.to_toml())
    assert "[fp8]" in rowwise.to_toml() and mixprec.Policy.from_file(tmp_path / "rowwise.toml") == rowwise
    assert mixprec.Policy.from_dict(rowwise.to_dict()) == rowwise


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: FP8.with_fp8_recipe(scaling="blockwise"), ValueError, "Fp8Recipe scaling is invalid"),
        (lambda: FP8.with_fp8_recipe(granularity="row"), TypeError, "unknown field"),
        (lambda: FP8.with_fp8_recipe("rowwise"), TypeError, "it must be an fp8 recipe"),
        (lambda: mixprec.Policy("p", {}, fp8="rowwise"), TypeError, "Policy fp8 is invalid"),
        (lambda: mixprec.Policy.from_dict({"name": "p", "fp8": {"history": 0}}), ValueError, "history"),
        (lambda: mixprec.Policy.from_dict({"name": "p", "fp8": {"rows": 1}}), ValueError, "unknown field"),
        (lambda: mixprec.Policy.from_dict({"name": "p", "fp8": "rowwise"}), ValueError, "fp8 must map"),
    ],
)
def test_bad_recipes_on_a_policy_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _delayed_steps(recipe, xs, grads, w0, b0):
    """Train-like steps of one linear under a delayed recipe: each step runs the layer, backward, then moves the
    weight (bumping its version, as an optimizer does). Returns (outputs, input grads, weight grads)."""
    w = w0.clone().requires_grad_(True)
    b = b0.clone().requires_grad_(True)
    outs, gxs, gws = [], [], []
    for x, g in zip(xs, grads, strict=True):
        x = x.clone().requires_grad_(True)
        y = _fp8.linear(x, w, b, recipe, torch.float32)
        y.backward(g)
        outs.append(y.detach())
        gxs.append(x.grad)
        gws.append(w.grad.clone())
        with torch.no_grad():
            w.sub_(0.01 * w.grad)
        w.grad = None
    return outs, gxs, gws


def _delayed_emulation(recipe, xs, grads, w0, b0):
    """The same steps written from the recipe's definition: step 0 scales by its own amaxes, step s by the
    largest amax of the last ``history`` steps (the input's, weight's and gradient's each)."""
    fwd = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}[recipe.forward]
    bwd = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}[recipe.backward]

    def q(t, dtype, amax):
        s = torch.finfo(dtype).max / amax.clamp(min=recipe.eps)
        if recipe.power_of_2:
            s = 2.0 ** torch.floor(torch.log2(s))
        return (t * s).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / s

    w = w0.clone()
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    outs, gxs, gws = [], [], []
    for x, g in zip(xs, grads, strict=True):
        now = (x.abs().amax(), w.abs().amax(), g.abs().amax())
        used = now if not seen else tuple(torch.stack([s[i] for s in seen[-recipe.history:]]).amax() for i in range(3))
        xq, wq, gq = q(x, fwd, used[0]), q(w, fwd, used[1]), q(g, bwd, used[2])
        outs.append(xq @ wq.t() + b0)
        gxs.append(gq @ wq)
        gws.append(gq.t() @ xq)
        seen.append(now)
        w = w - 0.01 * gws[-1]
    return outs, gxs, gws


@pytest.mark.parametrize("power_of_2", [False, True], ids=["plain", "pow2"])
def test_delayed_scaling_scales_by_the_largest_amax_of_the_last_steps(power_of_2):
    """Inputs whose range moves from step to step: each step's scales come from the history, not the step's
    own amax, so a step larger than its history saturates (clamped to the format's largest value)."""
    recipe = Fp8Recipe(scaling="delayed", history=2, power_of_2=power_of_2)
    gen = torch.Generator().manual_seed(0)
    ranges = [1.0, 4.0, 0.5, 0.25, 8.0]
    xs = [torch.randn(32, 64, generator=gen) * r for r in ranges]
    grads = [torch.randn(32, 48, generator=gen) * r for r in reversed(ranges)]
    w0, b0 = torch.randn(48, 64, generator=gen) * 0.1, torch.randn(48, generator=gen)
    engine.reset()
    ours = _delayed_steps(recipe, xs, grads, w0, b0)
    expected = _delayed_emulation(recipe, xs, grads, w0, b0)
    for name, a_steps, b_steps in zip(("y", "grad_x", "grad_w"), ours, expected, strict=True):
        for step, (a, b) in enumerate(zip(a_steps, b_steps, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4, msg=f"{name} at step {step}")
    # step 1's input is 4x step 0's, whose amax scales it: its largest values saturate at e4m3's 448
    top = torch.finfo(E4M3).max
    assert (ours[0][1].abs().amax() > 0) and torch.isfinite(ours[0][1]).all()
    saturated = (xs[1].abs() * (top / xs[0].abs().amax()) >= top).sum()
    assert saturated > 0
    engine.reset()


def test_delayed_histories_save_and_load_through_weights_only_torch_load(tmp_path):
    """Training resumed from a saved model, optimizer and amax history gives what uninterrupted training gives."""
    policy = FP8.with_fp8_recipe(scaling="delayed", history=3)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(32, 64, generator=gen) * (1 + i) for i in range(6)]

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        return net, torch.optim.SGD(net.parameters(), lr=0.01)

    def step(net, opt, x):
        with _region(policy=policy):
            loss = net(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    engine.reset()
    net, opt = make()
    straight = [step(net, opt, x) for x in data]
    engine.reset()
    net, opt = make()
    first = [step(net, opt, x) for x in data[:3]]
    history = mixprec.AmaxHistory(net).state_dict()
    assert sorted(history) == sorted(f"{i}.{p}.amax_{k}" for i in (0, 2) for p in ("weight",)
                                     for k in ("history", "pending", "steps"))  # fmt: skip
    assert history["0.weight.amax_history"].shape == (3, 3) and int(history["0.weight.amax_steps"]) == 2
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "amax": history}, tmp_path / "ckpt.pt")
    engine.reset()  # a fresh process: no history
    net, opt = make()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    mixprec.AmaxHistory(net).load_state_dict(saved["amax"])
    resumed = first + [step(net, opt, x) for x in data[3:]]
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    engine.reset()
    net, opt = make()  # without the history, step 3 scales dynamically and the losses differ
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert not torch.equal(step(net, opt, data[3]), straight[3])
    engine.reset()


def test_an_inference_mode_evaluation_leaves_the_delayed_histories_as_training_left_them():
    """Evaluation under ``inference_mode`` before the first step, between steps and after the last scales
    dynamically and neither rolls a history nor records its amaxes: training with it equals training without
    it, bit for bit, however large the evaluation's data. Under a process group the roll is a collective, and one
    rank evaluating alone (after the last step, say) waited for the others for ever (``test_fp8_distributed``).
    Under a plain ``no_grad`` a forward counts as training and records (a reentrant checkpoint's forward runs under
    one): the control."""
    policy, dynamic = FP8.with_fp8_recipe(scaling="delayed", history=3), FP8.with_fp8_recipe(scaling="tensorwise")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(32, 64, generator=gen) * (1 + i) for i in range(4)]
    probe = torch.randn(32, 64, generator=gen) * 1000
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}

    def train(evaluate: str | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor]]:
        engine.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        losses, seen = [], []

        def look() -> None:
            if evaluate is not None:
                for recipe in (policy, dynamic):
                    with modes[evaluate](), _region(policy=recipe):
                        seen.append(net(probe).clone())

        look()
        for x in data:
            with _region(policy=policy):
                loss = net(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            look()
        history = mixprec.AmaxHistory(net).state_dict()
        engine.reset()
        return losses, history, seen

    straight, straight_history, _ = train(None)
    losses, history, seen = train("inference_mode")
    assert all(torch.equal(a, b) for a, b in zip(straight, losses, strict=True))
    assert history.keys() == straight_history.keys() and history
    assert all(torch.equal(history[k], straight_history[k]) for k in history), history
    assert len(seen) == 2 * (len(data) + 1)
    for delayed, tensorwise in zip(seen[::2], seen[1::2], strict=True):  # each look scaled as tensorwise does
        assert torch.isfinite(delayed).all() and torch.equal(delayed, tensorwise)
    losses, history, _ = train("no_grad")  # the control: the probe's amaxes reach the histories and the scales
    assert not torch.equal(history["0.weight.amax_history"], straight_history["0.weight.amax_history"])
    assert not all(torch.equal(a, b) for a, b in zip(straight, losses, strict=True))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_delayed_scaling_under_a_float16_grad_scaler_skips_overflows_and_recovers_as_tensorwise(bias):
    """A float16 region, a GradScaler: a scale that overflows the gradients at first, one raised mid-run, and an
    inf in a step's input. Every overflow is skipped (a delayed scale is finite, so an inf used to saturate to
    the format's largest value, unseen without a bias's gradient), no inf or NaN amax enters a history (it used
    to make every scale 0 from the next roll on: every later step skipped), and training recovers: the steps
    skipped are tensorwise's."""

    def skipped(scaling: str) -> tuple[list[int], list[torch.Tensor]]:
        engine.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=bias), torch.nn.GELU(),
                                  torch.nn.Linear(64, 32, bias=bias))  # fmt: skip
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**30)
        policy = FP8.with_fp8_recipe(scaling=scaling, history=4)
        out = []
        for step in range(18):
            if step == 9:
                scaler.update(new_scale=2.0**30)
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            if step == 14:
                x[0, 0] = float("inf")
            with _region(torch.float16, policy):
                loss = net(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(int(scaler.last_step_skipped))
        histories = [site.history.clone() for site in _amax._sites.values()]
        engine.reset()
        return out, histories

    delayed, histories = skipped("delayed")
    tensorwise, _ = skipped("tensorwise")
    assert delayed == tensorwise and delayed[14] == 1 and delayed[-1] == 0 and sum(delayed) < 14, delayed
    assert histories and all(torch.isfinite(h).all() for h in histories)


@pytest.mark.parametrize("how", ["eager", "compiled", "checkpointed", "reentrant"])
def test_a_backward_inside_the_region_quantises_no_gradient_of_a_layer_kept_out_of_fp8(how):
    """A backward run inside the fp8 region (or the one AOTAutograd traces under the forward's state) meets the
    kept layer's gradient GEMMs at the autocast kernels: they are cast to the region's dtype, never run in fp8;
    a checkpoint's recompute in that backward still runs the fp8 layer's forward in fp8. Gradients equal those
    of a backward run outside the region, and the compiled graphs hold no float8 for the kept layer."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint

    graphs: dict[str, str] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def compiler(gm, _):  # type: ignore[no-untyped-def]
            graphs[name] = str(gm.code)
            return gm

        return compiler

    def run(inside: bool) -> list[torch.Tensor]:
        engine.reset()
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        handle = mixprec.set_module_policy(net[0], mixprec.policies.CPU)  # kept out of fp8
        x = torch.randn(32, 64, requires_grad=True)
        call = net
        if how == "compiled":
            call = torch.compile(net, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
        elif how in ("checkpointed", "reentrant"):
            call = lambda t: checkpoint(net, t, use_reentrant=how == "reentrant")  # noqa: E731
        with _region():
            loss = call(x).float().pow(2).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        handle.remove()
        return [x.grad, *(p.grad for p in net.parameters())]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)
    if how == "compiled":
        assert "float8_e5m2" in graphs["bw"]  # the fp8 layer's gradient, in its Function's backward
        assert "float8_e4m3fn" not in graphs["bw"]  # (the kept layer's GEMMs quantised their operands so)
    torch._dynamo.reset()
    engine.reset()


def test_delayed_scaling_refuses_torch_compile_clearly():
    net = torch.nn.Linear(64, 32)
    policy = FP8.with_fp8_recipe(scaling="delayed")

    def run(x):
        with _region(policy=policy):
            return net(x)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"delayed scaling cannot run under torch\.compile"):
        torch.compile(run, backend="aot_eager", fullgraph=True)(torch.randn(32, 64))
    torch._dynamo.reset()
    engine.reset()


# ---------------------------------------------------------------- the doctor's fp8 columns


def _doctor_target(outlier: float):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(32, 64)
    x[0, 0] = outlier
    return net, (x,), lambda out: out.float().pow(2).mean()


def test_the_doctor_reports_each_fp8_call_sites_amax_saturation_flushing_and_error():
    from mixprec import diagnostics

    target = _doctor_target(1e4)  # one huge input value: the tensorwise scale flushes the small ones to zero
    report = diagnostics.diagnose(target, "cpu", torch.bfloat16, FP8)
    sites = [r for r in report.rows if r.fp8_format is not None]
    assert [(r.module, r.fp8_format) for r in sites] == [("0", "float8_e4m3fn"), ("2", "float8_e4m3fn")]
    first = sites[0]
    net, (x,), _ = target
    assert first.fp8_amax == 1e4 and first.fp8_amax_weight == float(net[0].weight.abs().max())
    # independently: the values below half the smallest e4m3 subnormal (2**-10) after scaling by 448 / 1e4
    factor = torch.finfo(E4M3).max / 1e4
    small = ((x != 0) & (x.abs() * factor < 2.0**-10)).sum() + ((net[0].weight != 0) & (
        net[0].weight.abs() * torch.finfo(E4M3).max / net[0].weight.abs().max() < 2.0**-10)).sum()
    assert first.fp8_flushed == pytest.approx(float(small) / (x.numel() + net[0].weight.numel()), abs=2e-3)
    assert first.fp8_flushed > 0 and first.fp8_saturated == 0.0  # a dynamic scale never saturates
    with _region(policy=FP8):
        out = net[0](x)
    exact = x.float() @ net[0].weight.t() + net[0].bias
    assert first.fp8_error == pytest.approx(float((out.float() - exact).abs().max() / exact.abs().max()))
    # the backward: the incoming gradient of the first linear, quantised to e5m2 (independently: its own grad)
    grads = []
    net[0].register_full_backward_hook(lambda module, grad_in, grad_out: grads.append(grad_out[0]))
    with _region(policy=FP8):
        target[2](net(x)).backward()
    g = grads[0].float()
    assert first.fp8_grad_format == "float8_e5m2" and first.fp8_grad_amax == pytest.approx(float(g.abs().max()))
    e5m2 = torch.finfo(E5M2)
    flushed = ((g != 0) & (g.abs() * e5m2.max / g.abs().max() < e5m2.smallest_normal * 2.0**-3)).float().mean()
    assert first.fp8_grad_flushed == pytest.approx(float(flushed), abs=1e-3) and first.fp8_grad_saturated == 0.0
    json_row = report.to_json("t")["ops"][first.index]
    assert json_row["fp8_format"] == "float8_e4m3fn" and json_row["fp8_flushed"] == first.fp8_flushed
    plain = diagnostics.diagnose(_doctor_target(1.0), "cpu", torch.bfloat16, mixprec.policies.CPU)
    assert all(r.fp8_format is None and r.fp8_error is None for r in plain.rows)


def test_the_doctor_reports_every_gemm_of_a_multi_head_attention():
    """F.multi_head_attention_forward runs its in- and out-projections inside one torch call, which the recorder
    sees as one op: its row holds the worst of its fp8 GEMMs (it kept the last one's alone, the out-projection's),
    forward and backward."""
    from mixprec import diagnostics

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(64, 4)
    x = torch.randn(16, 2, 64)
    x[0, 0, 0] = 300.0  # the query's outlier: only the in-projection sees it (the out-projection reads softmax mixes)

    def loss_fn(out):
        return out[0].float().pow(2).mean()

    report = diagnostics.diagnose((attention, (x, x, x), loss_fn), "cpu", torch.bfloat16, FP8)
    rows = [r for r in report.rows if r.fp8_format is not None]
    assert len(rows) == 1 and rows[0].module == ""
    row = rows[0]
    assert row.fp8_amax == 300.0  # the in-projection's input
    weights = (attention.in_proj_weight, attention.out_proj.weight)
    assert row.fp8_amax_weight == max(float(w.abs().max()) for w in weights)
    assert row.fp8_grad_format == "float8_e5m2" and row.fp8_grad_amax is not None


def test_the_doctor_shows_saturation_under_delayed_scaling(tmp_path):
    """A delayed scale from a step of small inputs saturates a step of large ones: the doctor counts them."""
    from mixprec import diagnostics

    policy = FP8.with_fp8_recipe(scaling="delayed", history=1)
    net, (x,), loss_fn = _doctor_target(1.0)
    engine.reset()
    with _region(policy=policy):
        loss_fn(net(x * 0.01)).backward()  # step 0: small inputs fill the history
    with torch.no_grad():
        for p in net.parameters():
            p.sub_(0)  # the optimizer's in-place step (bumps the versions: a new step)
    report = diagnostics.diagnose((net, (x,), loss_fn), "cpu", torch.bfloat16, policy)
    first = next(r for r in report.rows if r.fp8_format is not None)
    top = torch.finfo(E4M3).max
    beyond = (x.abs() * top / (0.01 * x.abs().max()) > top + 16).sum()  # (half e4m3's ulp at 448: 16)
    assert first.fp8_saturated == pytest.approx(float(beyond) / (x.numel() + net[0].weight.numel()))
    assert first.fp8_saturated > 0.3
    engine.reset()


@pytest.mark.parametrize(("fmt", "values", "saturated"), [
    (E4M3, [448.0, 464.0, 465.0, 470.0], 0.5),  # 448 + half its ulp (16): a tie rounds back to 448
    (E5M2, [57344.0, 61440.0, 61441.0, 63168.0], 0.5),  # 57344 + half its ulp (4096)
])
def test_the_doctor_counts_as_saturated_what_rounds_past_the_formats_largest_value(fmt, values, saturated):
    """Just past the largest value, by less than half its ulp, a value still rounds to it; beyond, only the clamp
    keeps it finite (it was counted from max * (1 + eps / 2): 476 and 64512, missing the band in between)."""
    from mixprec.diagnostics import _recorder

    high = torch.tensor(values)
    low = high.clamp(max=torch.finfo(fmt).max).to(fmt)
    assert _recorder._lost_to_fp8([(high, low, torch.ones(()))]) == (saturated, 0.0)


def test_the_doctor_command_prints_the_fp8_call_sites_and_writes_them(capsys, tmp_path):
    from _cli import run

    target = tmp_path / "target.py"
    target.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))\n"
        "    return net, (torch.randn(32, 64),), lambda out: out.float().pow(2).mean()\n"
    )
    (tmp_path / "fp8.toml").write_text(FP8.to_toml())
    result = run(capsys, "doctor", f"{target}:build", "--policy", str(tmp_path / "fp8.toml"), "--out",
                 str(tmp_path / "out"))  # fmt: skip
    assert result.code == 0, result.err
    assert "fp8 call sites" in result.out and "e4m3" in result.out
    html = (tmp_path / "out" / "report.html").read_text()
    assert "saturated" in html and "fp8 GEMM err" in html and "float8_e4m3fn" in html


# ---------------------------------------------------------------- which tensor keys a weight's state


def test_a_weight_reached_through_a_transpose_made_per_call_keeps_its_quantisation_and_history(monkeypatch):
    """``x @ self.weight.t()`` makes a new view per call: the parameter behind it keys the kept quantisation
    (quantised once per step however often used) and the delayed history (named by the parameter)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(48, 64) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t() + torch.matmul(x, self.weight.t())

    engine.reset()
    net, x = Net(), torch.randn(32, 64)
    calls = []
    real = _fp8.quantise
    monkeypatch.setattr(_fp8, "quantise", lambda t, *a: calls.append(t.shape) or real(t, *a))
    with _region():
        net(x)
    assert calls.count((48, 64)) == 1  # the weight, once for both calls; the input twice
    policy = FP8.with_fp8_recipe(scaling="delayed", history=4)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(3):
        with _region(policy=policy):
            net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved = mixprec.AmaxHistory(net).state_dict()
    assert int(saved["weight.amax_steps"]) == 2 and bool((saved["weight.amax_history"][:, -2:] > 0).all())
    engine.reset()


def test_weights_that_are_views_of_one_buffer_keep_histories_of_their_own():
    """FSDP1 keeps each parameter as a view of part of one flat parameter: each is its own call site."""
    engine.reset()
    flat = torch.randn(2 * 48 * 64)
    small, large = flat[: 48 * 64].view(48, 64), flat[48 * 64 :].view(48, 64)
    with torch.no_grad():
        large.mul_(100)
    x = torch.randn(32, 64)
    recipe = Fp8Recipe(scaling="delayed", history=2)
    outs = [_fp8.linear(x, w, None, recipe, torch.float32) for w in (small, large)]
    for w, out in zip((small, large), outs, strict=True):  # each scaled by its own amax (the first step)
        assert torch.equal(out, _fp8.linear(x, w.clone(), None, Fp8Recipe(), torch.float32))
    assert len(_amax._sites) == 2
    engine.reset()


def test_a_weight_computed_in_each_step_says_delayed_scaling_falls_back_to_dynamic():
    """A parametrized weight (weight_norm) is a new tensor at every call: no history can follow it, so its site
    scales dynamically, as tensorwise does, and says so once, at the user's line, instead of silently."""

    def train(recipe_policy):  # type: ignore[no-untyped-def]
        engine.reset()
        torch.manual_seed(0)
        net = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(64, 48))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        seen = []
        for r in (1.0, 3.0, 0.5):
            with _region(policy=recipe_policy):
                loss = net(torch.randn(32, 64) * r).float().pow(2).mean()
            loss.backward()
            seen += [loss.detach(), *(p.grad.clone() for p in net.parameters())]
            opt.step()
            opt.zero_grad()
        return seen

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        delayed = train(FP8.with_fp8_recipe(scaling="delayed", history=2))
    fell_back = [w for w in caught if "delayed scaling fell back to dynamic" in str(w.message)]
    assert fell_back and all(w.filename == __file__ for w in fell_back), [(w.filename, w.message) for w in caught]
    assert not _amax._sites  # nothing kept per call
    assert all(torch.equal(a, b) for a, b in zip(delayed, train(FP8), strict=True))
    with warnings.catch_warnings():  # a plain weight keeps its history and says nothing
        warnings.simplefilter("error")
        torch.manual_seed(0)
        plain = torch.nn.Linear(64, 48)
        with _region(policy=FP8.with_fp8_recipe(scaling="delayed", history=2)):
            plain(torch.randn(32, 64)).float().sum().backward()
    assert len(_amax._sites) == 1
    engine.reset()


def test_delayed_scaling_quantises_a_weight_once_per_step_with_the_same_results(monkeypatch):
    """Within a step a delayed weight scale does not move, so the weight's quantisation is kept like a dynamic
    one's: once per step however often the layer runs, again after each optimizer step and after a history is
    loaded (mid-step here: the loaded history moves the scale); outputs, gradients and histories equal those of
    quantising at every call."""
    policy = FP8.with_fp8_recipe(scaling="delayed", history=2)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(32, 64, generator=gen) * r for r in (1.0, 3.0, 0.5, 2.0)]

    def run(every_call: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[int]]:
        engine.reset()
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 48)
        opt = torch.optim.SGD(layer.parameters(), lr=0.05)
        quantised: list[int] = []
        real = _fp8.quantise

        def counting(t, *args):  # type: ignore[no-untyped-def]
            quantised[-1] += t.shape == layer.weight.shape
            return real(t, *args)

        monkeypatch.setattr(_fp8, "quantise", counting)
        if every_call:
            monkeypatch.setattr(_fp8, "_weights", _Forgetful())
        seen: list[torch.Tensor] = []
        for step, x in enumerate(xs):
            quantised.append(0)
            with _region(policy=policy):
                loss = torch.zeros(())
                for k in (1.0, 0.5, 2.0):
                    loss = loss + layer(x * k).float().pow(2).mean()
                    if step == 2 and k == 1.0:  # a history loaded mid-step: the next call scales by it
                        mixprec.AmaxHistory(layer).load_state_dict(mixprec.AmaxHistory(layer).state_dict())
            loss.backward()
            seen += [loss.detach(), layer.weight.grad.clone()]
            opt.step()
            opt.zero_grad()
        monkeypatch.setattr(_fp8, "quantise", real)
        history = mixprec.AmaxHistory(layer).state_dict()
        engine.reset()
        return seen, history, quantised

    kept, kept_history, kept_counts = run(every_call=False)
    fresh, fresh_history, fresh_counts = run(every_call=True)
    assert kept_counts == [1, 1, 2, 1] and fresh_counts == [3, 3, 3, 3]
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
    assert kept_history.keys() == fresh_history.keys()
    for name, value in kept_history.items():
        assert torch.equal(value, fresh_history[name]), name


class _Forgetful(dict):  # type: ignore[type-arg]
    """A weight-quantisation store that keeps nothing (every call quantises again)."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("shape", [(16, 32), (2, 8, 32)], ids=["2d", "3d"])
def test_an_in_place_op_on_an_fp8_layers_output_works_as_natively(shape, scaling):
    """The layer's output was a view made inside its autograd Function, which refuses in-place ops ("Output 0 of
    _Fp8Linear is a view and is being modified inplace"), where torch.autocast's linear allows ``y += 1``."""
    policy = mixprec.policies.FP8.with_fp8_recipe(scaling=scaling)
    results = []
    for in_place in (False, True):
        mixprec.engine.reset()  # (the delayed recipe's histories: each run starts alike)
        torch.manual_seed(0)
        layer, x = torch.nn.Linear(32, 32), torch.randn(*shape, requires_grad=True)
        with mixprec.autocast("cpu", policy=policy):
            y = layer(x)
            if in_place:
                y += 1.0
            else:
                y = y + 1.0
        y.float().sum().backward()
        results.append((y.detach(), x.grad, layer.weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_process_group_given_for_a_weight_goes_with_the_weight():
    """``AmaxHistory(model, process_group=...)`` kept each parameter's group by ``id()`` until a call site of it
    ran and was freed: a bias, a norm's weight or a model that never ran left its entry, and a later tensor
    reusing the id took the group, whose collectives the other ranks would never join."""
    import gc

    from mixprec.engine import _amax

    weight = torch.nn.Parameter(torch.zeros(4, 4))
    key = id(weight)
    _amax._group(weight, "a group", 0)
    assert _amax._groups[key] == ("a group", 0)
    del weight
    gc.collect()
    assert key not in _amax._groups


@pytest.mark.parametrize("other_site", [0, 3], ids=["same-site", "another-site"])
def test_ranks_rolling_different_call_sites_raise_instead_of_pairing_their_amaxes(monkeypatch, other_site):
    """The roll's collective paired amaxes by call order: a rank that ran another layer (a branch some ranks take,
    DDP's find_unused_parameters) silently scaled one layer by another's amaxes, or, with a collective of another
    size, crashed in gloo. Each now carries its site's place among the model's parameters."""
    from mixprec.engine import _amax

    theirs = torch.tensor([5.0, 1.0, 0.5, other_site, -other_site])  # (the other rank's pending amaxes, site)

    def all_reduce(tensor, op=None, group=None):
        tensor.copy_(torch.maximum(tensor, theirs))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    pending = torch.tensor([2.0, 3.0, 0.25])
    if other_site == 0:
        assert torch.equal(_amax._agree(pending, 0, "group"), torch.tensor([5.0, 3.0, 0.5]))
    else:
        with pytest.raises(RuntimeError, match=r"different call sites.*same fp8 layers.*Received: sites=\(0, 3\)"):
            _amax._agree(pending, 0, "group")


def test_a_weight_whose_data_moves_each_step_keeps_one_quantisation_in_a_long_region():
    """``p.data = ...`` (or a storage re-allocated) each step inside one region: the kept quantisation was keyed
    by the data's address, so each step added an entry the live weight never dropped (135 KB a step for a
    256 x 256 layer, until the region ended)."""
    from mixprec.engine import _fp8

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 64), torch.randn(16, 64)
    with mixprec.autocast("cpu", policy=mixprec.policies.FP8):
        for _ in range(20):
            layer.weight.data = layer.weight.data.clone()
            first = layer(x)
            assert torch.equal(layer(x), first)  # (the kept quantisation serves the step's later calls)
            assert len(_fp8._weights) == 1


def test_a_rowwise_backward_after_the_region_keeps_no_weight_quantisation():
    """The backward after a region (the usual place) quantised the weight's columns and kept them, as nothing
    cleared them until the next region's end: a weight then changed through ``.data`` (no version counter sees
    it) gave the next backward inside a region the old weight's gradient."""
    torch.manual_seed(0)
    policy = mixprec.policies.FP8.with_fp8_recipe(scaling="rowwise")
    layer, x = torch.nn.Linear(64, 64, bias=False), torch.randn(32, 64, requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        y = layer(x)
    y.float().sum().backward()
    assert not _fp8._weights
    with torch.no_grad():
        layer.weight.data.mul_(-3.0)

    def grad_x():
        x.grad = None
        with mixprec.autocast("cpu", policy=policy):
            layer(x).float().sum().backward()
        return x.grad.clone()

    stale = grad_x()
    _fp8.clear_weight_cache()
    assert torch.equal(stale, grad_x())


def test_an_eps_beyond_float32_is_refused_when_the_recipe_is_made():
    with pytest.raises(ValueError, match="at most float32's largest"):
        Fp8Recipe(eps=1e39)


def test_a_call_fp8_cannot_run_is_emulated_in_an_emulated_region_as_lower_precision_fp_is():
    """An unaligned call falls back to the region's dtype 'as lower_precision_fp': under compute="emulated" that
    is float32 kernels (it ran torch's bfloat16 kernel, the slow one on CPUs without bf16 units)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("addmm", "mm", "linear"):
                self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 64), torch.randn(10, 64)  # 10 rows: not a multiple of 16
    outs = {}
    for policy in (mixprec.policies.CPU, mixprec.policies.FP8):
        with mixprec.autocast("cpu", policy=policy, compute="emulated"), Log() as log:
            outs[policy.name] = layer(x)
        assert log.seen == [(torch.float32,) * 3]
    assert outs["CPU"].dtype is torch.bfloat16 and torch.equal(outs["CPU"], outs["FP8"])
