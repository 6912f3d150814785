"""The C++ kernels (``engine/_fastpath``): built on every supported release, taken where their conditions hold,
handing every other call to the Python kernel, and bit-equal to it (values, dtypes, gradients and casts).

``test_cpu_opinfo.py`` compares the kernels, C++ where they take the call, with native over torch's OpInfo
database; here the same calls run with the C++ kernels suspended (the Python kernels alone) and with them, and
each condition that sends a call to Python is checked to do so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.utils.cpp_extension
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import _compat, engine
from mixprec.engine import _cast, _fastpath, _kernels, _tables

KEY = "AutocastCPU"


@pytest.fixture(autouse=True)
def _every_native_op_as_a_kernel():
    engine.reset()
    _kernels.register(KEY, "cpu", frozenset(_tables.native("cpu")))
    yield
    engine.reset()


def _counted(fn):  # type: ignore[no-untyped-def]
    """``fn()``, and how many calls the C++ kernels took and handed to Python meanwhile (this thread)."""
    fast, slow = _fastpath.counts()
    out = fn()
    after = _fastpath.counts()
    return out, after[0] - fast, after[1] - slow


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_the_extension_builds_on_this_torch():
    if os.environ.get("MIXPREC_CPP") == "0":
        assert _fastpath.extension() is None and _fastpath.disabled_reason() == "MIXPREC_CPP=0"
    else:
        assert _fastpath.extension() is not None, _fastpath.disabled_reason()
        assert _fastpath.disabled_reason() is None


def test_registering_the_kernels_prints_no_override_warning():
    """torch warns (from C++, to stderr) when a kernel at a key is overridden; putting mixprec's kernels there is
    the point, so neither the Python registration nor the C++ kernel on top of it may show it to users."""
    code = (
        "import torch, mixprec\n"
        "from mixprec.engine import _fastpath\n"
        "with mixprec.autocast('cpu', policy=mixprec.policies.CPU.with_ops(fp32=['gelu'])):\n"
        "    torch.nn.functional.gelu(torch.randn(4))\n"
        "print(_fastpath.counts()[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"  # the C++ kernel took the call
    assert "previously registered kernel" not in done.stderr, done.stderr


#: A process loading the extension in a directory: it holds the load's OS lock and torch's ``lock`` file (as
#: torch's build does) for argv[2] seconds, then lets both go.
_LOADER = """
import pathlib, sys, time
from mixprec import _compat
directory = pathlib.Path(sys.argv[1])
with _compat._build_lock(directory) as alone:
    (directory / "lock").touch()
    print("holding", alone, flush=True)
    time.sleep(float(sys.argv[2]))
    (directory / "lock").unlink()
"""


def _loader(directory, seconds: float) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", _LOADER, str(directory), str(seconds)], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "holding True"
    return process


def _load(directory, monkeypatch) -> tuple[bool, float]:
    """``_compat.load_extension`` in ``directory`` with torch's load stubbed: whether torch's ``lock`` file was
    there when torch's load began (it would wait for as long as it stays), and how long that took to come."""
    seen: list[tuple[bool, float]] = []
    start = time.monotonic()
    stub = lambda name, sources, **kwargs: seen.append(((directory / "lock").exists(), time.monotonic() - start))  # noqa: E731
    monkeypatch.setattr(torch.utils.cpp_extension, "load", stub)
    _compat.load_extension("mixprec_fastpath_test", "x.cpp", directory)
    return seen[0]


def test_a_lock_left_by_a_killed_load_does_not_hold_up_the_next(tmp_path, monkeypatch):
    """torch waits with no time limit while its ``lock`` file is there, and a load killed midway (SIGKILL,
    SIGTERM, a closed terminal) leaves it; before, only a lock older than 10 minutes was removed, so a rerun
    within them hung."""
    loader = _loader(tmp_path, 60)
    loader.kill()
    loader.wait()
    assert (tmp_path / "lock").exists()
    lock_there, waited = _load(tmp_path, monkeypatch)
    assert not lock_there and waited < 5


