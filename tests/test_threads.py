"""Registrations are process-global and settings thread-local: concurrent threads never see each other's.

Three threads step together through a barrier, many times: one in a mixprec region whose policy moves
``mm`` to float32, one with no region, one in a native ``torch.autocast`` region. Each has its own tensors
(torch itself is not safe with backward on one shared module from several threads).
"""

from __future__ import annotations

import threading

import pytest
import torch

import mixprec

ITERATIONS = 300
MM_FP32 = mixprec.policies.CPU.with_ops(fp32=["mm"])


def test_three_threads_keep_their_own_settings():
    barrier = threading.Barrier(3, timeout=60)
    failures: list[str] = []
    a = torch.randn(8, 8)
    expected_native = torch.mm(a.bfloat16(), a.bfloat16())

    def custom_policy() -> None:
        x = a.clone()
        for i in range(ITERATIONS):
            barrier.wait()
            with mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
                mm, linear = torch.mm(x, x), torch.nn.functional.linear(x, x)
            if mm.dtype is not torch.float32 or linear.dtype is not torch.bfloat16:
                failures.append(f"policy thread, step {i}: mm {mm.dtype}, linear {linear.dtype}")

    def no_region() -> None:
        x = a.clone()
        for i in range(ITERATIONS):
            barrier.wait()
            mm = torch.mm(x, x)
            leaked = torch.is_autocast_enabled("cpu") or mixprec.get_policy("cpu") is MM_FP32
            if mm.dtype is not torch.float32 or leaked:
                failures.append(f"no-region thread, step {i}: mm {mm.dtype}")

    def native_region() -> None:
        x = a.clone()
        for i in range(ITERATIONS):
            barrier.wait()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mm = torch.mm(x, x)
            if mm.dtype is not torch.bfloat16 or not torch.equal(mm, expected_native):
                failures.append(f"native thread, step {i}: mm {mm.dtype}")

    with mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
        torch.mm(a, a)  # registers the mm kernel before the threads start, so every step goes through it
    threads = [threading.Thread(target=f) for f in (custom_policy, no_region, native_region)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, "\n".join(failures[:10])
    assert torch.ops.aten.mm.default in mixprec.engine._kernels.registered("cpu")


# --- a region entry that fails, and kernels that arrive while other threads run ----------------------------------


def test_a_setting_whose_push_fails_is_not_left_in_force(monkeypatch):
    """A thread's setting is told to the C++ kernels as it is pushed (``_state.on_change``); where that raises
    (as a race between two threads' first regions once made it), the region's entry fails and the thread keeps
    the setting it had: no level, no policy left in force."""
    from mixprec.engine import _state

    def refuse(device_type, setting):
        raise IndexError("told nothing")

    with mixprec.autocast("cpu", policy=MM_FP32):  # its kernels registered (they set on_change themselves)
        pass
    monkeypatch.setattr(_state, "on_change", refuse)
    with pytest.raises(IndexError), mixprec.autocast("cpu", policy=MM_FP32):
        pass
    monkeypatch.undo()
    state = _state.get()
    assert not state.frames and state.active.get("cpu") is None and mixprec.get_policy("cpu") is not MM_FP32
    x = torch.randn(4, 4)
    with torch.autocast("cpu"):
        assert torch.mm(x, x).dtype is torch.bfloat16


def test_a_level_whose_entry_fails_after_its_push_is_closed(monkeypatch):
    """An exception (Ctrl-C included) while a level sets torch's state leaves neither the level nor its setting:
    its ``__exit__`` never runs."""
    from mixprec.engine import _region, _state

    def interrupted(*args):
        raise KeyboardInterrupt

    with mixprec.autocast("cpu", policy=MM_FP32, compute="native"):  # its kernels registered
        pass
    monkeypatch.setattr(_region, "set_torch", interrupted)
    with pytest.raises(KeyboardInterrupt), mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
        pass
    monkeypatch.undo()
    state = _state.get()
    assert not state.frames and state.active.get("cpu") is None and not torch.is_autocast_enabled("cpu")


def test_the_mirror_of_torchs_cache_clears_with_torch_before_the_first_kernel_serves_a_call(monkeypatch):
    """The first kernels are registered one by one, the C++ extension loaded (or built: minutes) between them;
    another thread's plain torch.autocast region may reach a kernel already there and cast a weight through the
    mirror of torch's cache, which must clear as torch's does from then on (it kept a cast from before an
    optimizer step: stale weights in every region until the load ended)."""
    from mixprec import engine
    from mixprec.engine import _cast, _fastpath

    engine.reset()
    following = []
    real = _fastpath.attach

    def attach(*args):  # (called after each op's Python kernel is registered)
        following.append(torch.clear_autocast_cache is _cast.clear_autocast_cache)
        return real(*args)

    monkeypatch.setattr(_fastpath, "attach", attach)
    with mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
        pass
    assert following and all(following)
    engine.reset()
