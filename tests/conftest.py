"""Shared fixtures: every test must leave autocast state as it found it."""

from __future__ import annotations

import pytest
import torch

from mixprec import _autocast, _cast, _compute, _install, _state


@pytest.fixture(autouse=True)
def _no_autocast_leak():
    stack_before = torch._C._len_torch_function_stack()
    yield
    state = _state.get()
    leaked = dict(state.active)
    nesting = state.nesting
    stack_after = torch._C._len_torch_function_stack()
    native_on = torch.is_autocast_enabled("cpu")
    installed = _install.current
    _install.current = None
    dtype_after = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    # Clean up first, so that one leaking test does not fail all the others.
    _autocast.leave(state, len(state.frames))
    state.active.clear()
    _state.release(state)
    _cast.thread_cache().clear()
    mirror = dict(_cast._torch_cache)
    _cast._torch_cache.clear()
    while torch._C._len_torch_function_stack() > stack_before:
        torch._C._pop_torch_function_stack()
    torch.set_autocast_enabled("cpu", False)
    assert not leaked and nesting == 0, f"test leaked mixprec autocast state: {leaked}, nesting={nesting}"
    assert installed is None, "test left mixprec.install in force (call remove() on its handle)"
    assert stack_after == stack_before, "test leaked a torch function mode"
    assert not native_on, "test leaked native CPU autocast"
    assert dtype_after is torch.bfloat16, f"test leaked the CPU autocast dtype {dtype_after}"
    assert not mirror, "test left casts in mixprec's mirror of torch's cast cache (a torch region never closed)"


@pytest.fixture
def fake_cpu_flags(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Pretend the CPU has the given /proc/cpuinfo flags (torch's own probes silenced)."""

    def set_flags(*names: str) -> None:
        monkeypatch.setattr(_compute, "_cpu_flags", lambda: frozenset(names))
        monkeypatch.setattr(_compute, "_torch_probes", lambda dtype: ())
        monkeypatch.setattr(_compute.platform, "machine", lambda: "x86_64")
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        _compute._cpu_support.cache_clear()
        _compute._max_isa.cache_clear()
        _autocast._made.clear()

    yield set_flags
    _compute._cpu_support.cache_clear()
    _compute._max_isa.cache_clear()
    _autocast._made.clear()
