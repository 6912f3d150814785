"""Autocast state: nesting, enabled=False, reuse, decorator, threads, exceptions."""

from __future__ import annotations

import threading

import pytest
import torch

import mixprec
from mixprec import engine
from mixprec.engine import _kernels, _state

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


@pytest.mark.parametrize("device", ["hpu", "xla", "maia", "mtia", "ipu"])
def test_a_device_the_references_do_not_cover_defaults_to_torchs_dtype(device):
    """Where no AMP reference names a default, mixprec takes torch's (HPU's is bfloat16, not float16): a thread
    of its own reads torch's initial state, which no region here has moved."""
    seen: list[torch.dtype] = []
    reader = threading.Thread(target=lambda: seen.append(torch.get_autocast_dtype(device)))
    reader.start()
    reader.join()
    assert mixprec.get_autocast_dtype(device) is seen[0]


def test_a_region_without_dtype_takes_the_dtype_in_force_as_torch_autocast():
    """``dtype=None`` is the autocast dtype in force when the region is made (torch.autocast's rule): an
    enclosing region's, kept by an ``enabled=False`` sub-region for a library's ``torch.autocast`` inside it,
    or ``torch.set_autocast_dtype``'s; outside any region, the device's default."""
    x = torch.randn(4, 4)

    def observe(make):  # type: ignore[no-untyped-def]
        seen = []
        with make("cpu", dtype=torch.float16):
            with make("cpu"):
                seen.append(torch.mm(x, x).dtype)
            with make("cpu", enabled=False):
                seen.append(torch.get_autocast_dtype("cpu"))
                with torch.autocast("cpu"):
                    seen.append(torch.mm(x, x).dtype)
            made_inside = make("cpu")
        with made_inside:  # (read when it was made)
            seen.append(torch.mm(x, x).dtype)
        with make("cpu"):
            seen.append(torch.mm(x, x).dtype)
        torch.set_autocast_dtype("cpu", torch.float16)
        try:
            with make("cpu"):
                seen.append(torch.mm(x, x).dtype)
            seen.append(mixprec.get_autocast_dtype("cpu"))
        finally:
            torch.set_autocast_dtype("cpu", torch.bfloat16)
        return seen

    native = observe(torch.autocast)
    assert native == [torch.float16] * 4 + [torch.bfloat16] + [torch.float16] * 2
    assert observe(mixprec.autocast) == native


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


# --- a region torch's kernels serve alone (docs/design.md) -------------------------------------------------


@pytest.fixture
def no_kernels():
    """No mixprec kernel registered (a region of the default policy with native compute needs none), and
    regions made afresh."""
    engine.reset()
    yield
    engine.reset()


def _frames() -> int:
    return len(_state.get().frames)


def _torch_state() -> tuple[bool, torch.dtype, bool]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()


@pytest.mark.usefixtures("no_kernels")
def test_default_region_without_kernels_sets_torch_state_alone():
    region = mixprec.autocast("cpu", compute="native")
    with region:  # the first entry of the setting takes a frame: it checks torch's tables
        assert _frames() == 1
    assert mixprec.autocast("cpu", dtype=torch.float16, compute="native")._plain  # checked: no frame from the start
    with region:
        assert _frames() == 0 and _state.get().ident not in _state.holders
        assert _torch_state() == (True, torch.bfloat16, True) and mm_dtype() is torch.bfloat16
        with region:  # open already: this level keeps its own frame
            assert _frames() == 1 and mm_dtype() is torch.bfloat16
            with mixprec.autocast("cpu", dtype=torch.float16, compute="native"):
                assert _frames() == 2 and mm_dtype() is torch.float16
            with torch.autocast("cpu", enabled=False):
                assert mm_dtype() is torch.float32
        assert _frames() == 0 and mm_dtype() is torch.bfloat16
    assert _torch_state() == (False, torch.bfloat16, True) and _frames() == 0
    assert _state.get().ident not in _state.holders


@pytest.mark.usefixtures("no_kernels")
def test_default_region_takes_a_frame_once_mixprec_has_kernels():
    region = mixprec.autocast("cpu", compute="native")
    with region:
        pass
    _kernels.register("AutocastCPU", "cpu", {torch.ops.aten.mm.default})
    with region:
        assert _frames() == 1 and _state.get().active["cpu"].policy is mixprec.policies.CPU
        assert mm_dtype() is torch.bfloat16
    assert _frames() == 0 and _state.get().ident not in _state.holders


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("region", ["mixprec", "native"])
def test_exception_in_a_frameless_region_restores_torch_state_as_native(region):
    def make():
        return mixprec.autocast("cpu", compute="native") if region == "mixprec" else torch.autocast("cpu")

    with make():
        pass  # the mixprec region's first entry
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        with pytest.raises(KeyError), make():
            torch.set_autocast_dtype("cpu", torch.bfloat16)
            torch.set_autocast_cache_enabled(False)
            raise KeyError("x")
        assert _torch_state() == (False, torch.float16, True)
    finally:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        torch.set_autocast_cache_enabled(True)


