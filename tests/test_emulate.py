"""compute="emulated" against compute="native" (mixprec.engine._emulate, mixprec.engine._emulate_kernels).

Matrix products and convolutions are bilinear, so the error of an
accumulation is bounded by the same computation on absolute values. Each
case checks, for output and input gradients, both modes against a float64
reference computed from the same low-precision-rounded inputs, with K the
most terms summed into one entry and u the dtype's unit roundoff::

    emulated: |result - ref| <= 2 u |ref| + (K + 2) 2^-23 |f|(|inputs|)   (float32 accumulation)
    native:   |result - ref| <= 2 u |ref| + (K + 2) u |f|(|inputs|)       (some CPU fallbacks
              accumulate float16 in float16, and matmul sums broadcast gradients after rounding)

and the two modes against each other within the sum of their bounds, on
random shapes (hypothesis). Dtypes must match exactly.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.engine import _emulate_kernels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FAST = settings(max_examples=12, deadline=None, derandomize=True)


def _rounded(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).float().requires_grad_()


def _run(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor, region: Any
) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with region:
        out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach(), *(t.grad for t in leaves)]


def _reference(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor, absolute: bool
) -> list[torch.Tensor]:
    leaves = [(t.detach().abs() if absolute else t.detach()).double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad.double().abs() if absolute else grad.double())
    return [out.detach(), *(t.grad for t in leaves)]


def check(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dtype: torch.dtype, reduction: int) -> None:
    probe = fn(*(t.detach() for t in inputs))
    grad = torch.randn(probe.shape, generator=torch.Generator().manual_seed(7)).to(dtype).float()
    native = _run(fn, inputs, grad, mixprec.autocast("cpu", dtype=dtype, compute="native"))
    emulated = _run(fn, inputs, grad, mixprec.autocast("cpu", dtype=dtype, compute="emulated"))
    ref = _reference(fn, inputs, grad, absolute=False)
    magnitude = _reference(fn, inputs, grad, absolute=True)
    names = ["output", *(f"grad[{i}]" for i in range(len(inputs)))]
    for name, n, e, r, m in zip(names, native, emulated, ref, magnitude, strict=True):
        assert e.dtype == n.dtype, f"{name}: emulated {e.dtype}, native {n.dtype}"
        rounding = 2 * UNIT[dtype] * r.abs()
        bounds = {
            "emulated": rounding + (reduction + 2) * 2.0**-23 * m,
            "native": rounding + (reduction + 2) * UNIT[dtype] * m,
        }
        for label, got in (("native", n), ("emulated", e)):
            excess = (got.double() - r).abs() - bounds[label]
            assert excess.max() <= 0, f"{name}: {label} off the float64 reference by {excess.max():.3g} over the bound"
        agree = (e.double() - n.double()).abs() <= bounds["emulated"] + bounds["native"]
        assert agree.all(), f"{name}: emulated and native disagree"
    assert native[0].dtype == dtype


dims = st.integers(1, 9)


@pytest.mark.parametrize("dtype", DTYPES)
@FAST
@given(m=dims, k=dims, n=dims, seed=st.integers(0, 2**16))
def test_mm(dtype: str, m: int, k: int, n: int, seed: int) -> None:
    d = DTYPES[dtype]
    check(torch.mm, [_rounded((m, k), d, seed), _rounded((k, n), d, seed + 1)], d, k)


@pytest.mark.parametrize("dtype", DTYPES)
@FAST
@given(
    m=dims,
    k=dims,
    n=dims,
    full=st.booleans(),
    beta=st.sampled_from([1.0, 0.5]),
    alpha=st.sampled_from([1.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_addmm(dtype: str, m: int, k: int, n: int, full: bool, beta: float, alpha: float, seed: int) -> None:
    d = DTYPES[dtype]
    c = _rounded((m, n) if full else (n,), d, seed + 2)
    check(
        lambda c, a, b: torch.addmm(c, a, b, beta=beta, alpha=alpha),
        [c, _rounded((m, k), d, seed), _rounded((k, n), d, seed + 1)],
        d,
        k + 1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@FAST
@given(b=st.integers(1, 3), m=dims, k=dims, n=dims, seed=st.integers(0, 2**16))
def test_bmm_and_baddbmm(dtype: str, b: int, m: int, k: int, n: int, seed: int) -> None:
    d = DTYPES[dtype]
    x, y, c = _rounded((b, m, k), d, seed), _rounded((b, k, n), d, seed + 1), _rounded((b, m, n), d, seed + 2)
    check(torch.bmm, [x, y], d, k)
    check(lambda c, x, y: torch.baddbmm(c, x, y, alpha=0.5), [c, x, y], d, k + 1)


MATMUL_SHAPES = {
    "1d@1d": ((5,), (5,)),
    "1d@2d": ((5,), (5, 3)),
    "2d@1d": ((4, 5), (5,)),
    "3d@2d": ((2, 4, 5), (5, 3)),
    "3d@1d": ((2, 4, 5), (5,)),
    "1d@3d": ((5,), (2, 5, 3)),
    "broadcast": ((1, 4, 5), (3, 5, 2)),
    "4d@3d": ((2, 1, 4, 5), (3, 5, 2)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES)
def test_matmul(dtype: str, shapes: str) -> None:
    d = DTYPES[dtype]
    a, b = MATMUL_SHAPES[shapes]
    terms = max(torch.Size(a).numel(), torch.Size(b).numel())  # broadcast gradients sum over batches too
    check(torch.matmul, [_rounded(a, d, 1), _rounded(b, d, 2)], d, terms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
@FAST
@given(lead=st.lists(st.integers(1, 4), max_size=2), k=dims, n=dims, bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear(dtype: str, sliced: bool, lead: list[int], k: int, n: int, bias: bool, seed: int) -> None:
    d = DTYPES[dtype]
    inputs = [_rounded((*lead, k), d, seed), _rounded((n, k), d, seed + 1)]
    if bias:
        inputs.append(_rounded((n,), d, seed + 2))
    with pytest.MonkeyPatch.context() as patch:
        if sliced:  # slices of 2 output features or fewer
            patch.setattr(_emulate_kernels, "CHUNK_ELEMENTS", 2 * max(1, inputs[0].numel() // k))
        check(F.linear, inputs, d, k + 1)


CONVS: dict[str, tuple[Callable[..., torch.Tensor], int]] = {
    "conv1d": (F.conv1d, 1),
    "conv2d": (F.conv2d, 2),
    "conv3d": (F.conv3d, 3),
    "conv_transpose1d": (F.conv_transpose1d, 1),
    "conv_transpose2d": (F.conv_transpose2d, 2),
    "conv_transpose3d": (F.conv_transpose3d, 3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", CONVS)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    cin=st.integers(1, 3),
    cout=st.integers(1, 3),
    size=st.integers(3, 6),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    bias=st.booleans(),
    batched=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_convolution(
    dtype: str,
    op: str,
    cin: int,
    cout: int,
    size: int,
    kernel: int,
    stride: int,
    padding: int,
    bias: bool,
    batched: bool,
    seed: int,
) -> None:
    d = DTYPES[dtype]
    fn, n = CONVS[op]
    transposed = op.startswith("conv_transpose")
    x = _rounded(((2,) if batched else ()) + (cin,) + (size,) * n, d, seed)
    w = _rounded(((cin, cout) if transposed else (cout, cin)) + (kernel,) * n, d, seed + 1)
    inputs = [x, w] + ([_rounded((cout,), d, seed + 2)] if bias else [])
    check(lambda *t: fn(*t, stride=stride, padding=padding), inputs, d, cin * kernel**n + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_convolution_with_string_padding(dtype: str) -> None:
    d = DTYPES[dtype]
    check(
        lambda x, w: F.conv2d(x, w, padding="same"), [_rounded((1, 2, 5, 5), d, 1), _rounded((3, 2, 3, 3), d, 2)], d, 19
    )


class _KernelDtypes(TorchDispatchMode):
    """Records the dtypes of the mm/convolution kernels that run (below autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "convolution", "convolution_backward"):
            self.seen.append((name, args[0].dtype if name != "convolution_backward" else args[1].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compute", ["native", "emulated"])
def test_forced_mode_decides_the_kernels_that_run(dtype: str, compute: str) -> None:
    d = DTYPES[dtype]
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 4))
    with _KernelDtypes() as seen:
        with mixprec.autocast("cpu", dtype=d, compute=compute):
            out = model(torch.randn(2, 2, 4, 4))
        out.float().sum().backward()
    assert out.dtype is d
    expected = torch.float32 if compute == "emulated" else d
    assert seen.seen and {dt for _, dt in seen.seen} == {expected}, seen.seen