def test_a_load_waits_while_another_process_loads_there(tmp_path, monkeypatch):
    loader = _loader(tmp_path, 1.5)
    lock_there, waited = _load(tmp_path, monkeypatch)
    loader.wait()
    assert not lock_there and waited > 1.0  # the other's lock was left alone until it had finished


def test_a_library_cut_short_is_built_again_before_anything_imports_it(tmp_path, monkeypatch):
    """A truncated cached library killed every later process on import (SIGBUS), or failed in each with 'file too
    short' and was never built again: a load seals the library it imported with its SHA-256, and a library whose
    seal is missing or wrong goes, with the build's other files, before torch's load."""
    name = "mixprec_fastpath_test"
    library = tmp_path / f"{name}.so"
    seen = []

    def build(name, sources, **kwargs):  # (torch's load, stubbed: it builds the library where none is)
        seen.append(library.exists())
        if not library.exists():
            library.write_bytes(b"\x7fELF whole library")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    library.write_bytes(b"\x7fELF cut")  # (made before seals, or cut short: no seal)
    (tmp_path / "fastpath.o").write_bytes(b"object")
    _compat.load_extension(name, "x.cpp", tmp_path)
    assert seen == [False] and not (tmp_path / "fastpath.o").exists()
    _compat.load_extension(name, "x.cpp", tmp_path)  # sealed: kept
    assert seen == [False, True]
    library.write_bytes(library.read_bytes()[:5])  # cut short after its seal
    _compat.load_extension(name, "x.cpp", tmp_path)
    assert seen == [False, True, False] and library.read_bytes() == b"\x7fELF whole library"


def test_a_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    """With no compiler, torch's build failed with ninja's last line ('build stopped: subcommand failed')."""
    monkeypatch.setenv("CXX", "/nowhere/c++")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: pytest.fail("no build without a compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler: '/nowhere/c\\+\\+'"):
        _compat.load_extension("mixprec_fastpath_test", "x.cpp", tmp_path)


def test_the_warning_of_a_failed_build_says_where_and_how_to_skip_it(tmp_path, monkeypatch, caplog):
    from mixprec.engine import _fastpath

    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_compat, "load_extension", lambda *a: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    monkeypatch.setattr(_fastpath, "_failure", [])
    with caplog.at_level("WARNING", logger=_fastpath._log.name):
        assert _fastpath._build() is None
    assert str(tmp_path) in caplog.text and "MIXPREC_CPP=0 skips the build" in caplog.text


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_mixprec_cpp_takes_the_usual_spellings_of_no(value, monkeypatch):
    from mixprec.engine import _fastpath

    monkeypatch.setenv("MIXPREC_CPP", value)
    assert _fastpath._not_wanted() and _fastpath._build() is None
    monkeypatch.setattr(_fastpath, "_loaded", [None])  # (as extension() leaves it when the build is not wanted)
    assert _fastpath.disabled_reason() == "MIXPREC_CPP=0"


pytestmark = pytest.mark.skipif(
    os.environ.get("MIXPREC_CPP", "1").strip().lower() in ("0", "false", "off", "no"),
    reason="MIXPREC_CPP=0: no C++ kernels",
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv1d(4, 8, 3, padding=1),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8),
        torch.nn.LogSoftmax(-1),
    )


def _step(region, model: torch.nn.Module, x: torch.Tensor):  # type: ignore[no-untyped-def]
    """Forward in ``region()``, backward outside it: (output, every parameter's gradient)."""
    model.zero_grad(set_to_none=True)
    with region():
        out = model(x)
        extra = torch.bmm(out[None], out.t()[None]).sum() + torch.addmm(out, out, torch.ones(8, 8)).sum()
    (out.float().sum() + extra.float().sum()).backward()
    return out.detach(), [p.grad for p in model.parameters()]