def test_same_arguments_give_the_same_region_and_subclasses_their_own():
    assert mixprec.autocast("cpu", dtype=torch.bfloat16) is mixprec.autocast("cpu", dtype=torch.bfloat16)
    assert mixprec.autocast("cpu") is not mixprec.autocast("cpu", dtype=torch.float16)
    assert mixprec.autocast("cpu", enabled=False) is not mixprec.autocast("cpu", enabled=False)
    assert mixprec.cpu.amp.autocast() is not mixprec.cpu.amp.autocast()
    assert isinstance(mixprec.cpu.amp.autocast(), mixprec.autocast)
    policy = mixprec.policies.CPU.with_ops(fp32=["mm"])
    assert mixprec.autocast("cpu", policy=policy) is mixprec.autocast("cpu", policy=policy)
    assert mixprec.autocast("cpu", policy=policy) is not mixprec.autocast("cpu")


def test_cache_enabled_none_is_torchs_flag_at_the_call():
    torch.set_autocast_cache_enabled(False)
    try:
        region = mixprec.autocast("cpu")
        assert region is not mixprec.autocast("cpu", cache_enabled=True)
    finally:
        torch.set_autocast_cache_enabled(True)
    with region:
        assert not torch.is_autocast_cache_enabled()
    with mixprec.autocast("cpu"):
        assert torch.is_autocast_cache_enabled()


@pytest.mark.usefixtures("no_kernels")
def test_one_region_shared_by_threads_at_once():
    region = mixprec.autocast("cpu", compute="native")
    with region:
        pass
    threads, iterations = 4, 300
    barrier = threading.Barrier(threads)
    failures: list[str] = []

    def work(index: int) -> None:
        try:
            for i in range(iterations):
                if i % 50 == 0:
                    barrier.wait()
                with region:
                    inside = _torch_state()
                    if index % 2:
                        with region, mixprec.autocast("cpu", dtype=torch.float16, compute="native"):
                            nested = mm_dtype()
                        if nested is not torch.float16:
                            failures.append(f"thread {index}: nested {nested}")
                    if inside != (True, torch.bfloat16, True) or mm_dtype() is not torch.bfloat16:
                        failures.append(f"thread {index}: inside {inside}")
                if _torch_state() != (False, torch.bfloat16, True) or _frames():
                    failures.append(f"thread {index}: after {_torch_state()}, {_frames()} frames")
        except Exception as error:
            failures.append(f"thread {index}: {error!r}")
            barrier.abort()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures, failures[:5]
    assert not region._unframed


@pytest.mark.usefixtures("no_kernels")
def test_a_module_policy_keeps_regions_opened_inside_it_framed():
    # No region around the module: its hook opens no level, but a region opened in its forward takes its policy.
    _kernels.ensure(_state.make_setting("cpu", mixprec.policies.CPU, False, frozenset()))  # tables checked already

    class Opens(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.dtype:
            with mixprec.autocast("cpu", compute="native"):
                return torch.mm(x, x).dtype

    module = Opens()
    assert mixprec.autocast("cpu", compute="native")._plain
    with mixprec.set_module_policy(module, mixprec.policies.CPU.with_ops(fp32="mm")):
        assert module(A) is torch.float32
    assert module(A) is torch.bfloat16
    assert _state.get().ident not in _state.holders


class _HalfCPU(mixprec.autocast):
    """A subclass with parameters of its own, as torch.cpu.amp.autocast subclasses torch.autocast."""

    def __init__(self, enabled=True):
        super().__init__("cpu", dtype=torch.float16, enabled=enabled)


class _KeywordOnly(mixprec.autocast):
    def __init__(self, *, dtype):
        super().__init__(device_type="cpu", dtype=dtype)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_subclass_with_its_own_parameters_works_as_torchs(compiled):
    x = torch.randn(4, 4)

    def run(x):
        with _HalfCPU():
            a = torch.mm(x, x)
        with _KeywordOnly(dtype=torch.float16):
            b = torch.mm(x, x)
        with _HalfCPU(enabled=False):
            c = torch.mm(x, x)
        return a, b, c

    out = torch.compile(run, fullgraph=True, backend="eager")(x) if compiled else run(x)
    with torch.autocast("cpu", dtype=torch.float16):
        native = torch.mm(x, x)
    assert [t.dtype for t in out] == [torch.float16, torch.float16, torch.float32]
    assert torch.equal(out[0], native) and torch.equal(out[1], native)
    assert _HalfCPU() is not _HalfCPU()
