"""Autocast state: nesting, enabled=False, reuse, decorator, threads, exceptions."""

from __future__ import annotations

import threading

import pytest
import torch

import mixprec

A = torch.randn(4, 4)
B = torch.randn(4, 4)


def mm_dtype() -> torch.dtype:
    return torch.mm(A, B).dtype


def test_outside_region_runs_float32():
    assert mm_dtype() is torch.float32
    assert not mixprec.is_autocast_enabled("cpu")


def test_region_sets_and_restores_state():
    with mixprec.autocast("cpu", dtype=torch.float16):
        assert mixprec.is_autocast_enabled("cpu")
        assert mixprec.get_autocast_dtype("cpu") is torch.float16
        assert mm_dtype() is torch.float16
    assert not mixprec.is_autocast_enabled("cpu")
    assert mixprec.get_autocast_dtype("cpu") is torch.bfloat16
    assert mm_dtype() is torch.float32


@pytest.mark.parametrize(
    ("device", "dtype"),
    [("cpu", torch.bfloat16), ("cuda", torch.float16), ("xpu", torch.bfloat16), ("mps", torch.float16)],
)
def test_default_dtype_per_device(device, dtype):
    assert mixprec.get_autocast_dtype(device) is dtype


def test_enabled_false_subregion_and_reentry():
    with mixprec.autocast("cpu"):
        assert mm_dtype() is torch.bfloat16
        with mixprec.autocast("cpu", enabled=False):
            assert not mixprec.is_autocast_enabled("cpu")
            assert mm_dtype() is torch.float32
            with mixprec.autocast("cpu"):
                assert mm_dtype() is torch.bfloat16
            assert mm_dtype() is torch.float32
        assert mm_dtype() is torch.bfloat16


def test_nested_dtype_change_restores_outer_dtype():
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        with mixprec.autocast("cpu", dtype=torch.float16):
            assert mm_dtype() is torch.float16
        assert mm_dtype() is torch.bfloat16


def test_one_instance_reused_and_nested():
    region = mixprec.autocast("cpu")
    with region:
        with region:
            assert mm_dtype() is torch.bfloat16
        assert mixprec.is_autocast_enabled("cpu")
    assert not mixprec.is_autocast_enabled("cpu")
    with region as entered:
        assert entered is region
        assert mm_dtype() is torch.bfloat16


def test_decorator():
    @mixprec.autocast("cpu", dtype=torch.float16)
    def run(x, y):
        return torch.mm(x, y)

    assert run(A, B).dtype is torch.float16
    assert run.__name__ == "run"
    assert not mixprec.is_autocast_enabled("cpu")


def test_decorated_forward_in_module():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        @mixprec.autocast("cpu")
        def forward(self, x):
            return self.fc(x)

    assert Net()(A).dtype is torch.bfloat16


def test_exception_restores_state():
    with pytest.raises(ZeroDivisionError), mixprec.autocast("cpu"), mixprec.autocast("cpu", dtype=torch.float16):
        raise ZeroDivisionError
    assert not mixprec.is_autocast_enabled("cpu")
    assert mm_dtype() is torch.float32


def test_decorator_exception_restores_state():
    @mixprec.autocast("cpu")
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert not mixprec.is_autocast_enabled("cpu")


def test_state_is_thread_local():
    seen = {}

    def worker():
        seen["enabled"] = mixprec.is_autocast_enabled("cpu")
        seen["dtype"] = mm_dtype()
        with mixprec.autocast("cpu", dtype=torch.float16):
            seen["inner"] = mm_dtype()

    with mixprec.autocast("cpu"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert mm_dtype() is torch.bfloat16
    assert seen == {"enabled": False, "dtype": torch.float32, "inner": torch.float16}


def test_decorated_function_in_two_threads_at_once():
    barrier = threading.Barrier(2)
    results = []

    @mixprec.autocast("cpu")
    def work():
        barrier.wait()
        results.append(mm_dtype())
        barrier.wait()
        return mixprec.is_autocast_enabled("cpu")

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [torch.bfloat16, torch.bfloat16]


def test_two_devices_keep_separate_state():
    with mixprec.autocast("cpu", dtype=torch.float16):
        with mixprec.autocast("xla", dtype=torch.bfloat16):
            assert mixprec.is_autocast_enabled("xla")
            assert mixprec.get_autocast_dtype("cpu") is torch.float16
            assert mm_dtype() is torch.float16  # CPU tensors follow the CPU region only
        assert not mixprec.is_autocast_enabled("xla")


def test_other_device_region_leaves_cpu_tensors_alone():
    with mixprec.autocast("xla"):
        assert mm_dtype() is torch.float32


def test_get_policy_follows_region():
    assert mixprec.get_policy("cpu") is mixprec.policies.CPU
    assert mixprec.get_policy("cuda") is mixprec.policies.CUDA
    with mixprec.autocast("cpu", policy=mixprec.policies.CPU_DOCUMENTED):
        assert mixprec.get_policy("cpu") is mixprec.policies.CPU_DOCUMENTED
    assert mixprec.get_policy("cpu") is mixprec.policies.CPU


def test_backward_runs_in_forward_dtypes():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4, requires_grad=True)
    with mixprec.autocast("cpu"):
        y = torch.mm(x, w)
    assert y.dtype is torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype is torch.float32 and x.grad.dtype is torch.float32
    expected = torch.mm(x.detach().bfloat16().t(), torch.ones(4, 4, dtype=torch.bfloat16)).float()
    assert torch.equal(w.grad, expected)
