"""Soak and leak (issue 14): thousands of regions leave no state, registration, cast or memory behind.

The soak runs a round of scenarios in the main thread, one per iteration, while three worker threads, each
with its own policy, take one step per iteration (a barrier keeps them in step, so that every stretch of
the soak has the same mix). The scenarios mix:

* regions with different policies and computes (``CPU``, ``mm`` in float32, ``gelu`` promoted, ``CUDA`` run
  on CPU, ``compute="emulated"``, float16 with ``compute="auto"``), as context managers, a decorator and one
  ``AutocastModule`` that two threads enter at once;
* nested ``torch.autocast`` regions, enabled and disabled, bfloat16 and float16, a disabled
  ``mixprec.autocast``, and a ``mixprec.autocast`` inside a ``torch.autocast``;
* exceptions raised inside regions: by the test, by a mixprec kernel (a shape error, a banned op), by a
  module's forward under a module policy; all caught outside the region;
* ``set_module_policy`` set and removed again, ``mixprec.install`` / ``remove()`` with plain
  ``torch.autocast`` regions before, during and after;
* backward after the region, through emulated kernels and through checkpoints recomputed there.

Checked: after every scenario and at the end of every thread, torch's autocast state is off and mixprec's
thread state is empty; the kernels registered are exactly those the soak's settings need (computed here
from the policy tables and the dispatcher's own lists) and a second soak adds none; weights and their
low-precision casts die with their region; the process's resident memory is flat.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import engine
from mixprec.engine import _cast, _kernels, _state, _tables
from mixprec.engine import _installation as _install
from mixprec.policies import Category, Policy

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CPU = mixprec.policies.CPU
CUDA = mixprec.policies.CUDA
MM_FP32 = CPU.with_ops(fp32=["mm"])
GELU_PROMOTE = CPU.with_ops(promote=["gelu"])
LINEAR_FP32 = CPU.with_ops(fp32=["linear"])  # the module policy

ITERATIONS = 1500  # main-thread iterations of the first soak; each worker takes as many steps
MEASURED = 5000  # iterations of the second soak, whose resident memory is measured (the first warmed up)
WARMUP = 100  # iterations of the second soak before its first memory window (its threads start)
WINDOW = 1000  # iterations per memory window: the first after warm-up, and the last
PROBE_EVERY = 97  # every so many iterations the scenario runs with a Probe (gc.collect is slow)
MIN_REGIONS = 10_000  # region entries (and exits) per soak, every thread counted
# Bytes the mean resident size may grow from the first window to the last. Measured on a 2-core x86 VM, torch
# 2.13: +1 to +135 KiB (allocator settling). Keeping one 4x4 weight and its bfloat16 cast (what a cache entry
# that outlives its region holds) in one scenario, so every 9th iteration, grows it by ~770 KiB; every iteration,
# by ~10 MiB.
RSS_BOUND = 512 * 2**10

X = torch.randn(4, 4)
CPU_START_DTYPE = torch.get_autocast_dtype("cpu")


# No scenario uses a weight in a float16 region nested in a bfloat16 one where torch's own kernels may run (the
# default policy's ops, until some setting gives them a mixprec kernel): torch's cast cache is keyed by the
# weight alone, so the nested region gets the weight's bfloat16 cast and mm raises "expected m1 and m2 to have
# the same dtype" (torch 2.13, with native torch.autocast as well). mixprec's cache is keyed by (weight, dtype).


class _RaisedInsideError(Exception):
    """Raised by the test inside regions."""


# ---------------------------------------------------------------------------------------------------------
# What a region leaves behind


def _nesting() -> int:
    """torch's autocast nesting level in this thread (torch has no getter: step it up and down)."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


def leftovers(start_dtype: torch.dtype) -> list[str]:
    """What this thread still has of any region: empty when every region is closed."""
    found = []
    state = _state.get()
    if torch.is_autocast_enabled("cpu"):
        found.append("torch's CPU autocast is on")
    if torch.get_autocast_dtype("cpu") is not start_dtype:
        found.append(f"CPU autocast dtype {torch.get_autocast_dtype('cpu')}, was {start_dtype}")
    if not torch.is_autocast_cache_enabled():
        found.append("torch's autocast cache is off")
    if _nesting():
        found.append(f"torch's autocast nesting is {_nesting()}")
    if state.active or state.frames or state.module_policies:
        found.append(
            f"mixprec state: active={state.active}, frames={state.frames}, module_policies={state.module_policies}"
        )
    if _cast.thread_cache():
        found.append(f"{len(_cast.thread_cache())} cast cache entries")
    return found