REGIONS = {
    "torch.autocast": lambda: torch.autocast("cpu"),
    "torch.autocast fp16": lambda: torch.autocast("cpu", dtype=torch.float16),
    "mixprec.autocast": lambda: mixprec.autocast("cpu", compute="native"),
    "mixprec policy": lambda: mixprec.autocast(
        "cpu", policy=mixprec.policies.CPU.with_ops(fp32=["addmm"], lower_precision_fp=["gelu"]), compute="native"
    ),
}


@pytest.mark.parametrize("region", list(REGIONS))
def test_a_training_step_equals_the_python_kernels_bit_for_bit(region):
    x = torch.randn(6, 4, 16)
    with _fastpath.suspended():
        (python, python_grads), fast, _ = _counted(lambda: _step(REGIONS[region], _model(), x))
    assert fast == 0
    (out, grads), fast, _ = _counted(lambda: _step(REGIONS[region], _model(), x))
    assert fast >= 5  # conv1d, the two linears, bmm, addmm (some cast, some fall through)
    _same(out, python)
    _same(grads, python_grads)


#: Regions whose weights' casts the fast path keeps: the ``linear`` of a region run as native goes through the
#: mirror of torch's cache, whatever region it is (``_cast``); ``mv``, which a policy moves to the region's dtype,
#: through the thread's own cache.
CACHING = {
    "mixprec.autocast": (REGIONS["mixprec.autocast"], "mirror"),
    "torch.autocast": (REGIONS["torch.autocast"], "mirror"),
    "mixprec policy mv": (
        lambda: mixprec.autocast("cpu", policy=mixprec.policies.CPU.with_ops(lower_precision_fp=["mv"]),
                                 compute="native"),
        "own",
    ),
}


def _cache(which: str) -> _cast.Cache:
    return _cast.thread_cache() if which == "own" else _cast._torch_cache  # (see _cast)


def _user(region: str, n: int):  # type: ignore[no-untyped-def]
    """``(call, its weights)``: a layer's call in ``region``, whose weights its cache keeps."""
    if CACHING[region][1] == "own":
        w, v = torch.nn.Parameter(torch.randn(n, n)), torch.randn(n)
        return (lambda: torch.mv(w, v)), [w]
    model, x = torch.nn.Linear(n, n), torch.randn(2, n)
    return (lambda: model(x)), [model.weight, model.bias]


@pytest.mark.parametrize("region", list(CACHING))
def test_the_fast_path_casts_weights_through_the_cache(region):
    make, which = CACHING[region]
    call, weights = _user(region, 8)
    with make():
        outs, fast, slow = _counted(lambda: [call() for _ in range(3)])
        entries = _cache(which).entries()
        assert len(_cache(which)) == len(weights)  # each weight once
        assert {id(entry[0]) for entry in entries} == {id(w) for w in weights}
    assert fast == 3 and slow == 0 and len(_cache(which)) == 0  # (the region's exit cleared it)
    assert all(out.dtype is torch.bfloat16 for out in outs)


