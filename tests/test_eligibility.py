"""Which calls autocast touches: floating tensors on the device, not float64,
not in-place, not out=, not with an explicit dtype, in every namespace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec

X = torch.randn(4, 4)
Y = torch.randn(4, 4)


def run(fn):
    with mixprec.autocast("cpu"):
        return fn()


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("torch.mm", lambda: torch.mm(X, Y)),
        ("Tensor.mm", lambda: X.mm(Y)),
        ("operator @", lambda: X @ Y),
        ("torch.matmul", lambda: torch.matmul(X, Y)),
        ("F.linear", lambda: F.linear(X, Y)),
        ("torch._C._nn.linear", lambda: torch._C._nn.linear(X, Y)),
        ("nn.Linear", lambda: torch.nn.Linear(4, 4)(X)),
        ("torch.addmm", lambda: torch.addmm(X, X, Y)),
        ("Tensor.addmm", lambda: X.addmm(X, Y)),
        ("F.conv1d", lambda: F.conv1d(X[None], Y[:, :, None])),
        ("torch.linalg.vecdot", lambda: torch.linalg.vecdot(X, Y)),
    ],
)
def test_lower_precision_in_every_namespace(name, call):
    assert run(call).dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("float64 inputs", lambda: torch.mm(X.double(), Y.double())),
        ("integer inputs", lambda: torch.mm(X.long(), Y.long())),
        ("out=", lambda: torch.mm(X, Y, out=torch.empty(4, 4))),
        ("in-place addmm_", lambda: X.clone().addmm_(X, Y)),
    ],
)
def test_ineligible_calls_run_unchanged(name, call):
    with torch.no_grad():
        expected = call()
        got = run(call)
    assert got.dtype is expected.dtype
    assert torch.equal(got, expected)


def test_explicit_dtype_is_respected():
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
        assert torch.sum(X.half(), dtype=torch.float16).dtype is torch.float16
        assert torch.softmax(X.half(), 0, torch.float16).dtype is torch.float16
        assert torch.sum(X.half()).dtype is torch.float32


def test_tensors_on_other_devices_are_not_cast():
    meta = torch.empty(4, 4, device="meta")
    with mixprec.autocast("cpu"):
        assert torch.mm(meta, meta).dtype is torch.float32


def test_unlisted_op_follows_inputs():
    with mixprec.autocast("cpu"):
        z = torch.mm(X, Y)
        assert (z + 1).dtype is torch.bfloat16
        assert (z + X).dtype is torch.float32


def test_reversed_operators_under_cuda_policy():
    h = X.half().abs() + 0.5
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
        assert (2**h).dtype is torch.float32
        assert (2 / h).dtype is torch.float32
        assert (h**2).dtype is torch.float32
        assert (h @ h).dtype is torch.float16


def test_python_composites_are_seen_inside():
    mha = torch.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    with mixprec.autocast("cpu"):
        out, weights = mha(x, x, x)
    assert out.dtype is torch.bfloat16
    assert weights.dtype is torch.bfloat16


def test_banned_raises_with_advice_only_under_cuda_policy():
    p = torch.rand(4)
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, p)
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            torch.nn.BCELoss()(p, p)
    with mixprec.autocast("cpu"):
        assert F.binary_cross_entropy(p, p).dtype is torch.float32


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.int64, torch.bool]


@pytest.mark.parametrize("to", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("source", _DTYPES, ids=str)
@pytest.mark.parametrize("device_type", ["cpu", "cuda", "meta"])
def test_the_kernels_cast_exactly_the_eligible_tensors(source, to, device_type):
    """``_cast.cast_call`` writes eligibility out for the kernels' hot path: it must cast what
    ``_plan.eligible_tensor`` (the one rule) calls eligible, plain, in a list, or by keyword, and nothing else."""
    from mixprec.engine import _cast, _plan

    t = torch.ones(2, dtype=source, device="meta" if device_type == "meta" else "cpu")
    weight = torch.nn.Parameter(torch.ones(2)) if source is torch.float32 else t
    for value in (t, weight):
        expected = to if _plan.eligible_tensor(value, device_type) else value.dtype
        (plain, listed), kwargs = _cast.cast_call((value, [value]), {"other": value}, to, device_type, False)
        assert (plain.dtype, listed[0].dtype, kwargs["other"].dtype) == (expected,) * 3
        if expected is value.dtype:
            assert plain is value  # an ineligible tensor (or one already in the dtype) is passed on as it is