class Probe:
    """Weak references to the weights a scenario makes and to their low-precision casts."""

    def __init__(self) -> None:
        self.weights: list[weakref.ref[torch.Tensor]] = []
        self.casts: list[weakref.ref[torch.Tensor]] = []

    def weight(self, w: torch.Tensor) -> None:
        self.weights.append(weakref.ref(w))

    def look(self, *outputs: torch.Tensor) -> None:
        """Inside a region: the casts in mixprec's cache, and those the outputs' autograd nodes saved."""
        for *_, cast in _cast.thread_cache().entries():
            self.casts.append(weakref.ref(cast))
        for out in outputs:
            node = out.grad_fn
            for name in dir(node) if node is not None else ():
                saved = getattr(node, name) if name.startswith("_saved_") else None
                if isinstance(saved, torch.Tensor) and saved.dtype in (BF16, F16):
                    self.casts.append(weakref.ref(saved))

    def alive(self) -> list[str]:
        """What is still alive (after a full collection): to be called once the region's references are gone."""
        gc.collect()
        found = []
        for what, refs in (("weights", self.weights), ("casts", self.casts)):
            count = sum(ref() is not None for ref in refs)
            if count:
                found.append(f"{count} of {len(refs)} {what}")
        return found


def weight(probe: Probe | None) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.randn(4, 4))
    if probe is not None:
        probe.weight(w)
    return w


def look(probe: Probe | None, *outputs: torch.Tensor) -> None:
    if probe is not None:
        probe.look(*outputs)


# ---------------------------------------------------------------------------------------------------------
# Main-thread scenarios: each returns the number of regions it entered (and exited)


def cpu_policy_with_nested_torch_regions(probe: Probe | None) -> int:
    w = weight(probe)
    with mixprec.autocast("cpu", policy=CPU):
        y = torch.mm(w, w)
        assert y.dtype is BF16
        with torch.autocast("cpu", enabled=False):
            assert torch.mm(X, w).dtype is F32
        with torch.autocast("cpu", dtype=F16):  # not w (see torch's cache above)
            assert torch.mm(X, X).dtype is F16
            with torch.autocast("cpu", enabled=False):
                assert F.linear(X, w).dtype is F32
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is BF16
        look(probe, y)
    return 4


def mm_fp32_with_exceptions(probe: Probe | None) -> int:
    w = weight(probe)
    with pytest.raises(_RaisedInsideError), mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
        y, z = torch.mm(w, w), F.linear(X, w)
        assert y.dtype is F32 and z.dtype is BF16
        look(probe, y, z)
        with torch.autocast("cpu", dtype=BF16):
            raise _RaisedInsideError
    assert not torch.is_autocast_enabled("cpu")
    region = mixprec.autocast("cpu", policy=MM_FP32, compute="native")
    with pytest.raises(RuntimeError, match="cannot be multiplied"), region:  # raised inside mixprec's mm kernel
        torch.mm(X, torch.ones(3, 3))
    return 3


def gelu_promote_with_float16_inside(probe: Probe | None) -> int:
    w = weight(probe)
    with mixprec.autocast("cpu", policy=GELU_PROMOTE):
        h = F.linear(X, w)
        g = F.gelu(h)
        assert h.dtype is BF16 and g.dtype is BF16 and F.gelu(X).dtype is F32
        with torch.autocast("cpu", dtype=F16):  # not w (see torch's cache above)
            assert F.linear(X, X).dtype is F16
            with torch.autocast("cpu", enabled=False):
                assert F.linear(X, w).dtype is F32
        look(probe, g)
    return 3


def cuda_policy_on_cpu_with_a_banned_op(probe: Probe | None) -> int:
    w = weight(probe)
    with mixprec.autocast("cpu", policy=CUDA):
        y = torch.mm(w, w)
        assert y.dtype is BF16 and torch.softmax(y, -1).dtype is F32  # CUDA's softmax: fp32_set_opt_dtype
        look(probe, y)
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.sigmoid(X), torch.rand(4, 4))
    return 1