@pytest.mark.parametrize(
    "condition",
    [
        "no_grad in a Function's forward",
        "checkpoint",
        "reentrant checkpoint",
        "dispatch mode",
        "backward",
        "install",
        "suspended",
    ],
)
def test_calls_the_fast_path_must_not_decide_go_to_python(condition):
    model = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    region = lambda: torch.autocast("cpu")  # noqa: E731
    if condition == "no_grad in a Function's forward":

        class Forward(torch.autograd.Function):  # (as the reentrant checkpoint runs its function)
            @staticmethod
            def forward(ctx, t):  # type: ignore[no-untyped-def]
                with torch.no_grad():
                    return model(t)

            @staticmethod
            def backward(ctx, g):  # type: ignore[no-untyped-def]
                return g

        run = lambda: Forward.apply(x)  # noqa: E731
    elif condition == "checkpoint":
        run = lambda: checkpoint(model, x, use_reentrant=False)  # noqa: E731
    elif condition == "reentrant checkpoint":
        run = lambda: checkpoint(model, x, use_reentrant=True)  # noqa: E731
    elif condition == "dispatch mode":

        class Through(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                return func(*args, **(kwargs or {}))

        def run():  # type: ignore[no-redef]
            with Through():
                return model(x)
    elif condition == "backward":

        def run():  # type: ignore[no-redef]
            y = torch.ones(4, 8, requires_grad=True)

            class MmInBackward(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t):  # type: ignore[no-untyped-def]
                    return t.clone()

                @staticmethod
                def backward(ctx, g):  # type: ignore[no-untyped-def]
                    return torch.mm(g, torch.eye(8))

            with torch.autocast("cpu"):
                MmInBackward.apply(y).sum().backward()
            return y.grad
    elif condition == "install":

        def run():  # type: ignore[no-redef]
            with mixprec.install(), torch.autocast("cpu"):
                return model(x)
    else:

        def run():  # type: ignore[no-redef]
            with _fastpath.suspended():
                return model(x)

    with region():
        out, fast, slow = _counted(run)
    assert fast == 0 and slow >= 1
    assert out.dtype in (torch.bfloat16, torch.float32)


def test_a_checkpoint_under_the_fast_path_equals_no_checkpoint():
    model = _model()
    x = torch.randn(6, 4, 16)
    with mixprec.autocast("cpu", policy=mixprec.policies.CPU.with_ops(fp32=["conv1d"]), compute="native"):
        plain = model(x)
    plain.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with mixprec.autocast("cpu", policy=mixprec.policies.CPU.with_ops(fp32=["conv1d"]), compute="native"):
        out = checkpoint(model, x, use_reentrant=False)
    out.float().sum().backward()
    _same(out, plain)
    _same([p.grad for p in model.parameters()], grads)


def test_each_thread_keeps_its_own_setting():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    policies = {
        "fp16": mixprec.policies.CPU,
        "fp32": mixprec.policies.CPU.with_ops(fp32=["mm"]),
    }
    results: dict[str, list[torch.dtype]] = {}
    barrier = threading.Barrier(2)

    def work(name: str) -> None:
        dtype = torch.float16 if name == "fp16" else torch.bfloat16
        with mixprec.autocast("cpu", dtype=dtype, policy=policies[name], compute="native"):
            barrier.wait()
            results[name] = [torch.mm(a, b).dtype for _ in range(200)]
            barrier.wait()

    threads = [threading.Thread(target=work, args=(name,)) for name in policies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results["fp16"]) == {torch.float16}
    assert set(results["fp32"]) == {torch.float32}
    with torch.autocast("cpu"):  # this thread: no setting, the native table
        out, fast, _ = _counted(lambda: torch.mm(a, b))
    assert out.dtype is torch.bfloat16 and fast == 1


def test_a_module_policy_reaches_the_fast_path():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    handle = mixprec.set_module_policy(model[1], mixprec.policies.CPU.with_ops(fp32=["linear"]))
    try:
        with mixprec.autocast("cpu", compute="native"):
            first = model[0](torch.randn(2, 4))
            second, fast, _ = _counted(lambda: model[1](first))
    finally:
        handle.remove()
    assert first.dtype is torch.bfloat16 and second.dtype is torch.float32 and fast == 1


def test_a_tensor_list_argument_is_cast_by_both_paths_alike():
    # aten::lstm.input takes its parameters as a Tensor[] (lower_precision_fp on CPU where listed).
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 5, 8)

    def run():  # type: ignore[no-untyped-def]
        lstm.zero_grad(set_to_none=True)
        with torch.autocast("cpu"):
            out, _ = lstm(x)
        out.float().sum().backward()
        return out.detach(), [p.grad for p in lstm.parameters()]

    try:
        with _fastpath.suspended():
            expected = run()
    except RuntimeError as error:  # (oneDNN capped at AVX2 has no bfloat16 LSTM primitive: both paths raise)
        with pytest.raises(type(error), match="LSTM"):
            run()
        return
    _same(run(), expected)


def test_a_banned_op_still_raises_through_the_python_kernel():
    policy = mixprec.policies.CPU.with_ops(banned=["mm"])
    with mixprec.autocast("cpu", policy=policy, compute="native"), pytest.raises(RuntimeError, match="mm"):
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))