def test_saved_tensors_are_low_precision_or_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    params = {id(p) for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(5, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixprec.autocast("cpu", compute="emulated"):
        out = model(x)
    out.float().sum().backward()
    assert saved
    assert all(t.dtype is torch.bfloat16 or id(t) in params for t in saved), [(t.dtype, t.shape) for t in saved]
    assert not any(t.dtype is torch.float32 and t.numel() == 5 * 16 for t in saved)  # no float32 activation


def test_emulated_sdpa_with_dropout_recomputes_the_same_mask() -> None:
    q, k, v = (_rounded((2, 2, 6, 4), torch.bfloat16, s) for s in (1, 2, 3))
    grad = torch.randn(2, 2, 6, 4).to(torch.bfloat16)

    def run(region: Any) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(0)
        with region:
            out = F.scaled_dot_product_attention(*leaves, dropout_p=0.5)
        out.backward(grad.to(out.dtype))
        return [out.to(torch.bfloat16).float(), *(t.grad.to(torch.bfloat16).float() for t in leaves)]

    emulated = run(mixprec.autocast("cpu", compute="emulated"))
    float32 = run(torch.autocast("cpu", enabled=False))  # the same float32 math, rounded at the end
    for e, f in zip(emulated, float32, strict=True):
        torch.testing.assert_close(e, f, rtol=0, atol=0)


RNNS: dict[str, Callable[[], torch.nn.Module]] = {
    "lstm": lambda: torch.nn.LSTM(6, 8, num_layers=2, batch_first=True),
    "lstm_dropout": lambda: torch.nn.LSTM(6, 8, num_layers=2, dropout=0.3, bidirectional=True),
    "gru": lambda: torch.nn.GRU(6, 8, num_layers=2, batch_first=True),  # listed by POLICY_WITH_GRU
    "gru_cpu_policy": lambda: torch.nn.GRU(6, 8, batch_first=True),  # unlisted on CPU: float32, as natively
    "rnn": lambda: torch.nn.RNN(6, 8, batch_first=True),
}
CELLS = {"lstm_cell": torch.nn.LSTMCell, "gru_cell": torch.nn.GRUCell, "rnn_cell": torch.nn.RNNCell}
POLICY_WITH_GRU = mixprec.Policy.from_lists(
    "cpu+gru",
    {
        **{c: list(mixprec.policies.CPU.ops(c)) for c in ("lower_precision_fp", "fp32", "promote")},
        "lower_precision_fp": [*mixprec.policies.CPU.ops("lower_precision_fp"), "gru"],
    },
)


def _train(module: torch.nn.Module, x: torch.Tensor, region: Callable[[], Any], steps: int = 5) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        torch.manual_seed(0)  # the same dropout masks every step
        with region():
            out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        loss = out.float().pow(2).mean()
        loss.backward()
        assert all(
            p.grad is not None and p.grad.dtype is torch.float32 and p.grad.isfinite().all()
            for p in module.parameters()
        )
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compute", ["auto", "emulated"])
@pytest.mark.parametrize("kind", RNNS)
def test_recurrent_modules_train(kind: str, compute: str, dtype: str) -> None:
    torch.manual_seed(0)
    module = RNNS[kind]()
    x = torch.randn(4, 5, 6)
    policy = POLICY_WITH_GRU if kind == "gru" else None
    losses = _train(module, x, lambda: mixprec.autocast("cpu", dtype=DTYPES[dtype], compute=compute, policy=policy))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [*RNNS, *CELLS])
def test_recurrent_emulated_matches_native(kind: str, dtype: str) -> None:
    d = DTYPES[dtype]
    torch.manual_seed(0)
    module = RNNS[kind]() if kind in RNNS else CELLS[kind](6, 8)
    module.eval()  # no dropout: one forward each
    x = torch.randn(4, 5, 6) if kind in RNNS else torch.randn(4, 6)
    policy = POLICY_WITH_GRU if kind == "gru" else mixprec.policies.CUDA if kind in CELLS else None
    results = {}
    for compute in ("native", "emulated"):
        module.zero_grad()
        try:
            with mixprec.autocast("cpu", dtype=d, compute=compute, policy=policy):
                out = module(x)
        except RuntimeError:  # oneDNN has no float16 RNN on this CPU: native raises too
            assert compute == "native" and _native_raises(module, x, d)
            results[compute] = _rounded_float32(module, x, d)
            continue
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        results[compute] = (out, [p.grad.clone() for p in module.parameters()])
    (out_n, grads_n), (out_e, grads_e) = results["native"], results["emulated"]
    assert out_e.dtype == out_n.dtype
    tol = 16 * UNIT[d]
    torch.testing.assert_close(out_e.float(), out_n.float(), rtol=tol, atol=tol)
    for g_e, g_n in zip(grads_e, grads_n, strict=True):
        torch.testing.assert_close(g_e, g_n, rtol=tol, atol=tol * g_n.abs().max().item())


def _native_raises(module: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            module(x)
    except RuntimeError:
        return True
    return False


def _rounded_float32(module: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> Any:
    """What emulation approximates: float32 compute on inputs and weights rounded to ``dtype``."""
    copy = copy_module.deepcopy(module)
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(p.to(dtype).float())
    out = copy(x.to(dtype).float())
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    return out.to(dtype), [p.grad.clone() for p in copy.parameters()]


def test_grad_scaler_runs_unchanged_on_emulated_float16() -> None:
    torch.manual_seed(0)
    runs = {}
    for compute in ("native", "emulated"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
        data = torch.randn(32, 8)
        target = data.sum(1, keepdim=True)
        for _ in range(10):
            with mixprec.autocast("cpu", dtype=torch.float16, compute=compute):
                loss = F.mse_loss(model(data), target)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs[compute] = (loss.item(), scaler.get_scale(), [p.detach().clone() for p in model.parameters()])
    (loss_n, scale_n, params_n), (loss_e, scale_e, params_e) = runs["native"], runs["emulated"]
    assert scale_e == scale_n
    assert loss_e == pytest.approx(loss_n, rel=1e-2)
    for p_e, p_n in zip(params_e, params_n, strict=True):
        torch.testing.assert_close(p_e, p_n, rtol=1e-2, atol=1e-3)


def test_weight_cast_once_per_region_when_emulated() -> None:
    layer = torch.nn.Linear(4, 4)
    casts = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._to_copy.default and args[0] is not None and args[0].shape == (4, 4):
                casts.append(kwargs.get("dtype"))
            return func(*args, **(kwargs or {}))

    with Count(), mixprec.autocast("cpu", compute="emulated"):
        layer(layer(torch.randn(2, 4)))
    assert casts.count(torch.bfloat16) == 1  # the weight, once: the cache serves the second use
    assert casts.count(torch.float32) == 2  # each use upcasts the cached copy for the float32 kernel


def test_backward_inside_the_region_runs_float32_kernels() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[tuple[torch.dtype, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in matmuls:
                self.dtypes.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    with mixprec.autocast("cpu", compute="emulated"):
        loss = layer(x).float().sum()
        with Matmuls() as backward:
            loss.backward()
        inside = layer.weight.grad.clone()
    assert backward.dtypes, "backward ran no matrix kernel"
    assert all(set(dtypes) == {torch.float32} for dtypes in backward.dtypes), backward.dtypes
    layer.zero_grad()
    with mixprec.autocast("cpu", compute="emulated"):
        out = layer(x)
    out.float().sum().backward()
    torch.testing.assert_close(inside, layer.weight.grad, rtol=0, atol=0)


def test_inputs_outside_autocast_eligibility_run_unchanged() -> None:
    a, b = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    with mixprec.autocast("cpu", compute="emulated"):
        out = torch.mm(a, b)
        no_grad_out = F.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert out.dtype is torch.float64
    torch.testing.assert_close(out, a @ b)
    assert no_grad_out.dtype is torch.bfloat16


@pytest.mark.parametrize("op", ["mm", "linear", "conv1d", "matmul"])
def test_an_integer_operand_of_a_product_is_refused_as_natively(op: str) -> None:
    # The written-out kernels would round an integer tensor to the low dtype and run; native refuses the mix.
    calls = {
        "mm": lambda a, b: torch.mm(a, b),
        "linear": lambda a, b: F.linear(a, b),
        "conv1d": lambda a, b: F.conv1d(a.reshape(1, 3, 3), b.reshape(3, 3, 1)),
        "matmul": lambda a, b: torch.matmul(a, b),
    }
    a, b = torch.ones(3, 3, dtype=torch.long), torch.randn(3, 3)
    errors = []
    for region in (torch.autocast("cpu"), mixprec.autocast("cpu", compute="emulated")):
        with pytest.raises(RuntimeError) as error, region:
            calls[op](a, b)
        errors.append(type(error.value))
    assert errors[0] is errors[1]


def test_a_linear_with_a_one_dimensional_weight_trains_emulated() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 7), torch.randn(7)
    results = []
    for region in (torch.autocast("cpu"), mixprec.autocast("cpu", compute="emulated")):
        xs, ws = (t.clone().requires_grad_() for t in (x, w))
        with region:
            y = F.linear(xs, ws)
        y.float().sum().backward()
        results.append((y, xs.grad, ws.grad))
    for native, emulated in zip(*results, strict=True):
        assert native.dtype is emulated.dtype and native.shape == emulated.shape
        torch.testing.assert_close(emulated, native, rtol=2e-2, atol=2e-2)


DOUBLE_BACKWARD = {
    "prelu": (lambda x, w: F.prelu(x, w.reshape(-1)[:1]), (64, 8), (8, 8)),
    "addbmm": (lambda x, w: torch.addbmm(x, torch.stack([x, x * 0.5]), w.expand(2, 8, 8)), (8, 8), (8, 8)),
    "conv_same": (lambda x, w: F.conv1d(x[None], w[:, :, None].expand(8, 8, 3), padding="same")[0], (8, 16), (8, 8)),
}


@pytest.mark.parametrize("op", DOUBLE_BACKWARD)
def test_a_double_backward_through_a_recomputed_op_follows_native(op: str) -> None:
    # A gradient penalty (create_graph=True) through an op emulated by recomputation: its backward is itself
    # differentiable, so the weight's second-order term is there (it was None, or lost 10-40%). (Not sdpa: torch
    # 2.15's CPU flash attention has no double backward, natively either.)
    fn, x_shape, w_shape = DOUBLE_BACKWARD[op]
    torch.manual_seed(0)
    x0, w0 = torch.randn(*x_shape), torch.randn(*w_shape) * 0.3
    found = {}
    for compute in ("fp32", "native", "emulated"):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        region = torch.autocast("cpu", enabled=False) if compute == "fp32" else mixprec.autocast("cpu", compute=compute)
        with region:
            out = (fn(x, w).float() ** 2).sum()
        gx, = torch.autograd.grad(out, x, create_graph=True)
        (gx**2).sum().backward()
        found[compute] = w.grad
    assert found["emulated"] is not None and found["emulated"].dtype is torch.float32
    scale = found["fp32"].norm()
    # emulated is float32 compute between bf16 roundings: as close to float32 as native is, or closer
    assert (found["emulated"] - found["fp32"]).norm() <= max(2 * (found["native"] - found["fp32"]).norm(), 0.02 * scale)


def test_parameter_modified_in_place_before_backward_raises() -> None:
    layer = torch.nn.Linear(4, 4)
    with mixprec.autocast("cpu", compute="emulated"):
        out = layer(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        layer.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


_AVX2_SCRIPT = """
import torch, mixprec
for dtype in (torch.bfloat16, torch.float16):
    assert not mixprec.kernel_support("cpu", dtype).native
    for cls in (torch.nn.LSTM, torch.nn.GRU):
        torch.manual_seed(0)
        module = cls(6, 8, num_layers=2, batch_first=True)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        x = torch.randn(4, 5, 6)
        losses = []
        for _ in range(5):
            with mixprec.autocast("cpu", dtype=dtype):
                out, _ = module(x)
            loss = out.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (cls, dtype, losses)
print("trained")
"""


def test_recurrent_modules_train_where_onednn_has_no_low_precision_kernels() -> None:
    """oneDNN capped at AVX2, as on a CPU without AVX512: native bf16/fp16 LSTM autocast raises there."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_training_follows_native(dtype: str) -> None:
    """A small HF GPT-2 trained 15 steps: emulated and native losses stay within 1 % of each other."""
    from transformers import GPT2Config, GPT2LMHeadModel

    d = DTYPES[dtype]
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=64)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    curves = {}
    for compute in ("native", "emulated"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for step in range(15):
            torch.manual_seed(step)
            with mixprec.autocast("cpu", dtype=d, compute=compute):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.item())
        curves[compute] = curve
    native, emulated = curves["native"], curves["emulated"]
    assert native[-1] < 0.8 * native[0]  # it learned something
    for n, e in zip(native, emulated, strict=True):
        assert e == pytest.approx(n, rel=0.01)


@pytest.mark.parametrize("where", ["around", "inside"])
def test_torch_func_transforms_in_an_emulated_region_give_torch_autocasts_results(where: str) -> None:
    """torch.func's grad and per-sample grads (vmap of grad), with the region around the transform or inside the
    transformed function. An autograd Function cannot run below the transforms' layer (torch's
    custom_function_call), so there the ops compute as native's do; before, the emulated kernels failed there,
    and ``compute="auto"`` emulates on a CPU without bf16 units."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = torch.randn(6, 16), torch.randn(6, 8)

    def results(region: Callable[[], Any]) -> list[Any]:
        def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with region() if where == "inside" else contextlib.nullcontext():
                return F.mse_loss(torch.func.functional_call(model, p, (x,)).float(), y)

        with region() if where == "around" else contextlib.nullcontext():
            whole = torch.func.grad(loss)(params, x, y)
            per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x[:, None], y[:, None])
        return [*whole.values(), *per_sample.values()]

    native = results(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    ours = results(lambda: mixprec.autocast("cpu", compute="emulated"))
    assert all(a.dtype is b.dtype and torch.equal(a, b) for a, b in zip(native, ours, strict=True))
    assert all(g.abs().sum() > 0 for g in ours)


def test_forward_mode_ad_in_an_emulated_region_gives_torch_autocasts_primal_and_tangent() -> None:
    """The emulated ops' autograd Functions have no jvp; under a ``dual_level`` they compute as native's do
    (before, they failed: "You must implement the jvp function")."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x, tangent = torch.randn(4, 16), torch.randn(4, 16)

    def run(region: Callable[[], Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with fwAD.dual_level(), region():
            primal, out_tangent = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent)))
        return primal, out_tangent

    native = run(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    ours = run(lambda: mixprec.autocast("cpu", compute="emulated"))
    assert all(a.dtype is b.dtype is torch.bfloat16 and torch.equal(a, b) for a, b in zip(native, ours, strict=True))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("op", ["linear", "matmul", "bmm"])
def test_strided_nested_tensors_in_an_emulated_region_run_as_torch_autocast_runs_them(op: str, grad: bool) -> None:
    """A strided nested tensor has no sizes for a written-out backward, nor a custom Function (linear raised
    "NestedTensorImpl doesn't support sizes" where torch.autocast runs it): such a call runs as native runs it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    a = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(4, 8)], requires_grad=grad)
    b = torch.nested.nested_tensor([torch.randn(8, 3), torch.randn(8, 3)])
    calls = {"linear": lambda: lin(a), "matmul": lambda: torch.matmul(a, b), "bmm": lambda: a.bmm(b)}
    results = []
    for region in (torch.autocast("cpu", dtype=torch.bfloat16), mixprec.autocast("cpu", compute="emulated")):
        with torch.set_grad_enabled(grad), region:
            out = calls[op]()
        results.append(out)
    native, emulated = results
    assert emulated.dtype is native.dtype is torch.bfloat16 and emulated.is_nested
    assert all(torch.equal(x, y) for x, y in zip(native.unbind(), emulated.unbind(), strict=True))
    if grad:
        emulated.to_padded_tensor(0.0).float().sum().backward()
        assert a.grad is not None


@pytest.mark.parametrize("bias_shape", [(), (1,)], ids=["0-dim", "one-element"])
def test_an_emulated_linear_in_slices_broadcasts_its_bias_as_f_linear_does(bias_shape):
    """An output past ``CHUNK_ELEMENTS`` is computed in column slices, which indexed the bias per slice: a 0-dim
    or one-element bias raised where native broadcasts it. Its gradient is summed in float32, then rounded."""
    x, w = torch.randn(16, 64), torch.randn(70000, 64)
    bias = torch.randn(bias_shape, requires_grad=True)
    with mixprec.autocast("cpu", compute="emulated"):
        got = F.linear(x, w, bias)
        whole = F.linear(x, w, bias.expand(70000))
    assert got.dtype is torch.bfloat16 and torch.equal(got, whole)
    got.float().sum().backward()
    assert bias.grad.shape == bias_shape and bias.grad.item() == float(torch.tensor(16 * 70000.0).bfloat16())


def test_an_emulated_op_keeps_the_float32_outputs_torchs_kernel_keeps():
    """``_emulate.down`` rounded every float32 output to the low dtype; torch's kernels return some in float32
    (``_fused_rms_norm``'s rstd, flash attention's logsumexp), as a policy moving them gives natively."""
    policy = mixprec.policies.CPU.with_ops(
        lower_precision_fp=["_scaled_dot_product_flash_attention_for_cpu", "_fused_rms_norm"]
    )
    q, x = torch.randn(1, 2, 4, 8), torch.randn(2, 4, requires_grad=True)
    dtypes = {}
    for compute in ("native", "emulated"):
        with mixprec.autocast("cpu", policy=policy, compute=compute):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)
            y, rstd = torch.ops.aten._fused_rms_norm(x, [4], torch.ones(4), 1e-5)  # (with a graph: x needs grad)
        dtypes[compute] = (out.dtype, lse.dtype, y.dtype, rstd.dtype)
    assert dtypes["emulated"] == dtypes["native"] == (torch.bfloat16, torch.float32) * 2

    class Devices(TorchDispatchMode):  # (the probe of torch's dtypes runs outside the modes in force)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.update(a.device.type for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    seen: set[str] = set()
    from mixprec.engine import _emulate

    _emulate._native.clear()
    with mixprec.autocast("cpu", policy=policy, compute="emulated"), Devices():
        torch.ops.aten._fused_rms_norm(x, [4], torch.ones(4), 1e-5)
    assert seen == {"cpu"}
    compiled = torch.compile(lambda t: torch.ops.aten._fused_rms_norm(t, [4], torch.ones(4), 1e-5), backend="aot_eager")
    _emulate._native.clear()
    with mixprec.autocast("cpu", policy=policy, compute="emulated"):
        assert [t.dtype for t in compiled(x)] == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("bias_shape", [(4, 3), (1, 3), (2, 4, 3)], ids=["full", "broadcast-row", "3-d"])
def test_an_emulated_linear_with_a_bias_of_more_dimensions_trains_as_native(bias_shape):
    """A bias of 2 or more dimensions (as addmm takes, or a broadcast (1, out) one) raised in emulated backward:
    its gradient was summed over the rows first, then to the bias's shape."""
    torch.manual_seed(0)
    x, w = torch.randn(*bias_shape[:-2], 4, 5), torch.randn(3, 5)
    grads = {}
    for compute in ("native", "emulated"):
        bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with mixprec.autocast("cpu", compute=compute):
            y = F.linear(x, w, bias)
        y.float().sum().backward()
        grads[compute] = (y.dtype, y.shape, bias.grad)
    assert grads["emulated"][:2] == grads["native"][:2]
    assert torch.equal(grads["emulated"][2], grads["native"][2])  # sums of ones: exact


def _laid_out_cases():
    def mm_weight_t(x, w):
        return torch.mm(x, w.t())

    def mm_input_t(x, w):
        return torch.mm(x.t(), w)

    def addmm_t(x, w):
        return torch.addmm(torch.ones(8, 6), x.t(), w.t())

    def linear_t(x, w):
        return F.linear(x.t(), w.t())

    def matmul_3d_weight_t(x, w):
        return torch.matmul(x.t().reshape(2, 4, 8), w)

    return {"mm(x, w.t())": (mm_weight_t, (4, 8), (6, 8)), "mm(x.t(), w)": (mm_input_t, (8, 4), (8, 6)),
            "addmm(c, x.t(), w.t())": (addmm_t, (4, 8), (6, 4)), "linear(x.t(), w.t())": (linear_t, (8, 4), (8, 6)),
            "linear(x.t(), w.t()) in slices": (linear_t, (32, 256), (32, 4200)),
            "matmul(3-d, w)": (matmul_3d_weight_t, (8, 8), (8, 6))}


@pytest.mark.parametrize("case", list(_laid_out_cases()))
def test_emulated_gradients_of_transposed_operands_have_natives_layout(case):
    """torch's mm backward gives a column-major (transposed) operand a column-major gradient; the emulated
    kernels gave every gradient row-major, seen through autograd.grad and hooks (a leaf's .grad is laid out
    again by AccumulateGrad)."""
    fn, x_shape, w_shape = _laid_out_cases()[case]
    x, w = torch.randn(x_shape, requires_grad=True), torch.randn(w_shape, requires_grad=True)
    got = {}
    for compute in ("native", "emulated"):
        with mixprec.autocast("cpu", compute=compute):
            y = fn(x, w)
        got[compute] = (y.dtype, torch.autograd.grad(y.float().sum(), (x, w)))
    (native_dtype, native), (emulated_dtype, emulated) = got["native"], got["emulated"]
    assert emulated_dtype == native_dtype
    for n, e in zip(native, emulated, strict=True):
        assert e.stride() == n.stride() and e.dtype == n.dtype
        torch.testing.assert_close(e, n, rtol=0.02, atol=0.02 * float(n.abs().max()))


def test_an_emulated_lstm_with_projections_gives_its_weight_gradients_natives_layout():
    lstm = torch.nn.LSTM(8, 12, proj_size=6)
    x = torch.randn(5, 3, 8)
    strides = {}
    for compute in ("native", "emulated"):
        with mixprec.autocast("cpu", compute=compute), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "LSTM with projections", UserWarning)  # (oneDNN's, natively too)
            out, _ = lstm(x)
        strides[compute] = [g.stride() for g in torch.autograd.grad(out.float().sum(), list(lstm.parameters()))]
    assert strides["emulated"] == strides["native"]


@pytest.mark.parametrize("wrt", ["input", "weight"])
def test_batched_gradients_of_an_emulated_linear_in_slices_follow_native(wrt):
    """autograd.grad(..., is_grads_batched=True) runs backward under the legacy vmap: the sliced backward wrote
    batched slices in place into unbatched buffers and raised; it now runs the linear in one piece there."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8192)  # 160 x 8192 outputs: past CHUNK_ELEMENTS, in slices
    x = torch.randn(160, 32, requires_grad=True)
    assert len(_emulate_kernels._slices(160, 8192)) > 1
    target = x if wrt == "input" else lin.weight
    got = {}
    for compute in ("native", "emulated"):
        with mixprec.autocast("cpu", compute=compute):
            y = lin(x)
        v = torch.randn(3, *y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        (got[compute],) = torch.autograd.grad(y, target, v, is_grads_batched=True)
    assert got["emulated"].shape == got["native"].shape == (3, *target.shape)
    assert got["emulated"].dtype == got["native"].dtype
    torch.testing.assert_close(got["emulated"], got["native"], rtol=0.02, atol=0.02 * float(got["native"].abs().max()))