def emulated_with_an_inner_region(probe: Probe | None) -> int:
    w = weight(probe)
    with mixprec.autocast("cpu", compute="emulated"):
        y = F.linear(X, w)
        assert y.dtype is BF16 and _cast.thread_cache()  # the weight's cast went through mixprec's cache
        with mixprec.autocast("cpu", compute="emulated", policy=MM_FP32):
            assert torch.mm(w, w).dtype is F32
            with mixprec.autocast("cpu", enabled=False):
                assert F.linear(X, w).dtype is F32
        assert _cast.thread_cache(), "an inner region's exit cleared the outer region's cache"
        z = torch.mm(w, w)
        look(probe, y, z)
    (y.float().sum() + z.float().sum()).backward()  # emulated backward turns autocast off, and back on
    assert w.grad is not None and w.grad.dtype is F32
    return 3


def checkpoints_recomputed_after_the_region(probe: Probe | None) -> int:
    w = weight(probe)
    with mixprec.autocast("cpu", compute="emulated"):
        y = checkpoint(lambda a: F.gelu(torch.mm(a, w)), X, use_reentrant=False)
        z = checkpoint(torch.mm, X, w, use_reentrant=True)
        assert y.dtype is BF16 and z.dtype is BF16
        look(probe)  # the cache only: unpacking a checkpoint's saved tensors would recompute now
    (y.float().sum() + z.float().sum()).backward()  # recomputes under the setting each forward left
    assert w.grad is not None and w.grad.dtype is F32
    return 1


def float16_auto(probe: Probe | None) -> int:
    w = weight(probe)
    try:
        with mixprec.autocast("cpu", dtype=F16, policy=GELU_PROMOTE):
            y = torch.mm(w, w)
            assert y.dtype is F16 and F.gelu(y).dtype is F16
            look(probe, y)
            raise _RaisedInsideError
    except _RaisedInsideError:
        pass
    return 1


def module_policy_set_and_removed(probe: Probe | None) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    if probe is not None:
        probe.weight(model[0].weight)
    handle = mixprec.set_module_policy(model[0], LINEAR_FP32)
    try:
        with mixprec.autocast("cpu", compute="native"):
            out = model(X)
            low = F.linear(X, model[0].weight)  # outside the module: the default policy, in bfloat16
            assert out.dtype is F32 and low.dtype is BF16
            look(probe, out, low)  # low's autograd node holds the weight's cast whatever the cache keeps
            del low
        with torch.autocast("cpu", dtype=BF16):
            assert model(X).dtype is F32
        with pytest.raises(RuntimeError), mixprec.autocast("cpu", compute="native"):
            model(torch.randn(4, 3))  # forward raises; the module's hook closes its level all the same
    finally:
        handle.remove()
    with mixprec.autocast("cpu", compute="native"):
        assert model(X).dtype is BF16
    return 4


def install_and_remove_between_torch_regions(probe: Probe | None) -> int:
    w = weight(probe)
    with torch.autocast("cpu", dtype=BF16):
        before = torch.mm(X, w)
        assert before.dtype is BF16
    handle = mixprec.install(MM_FP32, compute="native")  # the same casts to follow on every CPU
    try:
        with torch.autocast("cpu", dtype=BF16):
            y, z = torch.mm(w, w), F.linear(X, w)
            assert y.dtype is F32 and z.dtype is BF16
            look(probe, y, z)
        with torch.autocast("cpu", dtype=F16):
            assert torch.mm(X, w).dtype is F32 and F.linear(X, w).dtype is F16
        with mixprec.autocast("cpu"):  # policy=None: the installed one
            assert torch.mm(X, w).dtype is F32
    finally:
        handle.remove()
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(torch.mm(X, w), before)  # torch's native result again
    assert _install.current is None
    return 5


SCENARIOS: dict[str, Callable[[Probe | None], int]] = {
    f.__name__: f
    for f in (
        cpu_policy_with_nested_torch_regions,
        mm_fp32_with_exceptions,
        gelu_promote_with_float16_inside,
        cuda_policy_on_cpu_with_a_banned_op,
        emulated_with_an_inner_region,
        checkpoints_recomputed_after_the_region,
        float16_auto,
        module_policy_set_and_removed,
        install_and_remove_between_torch_regions,
    )
}