def test_reset_takes_the_cpp_kernels_away():
    engine.reset()
    with torch.autocast("cpu"):
        _, fast, slow = _counted(lambda: torch.mm(torch.randn(2, 2), torch.randn(2, 2)))
    assert fast == 0 and slow == 0


@pytest.mark.parametrize("dtype", _fastpath.dtypes(), ids=str)
def test_eligibility_of_every_dtype_is_the_python_rule(dtype):
    # One op per source dtype, plain region: the C++ kernel casts exactly where _plan.eligible_tensor says.
    try:
        t = torch.ones(2, 2).to(dtype)
    except (RuntimeError, TypeError, NotImplementedError):  # nothing converts to it on CPU (bits, float4)
        t = torch.empty(2, 2, dtype=dtype)  # (the same bits for both paths)
    with torch.autocast("cpu"):
        try:
            with _fastpath.suspended():
                expected = torch.ops.aten.mm.default(t, t)
        except (RuntimeError, NotImplementedError) as error:
            with pytest.raises(type(error)):
                torch.ops.aten.mm.default(t, t)
            return
        out, fast, _ = _counted(lambda: torch.ops.aten.mm.default(t, t))
    assert fast == 1
    _same(out, expected)


@pytest.mark.parametrize("region", list(CACHING))
@pytest.mark.parametrize("first", ["python", "c++"])
def test_both_kinds_of_kernel_share_one_cast_cache(region, first):
    # The weights' casts live in the extension's caches (_cast.use_extension): the cast one kind of kernel kept
    # is the one the other finds, and _cast.cast_weight (the rule, in Python) finds it too.
    if _fastpath.extension() is None:
        pytest.skip(f"no C++ kernels: {_fastpath.disabled_reason()}")
    make, which = CACHING[region]
    call, weights = _user(region, 4)

    def kept():  # type: ignore[no-untyped-def]
        return {(id(weight), dtype, version): cast for weight, dtype, version, cast in _cache(which).entries()}

    def python_kernels():  # type: ignore[no-untyped-def]
        with _fastpath.suspended():
            return _counted(call)

    def cpp_kernels():  # type: ignore[no-untyped-def]
        return _counted(call)

    runs = [python_kernels, cpp_kernels] if first == "python" else [cpp_kernels, python_kernels]
    with make():
        out, fast, slow = runs[0]()
        assert (fast, slow) == ((0, 1) if first == "python" else (1, 0))
        casts = kept()
        assert len(casts) == len(weights) and all(cast.dtype is torch.bfloat16 for cast in casts.values())
        again, fast, slow = runs[1]()
        assert (fast, slow) == ((1, 0) if first == "python" else (0, 1))
        assert kept().keys() == casts.keys() and all(kept()[k] is cast for k, cast in casts.items())
        found = _cast.cast_weight(weights[0], torch.bfloat16, torch_rules=which == "mirror")
        assert any(found is cast for cast in casts.values())
        _same(again, out)
        assert again.grad_fn is not None
    assert len(_cache(which)) == 0


@pytest.mark.parametrize("region", list(REGIONS))
def test_no_grad_takes_the_fast_path_and_equals_the_python_kernels(region):
    # Under no_grad the mixprec cache is skipped and the mirror of torch's casts with grad on (_cast): a cast
    # made under no_grad and used again with grad must carry the same history on both paths.
    x = torch.randn(6, 4, 16)

    def run():  # type: ignore[no-untyped-def]
        model = _model()
        with REGIONS[region]():
            with torch.no_grad():
                first = model(x)
            out = model(x)
        out.float().sum().backward()
        return first, out.detach(), [p.grad for p in model.parameters()]

    with _fastpath.suspended():
        expected = run()
    got, fast, _ = _counted(run)
    assert fast >= 6
    _same(got, expected)


