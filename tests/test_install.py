"""mixprec.install: every torch.autocast region in the process follows mixprec, until remove()."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mixprec

BF16, F32 = torch.bfloat16, torch.float32
LINEAR_FP32 = mixprec.policies.CPU.with_ops(fp32=["linear"])
A, W = torch.randn(4, 8), torch.randn(6, 8)


def _linear_dtype(region):
    with region():
        return torch.nn.functional.linear(A, W).dtype


def test_torch_autocast_regions_follow_the_installed_policy_until_removed():
    with torch.autocast("cpu"):
        native = torch.nn.functional.linear(A, W)
    handle = mixprec.install(LINEAR_FP32)
    try:
        assert _linear_dtype(lambda: torch.autocast("cpu")) is F32
        assert mixprec.get_policy("cpu") is LINEAR_FP32 and handle.active
    finally:
        handle.remove()
    with torch.autocast("cpu"):
        again = torch.nn.functional.linear(A, W)
    assert again.dtype is BF16 and torch.equal(again, native)
    assert mixprec.get_policy("cpu") is mixprec.policies.CPU and not handle.active


def test_installed_in_one_thread_applies_in_every_thread():
    seen = []
    with mixprec.install(LINEAR_FP32):
        thread = threading.Thread(target=lambda: seen.append(_linear_dtype(lambda: torch.autocast("cpu"))))
        thread.start()
        thread.join()
    assert seen == [F32]


def test_installing_again_replaces_and_the_old_handle_does_nothing():
    first = mixprec.install(LINEAR_FP32)
    second = mixprec.install(mixprec.policies.CPU.with_ops(fp32=["mm"]))
    first.remove()  # replaced already: nothing to remove
    assert second.active and not first.active
    with torch.autocast("cpu"):
        assert torch.mm(A, W.t()).dtype is F32 and torch.nn.functional.linear(A, W).dtype is BF16
    second.remove()
    second.remove()


def test_a_mixprec_region_keeps_its_own_policy_and_none_means_the_installed_one():
    with mixprec.install(LINEAR_FP32):
        assert _linear_dtype(lambda: mixprec.autocast("cpu", policy=mixprec.policies.CPU)) is BF16
        assert _linear_dtype(lambda: mixprec.autocast("cpu")) is F32


def test_installed_emulated_compute_is_what_a_mixprec_region_computes():
    with mixprec.autocast("cpu", compute="emulated"):
        expected = torch.nn.functional.linear(A, W)
    with mixprec.install(compute="emulated"), torch.autocast("cpu"):
        got = torch.nn.functional.linear(A, W)
    assert got.dtype is BF16 and torch.equal(got, expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "CPU"}, TypeError, r"autocast argument 'policy' has the wrong type.*Received: policy='CPU'"),
        ({"compute": "fast"}, ValueError, r"autocast argument 'compute' is invalid.*Expected one of: auto"),
        ({"compute": 1}, TypeError, r"autocast argument 'compute' has the wrong type"),
    ],
)
def test_bad_arguments_get_autocasts_errors_and_install_nothing(kwargs, error, match):
    with pytest.raises(error, match=match):
        mixprec.install(**kwargs)
    assert mixprec.engine._installation.current is None


def test_compiled_code_recompiles_when_an_installation_comes_and_goes():
    compiled = torch.compile(lambda a, w: torch.nn.functional.linear(a, w), fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu"):
        assert compiled(A, W).dtype is BF16
    with mixprec.install(LINEAR_FP32), torch.autocast("cpu"):
        assert compiled(A, W).dtype is F32
    with torch.autocast("cpu"):
        assert compiled(A, W).dtype is BF16


def test_checkpoint_recompute_under_an_installation_gives_the_uncheckpointed_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    with mixprec.install(LINEAR_FP32):
        for use in (False, True):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu"):
                out = checkpoint(model, x, use_reentrant=False) if use else model(x)
            out.float().sum().backward()
            grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert grads[0][0].dtype is F32


def test_a_native_forward_recomputes_natively_even_after_an_install():
    with mixprec.autocast("cpu", policy=LINEAR_FP32):
        pass  # linear now goes through mixprec's kernel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for use in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu"):
            out = checkpoint(model, x, use_reentrant=False) if use else model(x)
        with mixprec.install(LINEAR_FP32):  # installed only for the backward, and the recompute in it
            out.float().sum().backward()
        grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert grads[0][0].dtype is BF16