# ---------------------------------------------------------------------------------------------------------
# Worker threads: each has its own policy, and takes one step per main-thread iteration


@mixprec.autocast("cpu", policy=MM_FP32, compute="native")
def _decorated_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


#: One region instance that two workers enter at once (forward only): a model served from several threads.
SHARED = mixprec.AutocastModule(torch.nn.Linear(4, 4), "cpu", policy=MM_FP32)


class MmFp32Worker:
    """mm in float32, a disabled torch region inside that sometimes raises, the decorator, and SHARED."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def step(self, i: int) -> int:
        try:
            with mixprec.autocast("cpu", policy=MM_FP32, compute="native"):
                assert torch.mm(X, self.w).dtype is F32 and F.linear(X, self.w).dtype is BF16
                with torch.autocast("cpu", enabled=False):
                    assert F.linear(X, self.w).dtype is F32
                    if i % 7 == 0:
                        raise _RaisedInsideError
        except _RaisedInsideError:
            pass
        assert _decorated_mm(X, self.w).dtype is F32 and SHARED(X).dtype is BF16
        return 4

    def close(self) -> None:
        pass


class EmulatedModuleWorker:
    """Emulated compute with gelu promoted, and a module policy set for the whole thread and removed at its end."""

    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
        self.handle = mixprec.set_module_policy(self.model[0], LINEAR_FP32)

    def step(self, i: int) -> int:
        with mixprec.autocast("cpu", policy=GELU_PROMOTE, compute="emulated"):
            w = self.model[0].weight
            assert torch.mm(X, w).dtype is BF16 and self.model(X).dtype is F32
            with torch.autocast("cpu", dtype=F16):
                assert torch.mm(X, w).dtype is F16
        return 2

    def close(self) -> None:
        self.handle.remove()


class TorchOuterWorker:
    """A plain torch.autocast region (mixprec.install comes and goes in the main thread) with CUDA's policy
    inside, and SHARED inside a float16 one."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def step(self, i: int) -> int:
        with torch.autocast("cpu", dtype=BF16):
            assert F.linear(X, self.w).dtype is BF16  # under the installed MM_FP32 too
            with mixprec.autocast("cpu", policy=CUDA):
                assert torch.softmax(F.linear(X, self.w), -1).dtype is F32
            assert torch.is_autocast_enabled("cpu") and not _state.get().active
            with torch.autocast("cpu", dtype=F16):
                assert SHARED(X).dtype is BF16  # its own region's dtype
            if i % 5:
                return 4
            banned = pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits")
            with banned, mixprec.autocast("cpu", policy=CUDA):
                F.binary_cross_entropy(torch.sigmoid(X), torch.rand(4, 4))
        return 5

    def close(self) -> None:
        pass


WORKERS = (MmFp32Worker, EmulatedModuleWorker, TorchOuterWorker)


# ---------------------------------------------------------------------------------------------------------
# The settings the soak runs under, and the kernels they need, computed from the tables


def emulates(compute: str, dtype: torch.dtype) -> bool:
    return compute == "emulated" or (compute == "auto" and not mixprec.kernel_support("cpu", dtype).native)


#: (policy, compute, dtype) of every setting the soak runs ops under.
USED: tuple[tuple[Policy, str, torch.dtype], ...] = (
    (CPU, "auto", BF16),  # cpu_policy_with_nested_torch_regions (float16 inside keeps the bf16 setting)
    (MM_FP32, "native", BF16),  # mm_fp32_with_exceptions, MmFp32Worker
    (GELU_PROMOTE, "auto", BF16),  # gelu_promote_with_float16_inside
    (CUDA, "auto", BF16),  # cuda_policy_on_cpu_with_a_banned_op, TorchOuterWorker
    (CPU, "emulated", BF16),  # emulated_with_an_inner_region, checkpoints_recomputed_after_the_region
    (MM_FP32, "emulated", BF16),  # its inner region
    (GELU_PROMOTE, "auto", F16),  # float16_auto
    (LINEAR_FP32, "native", BF16),  # module_policy_set_and_removed
    (MM_FP32, "auto", BF16),  # install: every dtype of the device, up front
    (MM_FP32, "auto", F16),
    (GELU_PROMOTE, "emulated", BF16),  # EmulatedModuleWorker
    (LINEAR_FP32, "emulated", BF16),  # its module policy, inside its emulated region
)


