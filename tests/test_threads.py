"""Registrations are process-global and settings thread-local: concurrent threads never see each other's.

Three threads step together through a barrier, many times: one in a mixprec region whose policy moves
``mm`` to float32, one with no region, one in a native ``torch.autocast`` region. Each has its own tensors
(torch itself is not safe with backward on one shared module from several threads).
"""

from __future__ import annotations

import threading

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