@pytest.mark.parametrize("region", list(REGIONS))
def test_inference_mode_takes_the_fast_path_and_equals_the_python_kernels(region):
    # Nothing made under inference_mode is recomputed by a checkpoint, and no weight's cast is kept there
    # (_cast.cache_for_call): the C++ kernels take the calls, with the Python kernels' results.
    x = torch.randn(6, 4, 16)

    def run():  # type: ignore[no-untyped-def]
        model = _model()
        with REGIONS[region](), torch.inference_mode():
            return model(x), model(x)

    with _fastpath.suspended():
        expected = run()
    got, fast, slow = _counted(run)
    assert fast >= 6 and slow == 0
    _same(got, expected)


def test_a_thread_that_held_a_setting_when_the_kernels_came_goes_to_python_until_told():
    # A thread whose setting was made while mixprec had no kernels (after a reset) must not be served by a
    # table from before, nor by the native one: its calls go to Python until it is told again.
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    policy = mixprec.policies.CPU.with_ops(fp32=["mm"])
    steps = [threading.Event() for _ in range(2)]
    results: dict[str, object] = {}

    def worker() -> None:
        with mixprec.autocast("cpu", policy=policy, compute="native"):  # told: mm in float32
            steps[0].set()
            steps[1].wait()  # (the main thread resets, then registers kernels again: a new epoch)
            out, fast, _ = _counted(lambda: torch.mm(a, b))
            results["in the region"] = (fast, out.dtype)
        with torch.autocast("cpu"):  # told on leaving the region: no setting, the native table
            out, fast, _ = _counted(lambda: torch.mm(a, b))
            results["after it"] = (fast, out.dtype)

    thread = threading.Thread(target=worker)
    thread.start()
    steps[0].wait()
    engine.reset()
    _kernels.register(KEY, "cpu", frozenset(_tables.native("cpu")))
    steps[1].set()
    thread.join()
    assert results == {"in the region": (0, torch.float32), "after it": (1, torch.bfloat16)}


def test_a_thread_with_no_mixprec_state_takes_the_native_table():
    # Threads that held no mixprec state when the kernels came have no setting (any they make is told): plain
    # torch.autocast there takes the C++ kernels with native's answer, whether the thread is new or left a
    # region untold (while there were no kernels) before the kernels came.
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    policy = mixprec.policies.CPU.with_ops(fp32=["mm"])
    steps = [threading.Event() for _ in range(4)]
    results: dict[str, object] = {}

    def plain(name: str) -> None:
        with torch.autocast("cpu"):
            out, fast, _ = _counted(lambda: torch.mm(a, b))
        results[name] = (fast, out.dtype)

    def worker() -> None:
        with mixprec.autocast("cpu", policy=policy, compute="native"):
            steps[0].set()
            steps[1].wait()  # (the main thread resets: no kernels, a new epoch)
        steps[2].set()  # left the region untold
        steps[3].wait()  # (the main thread registers kernels again)
        plain("left a region untold")

    thread = threading.Thread(target=worker)
    thread.start()
    steps[0].wait()
    engine.reset()
    steps[1].set()
    steps[2].wait()
    _kernels.register(KEY, "cpu", frozenset(_tables.native("cpu")))
    steps[3].set()
    thread.join()
    fresh = threading.Thread(target=plain, args=("a new thread",))
    fresh.start()
    fresh.join()
    native = (1, torch.bfloat16)
    assert results == {"left a region untold": native, "a new thread": native}


def test_a_table_made_while_another_thread_numbers_more_overloads(monkeypatch):
    """``table`` reads the numbered overloads once: another thread's registration numbering one more between its
    count and its reading (a race of two threads' first regions) raised IndexError as the setting was pushed."""

    class Growing(dict):
        def items(self):  # another thread numbers one more overload just now
            if torch.ops.aten.cosh.default not in self:
                self[torch.ops.aten.cosh.default] = len(self)
            return super().items()

    monkeypatch.setattr(_fastpath, "_numbers", Growing(_fastpath._numbers))
    made = _fastpath.table(_kernels.native_entries("cpu"))
    assert made is not None or _fastpath.extension() is None