def _registrations(key: str) -> frozenset[str]:
    return frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(key))


def expected_overloads(used: Iterable[tuple[Policy, str, torch.dtype]], native: dict[str, frozenset[str]]) -> set:
    """The overloads whose category under a used policy differs from torch's native CPU autocast, plus the
    ``lower_precision_fp`` ones of settings that emulate: the design's rule, from the tables.

    ``native``: the overloads torch registers at each device's Autocast key (read before mixprec's).
    An unchanged entry of a policy follows its base device's native kernels (CUDA's on CPU too).
    """
    defaults = {"cpu": _tables.categories(CPU), "cuda": _tables.categories(CUDA)}

    def native_of(device: str) -> dict:
        return {op: c for op, c in defaults[device].items() if _tables.qualified(op) in native[device]}

    here = native_of("cpu")
    out: set = set()
    for policy, compute, dtype in used:
        base = "cuda" if policy.base == "CUDA" else "cpu"
        mine = _tables.categories(policy)
        effective = native_of(base)
        for op in mine.keys() | defaults[base].keys():
            if mine.get(op) is not defaults[base].get(op):
                effective.pop(op, None)
                if op in mine:
                    effective[op] = mine[op]
        out |= {op for op in effective.keys() | here.keys() if effective.get(op) is not here.get(op)}
        lower = {op for op, c in effective.items() if c is Category.LOWER_PRECISION_FP}
        if emulates(compute, dtype):
            out |= lower
        elif compute == "auto" and dtype is F16:  # native float16: oneDNN has no float16 RNN (docs/design.md)
            out |= {op for op in lower if _tables.qualified(op) == "aten::mkldnn_rnn_layer"}
    return out


# ---------------------------------------------------------------------------------------------------------
# The soak


def _rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(iterations: int) -> tuple[list[int], list[int]]:
    """Run the soak: ``(regions entered per thread, main thread first, RSS after each main iteration)``."""
    barrier = threading.Barrier(1 + len(WORKERS), timeout=120)
    regions = [0] * (1 + len(WORKERS))
    failures: list[str] = []
    rss: list[int] = []
    scenarios = list(SCENARIOS.values())

    def work(index: int, kind: type) -> None:
        start_dtype = torch.get_autocast_dtype("cpu")
        try:
            worker = kind()
            try:
                for i in range(iterations):
                    barrier.wait()
                    regions[index] += worker.step(i)
                    left = leftovers(start_dtype)
                    if left:
                        raise AssertionError(f"after step {i}: {left}")
                    if i % PROBE_EVERY == 0:
                        barrier.wait()  # parked while the main thread's Probe looks (see there)
            finally:
                worker.close()
        except threading.BrokenBarrierError:
            return  # the main thread failed
        except BaseException as e:
            failures.append(f"{kind.__name__}: {type(e).__name__}: {e}")
            barrier.abort()
            return
        left = leftovers(start_dtype)  # the thread's end
        if left:
            failures.append(f"{kind.__name__} at its end: {left}")

    threads = [threading.Thread(target=work, args=(n + 1, kind)) for n, kind in enumerate(WORKERS)]
    for thread in threads:
        thread.start()
    done = 0
    try:
        for i in range(iterations):
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                break  # a worker failed: its failure is reported below
            scenario = scenarios[i % len(scenarios)]
            probe = Probe() if i % PROBE_EVERY == 0 else None
            regions[0] += scenario(probe)
            left = leftovers(CPU_START_DTYPE) + (["mixprec.install in force"] if _install.current else [])
            assert not left, f"main thread, iteration {i} ({scenario.__name__}): {left}"
            if probe is not None:
                # Every worker parked first: the mirror of torch's cast cache is process-wide, and a worker whose
                # region exits clears it, main's entries too; until that clear has destroyed the entries it took
                # (mirror_clear reacquiring the GIL, or a cast's destruction releasing it), a weight's cast there
                # keeps the weight alive, and gc.collect holds the GIL throughout.
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    break  # a worker failed: its failure is reported below
                assert not probe.alive(), f"iteration {i} ({scenario.__name__}): alive after the region"
            rss.append(_rss())
            done += 1
    except BaseException:
        barrier.abort()
        raise
    finally:
        for thread in threads:
            thread.join()
    assert not failures, "\n".join(failures)
    assert done == iterations
    return regions, rss


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@pytest.fixture
def _pristine_kernels():
    """No mixprec kernel before the test (only its own registrations count) nor after it."""
    engine.reset()
    yield
    engine.reset()


