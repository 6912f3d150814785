"""Shared fixtures: every test must leave autocast state as it found it."""

from __future__ import annotations

import pytest
import torch

from mixprec import _state


@pytest.fixture(autouse=True)
def _no_autocast_leak():
    stack_before = torch._C._len_torch_function_stack()
    yield
    state = _state.get()
    leaked = dict(state.devices)
    nesting = state.nesting
    stack_after = torch._C._len_torch_function_stack()
    # Clean up first, so that one leaking test does not fail all the others.
    state.devices.clear()
    state.saved.clear()
    state.contexts = ()
    state.cache.clear()
    while torch._C._len_torch_function_stack() > stack_before:
        torch._C._pop_torch_function_stack()
    assert not leaked and nesting == 0, f"test leaked mixprec autocast state: {leaked}, nesting={nesting}"
    assert stack_after == stack_before, "test leaked a torch function mode"
    assert not torch.is_autocast_enabled("cpu"), "test leaked native CPU autocast"