@pytest.mark.usefixtures("_pristine_kernels")
def test_soak_leaves_no_state_no_extra_registrations_and_flat_memory():
    native = {"cpu": _registrations("AutocastCPU"), "cuda": _registrations("AutocastCUDA")}
    assert native["cpu"] == _tables.native_registrations("AutocastCPU")
    expected = expected_overloads(USED, native)

    start = time.perf_counter()
    regions, _ = soak(ITERATIONS)
    first_time = time.perf_counter() - start
    after_first = _kernels.registered("cpu")
    assert leftovers(CPU_START_DTYPE) == [] and _install.current is None
    unexpected = sorted(map(_tables.qualified, after_first - expected))
    missing = sorted(map(_tables.qualified, expected - after_first))
    assert not unexpected and not missing, f"registered but not needed: {unexpected}; needed, not: {missing}"

    start = time.perf_counter()
    regions_again, rss = soak(MEASURED)
    second_time = time.perf_counter() - start
    after_second = _kernels.registered("cpu")

    first = sum(rss[WARMUP : WARMUP + WINDOW]) / WINDOW
    last = sum(rss[-WINDOW:]) / WINDOW
    print(
        f"\nsoak: {1 + len(WORKERS)} threads; first soak {ITERATIONS} iterations, {sum(regions)} region entries "
        f"(main {regions[0]}, workers {regions[1:]}), {first_time:.1f} s; second soak {MEASURED} iterations, "
        f"{sum(regions_again)} region entries, {second_time:.1f} s"
        f"\nRSS mean, second soak, iterations {WARMUP}-{WARMUP + WINDOW}: {_mib(first)}; last {WINDOW}: "
        f"{_mib(last)}; growth {(last - first) / 2**10:+.0f} KiB (bound {RSS_BOUND // 2**10} KiB); "
        f"min {_mib(min(rss[WARMUP:]))}, max {_mib(max(rss[WARMUP:]))}"
        f"\nmixprec kernels at AutocastCPU: expected {len(expected)}, after the first soak {len(after_first)}, "
        f"after the second {len(after_second)} (torch's own: {len(native['cpu'])})"
    )
    assert sum(regions) >= MIN_REGIONS and sum(regions_again) >= MIN_REGIONS
    assert leftovers(CPU_START_DTYPE) == [] and _install.current is None
    assert after_second == after_first, sorted(map(_tables.qualified, after_second - after_first))
    assert last - first < RSS_BOUND, f"RSS grew by {_mib(last - first)} from the first window to the last"


@pytest.mark.parametrize("name", SCENARIOS)
def test_weights_and_casts_die_with_their_region(name):
    probe = Probe()
    SCENARIOS[name](probe)
    assert not _cast.thread_cache(), "the cast cache outlived the outermost region"
    assert probe.weights and probe.casts, "the scenario found no weight or cast to follow"
    assert not probe.alive()


def test_worker_threads_end_with_their_state_clean():
    """Each worker kind alone in its own thread, a hundred steps: at its end the thread's state is clean."""
    found: dict[str, list[str]] = {}

    def run(kind: type) -> None:
        start_dtype = torch.get_autocast_dtype("cpu")
        try:
            worker = kind()
            try:
                for i in range(100):
                    worker.step(i)
            finally:
                worker.close()
        except BaseException as e:
            found[kind.__name__] = [f"{type(e).__name__}: {e}"]
            return
        found[kind.__name__] = leftovers(start_dtype)

    threads = [threading.Thread(target=run, args=(kind,)) for kind in WORKERS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == {kind.__name__: [] for kind in WORKERS}
    assert leftovers(CPU_START_DTYPE) == []
