"""Shared fixtures (every test must leave autocast state as it found it), the torch-release matrix's options
and the results file ``docs/compatibility.md`` is generated from.

* ``--version-sensitive``: only the tests that touch torch internals which move between releases
  (``VERSION_SENSITIVE``), with a sample of the OpInfo comparison (``--opinfo-sample``). ``nox`` runs these on
  every supported release older than the newest.
* ``--not-newest``: this run is not the newest release's whole suite (``--version-sensitive`` implies it): the
  long tests in ``NEWEST_ONLY`` are left to that run.
* ``MIXPREC_COMPAT_RESULTS=<file>``: write this run's outcome per feature (``FEATURES``) there as JSON.
* ``MIXPREC_EXPECT_TORCH=<version>``: fail at once unless that torch is the one imported (a matrix venv that
  resolved another release must not pass for it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import sys
import time

import pytest
import torch

from mixprec import _autocast, _compat, engine
from mixprec.engine import _cast, _compute, _state
from mixprec.engine import _installation as _install

#: The test files each row of docs/compatibility.md stands on.
FEATURES: dict[str, tuple[str, ...]] = {
    "Default tables equal the release's Autocast kernels": ("test_compat.py",),
    "Eager autocast, bit for bit with native": ("test_conformance.py", "test_eligibility.py", "test_cache.py"),
    "OpInfo and ModuleInfo comparison with native": ("test_cpu_opinfo.py",),
    "Reference interpreter (differential)": ("test_differential.py",),
    "Policies as mixprec kernels at the Autocast keys": ("test_kernels.py", "test_install.py", "test_module.py"),
    "C++ kernels (built against the release)": ("test_fastpath.py",),
    "torch.compile (aot_eager, inductor)": ("test_compile.py", "test_compiled.py", "test_patterns.py"),
    "torch.export and FX": ("test_graph.py", "test_graph_differential.py"),
    "torch.autocast interplay, checkpointing": ("test_interop.py",),
    "Hugging Face Transformers, Lightning, Accelerate": ("test_frameworks.py", "test_models.py"),
    "GradScaler": (
        "test_scaler_parity.py", "test_scaler_rule.py", "test_scaler_state.py", "test_scaler_distributed.py",
    ),
    "fp8 (scaled GEMMs, recipes, DDP and FSDP2, frameworks)": (
        "test_fp8.py", "test_fp8_layers.py", "test_fp8_distributed.py", "test_fp8_training.py",
    ),
}

#: The tests that touch torch internals which move between releases: dynamo and inductor (compile, compiled,
#: patterns), export and FX (graph), Autocast-key kernels (kernels, install), torch.autocast interplay and
#: checkpoint recompute (interop, frameworks), the reference interpreter (differential), the release's own
#: tables (compat), a sample of the OpInfo comparison (cpu_opinfo), torch._scaled_mm (fp8), and fp8 under DDP,
#: FSDP2 (which keeps the version counters of the weights it gathers) and the frameworks (fp8_distributed,
#: fp8_training), and the C++ kernels, built against each release's headers (fastpath).
VERSION_SENSITIVE = (
    "test_compat.py", "test_compile.py", "test_compiled.py", "test_patterns.py", "test_graph.py",
    "test_graph_differential.py", "test_kernels.py", "test_install.py", "test_interop.py", "test_frameworks.py",
    "test_differential.py", "test_cpu_opinfo.py", "test_fp8.py", "test_fp8_distributed.py", "test_fp8_training.py",
    "test_fastpath.py",
)
#: The share of the property tests' examples a run on an older release draws (``tests/_share.py``).
OLDER_RELEASES_SHARE = 1 / 3
#: In the OpInfo sample: every op torch autocasts on CPU, and this share of the others (by a stable hash).
OPINFO_SAMPLE_ONE_IN = 12


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mixprec")
    group.addoption("--version-sensitive", action="store_true", help="only the tests of version-sensitive internals")
    group.addoption("--opinfo-sample", action="store_true", help="a sample of the OpInfo comparison")
    group.addoption("--not-newest", action="store_true", help="leave NEWEST_ONLY to the newest release's run")


def pytest_configure(config: pytest.Config) -> None:
    expected = os.environ.get("MIXPREC_EXPECT_TORCH")
    if expected and torch.__version__.split("+")[0] != expected:
        raise pytest.UsageError(f"this venv has torch {torch.__version__}, the matrix asked for {expected}")
    _split_the_cores()
    if config.getoption("--version-sensitive") or config.getoption("--not-newest"):
        import _share

        _share.SHARE = OLDER_RELEASES_SHARE


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """Under ``--version-sensitive`` the other test modules are not even imported (each process collected all
    of them, about 8 s a release, to deselect them)."""
    if config.getoption("--version-sensitive") and collection_path.is_file():
        name = collection_path.name
        if name.startswith("test_") and name.endswith(".py") and name not in VERSION_SENSITIVE:
            return True
    return None


def _split_the_cores() -> None:
    """An xdist worker takes its share of the cores for torch's intra-op threads, and so do the processes it
    starts. With every worker on torch's default (all cores) the workers' OpenMP threads wait on one another:
    the GradScaler parity runs took 45 s each on 2 cores with 2 workers instead of 4.7 s alone (measured)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def _sampled(item: pytest.Item) -> bool:
    """Whether an OpInfo test is in the sample (any other test is)."""
    callspec = getattr(item, "callspec", None)
    key = callspec.params.get("key") if callspec is not None else None
    if item.path.name != "test_cpu_opinfo.py" or key is None:
        return True
    from mixprec.engine import _tables

    autocast = {_tables.qualified(op).split("::")[1].split(".")[0] for op in _tables.native("cpu")}
    if key.split(".")[0].replace("nn.functional.", "") in autocast or key in autocast:
        return True
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % OPINFO_SAMPLE_ONE_IN == 0


#: The longest tests (half a minute to two minutes each on 2 cores), run first: a worker that meets one at the
#: end of the run would keep the other waiting (with ``-n``, xdist hands tests out in collection order). Not the
#: soak: right after a test that builds models its RSS window grew past its bound (0.71 MiB) under AVX2.
LONGEST = (
    "test_fp8_training.py::test_gpt2_trained_150_steps",
    "test_compiled.py::test_compiled_programs_give_the_eager_results", "test_differential.py::test_random_programs",
    "test_policy_serial.py::test_edit_sequences", "test_explain.py::test_eager_fx_and_explain_agree",
    "test_scaler_parity.py::test_fused_adam", "test_scaler_parity.py::test_sparse_gradients",
)


#: Long tests whose subject does not move between torch releases, run by the newest release's whole suite only
#: (``--not-newest`` leaves them out: CI's time limit).
NEWEST_ONLY = (
    # 150 training steps (80 s): the fp8 numerics it rests on are test_fp8.py's, which runs on every release.
    "test_fp8_training.py::test_gpt2_trained_150_steps",
    "test_soak.py::test_soak_leaves",  # mixprec's own state and registrations over thousands of regions
    "test_policy_serial.py::test_edit_sequences",  # policy data and its TOML round trip: no torch internals
)


def _name(item: pytest.Item) -> str:
    return f"{item.path.name}::{item.name}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sensitive = config.getoption("--version-sensitive")
    sample = sensitive or config.getoption("--opinfo-sample")
    elsewhere = NEWEST_ONLY if sensitive or config.getoption("--not-newest") else ()
    keep, drop = [], []
    for item in items:
        wanted = (not sensitive or item.path.name in VERSION_SENSITIVE) and (not sample or _sampled(item))
        wanted = wanted and not _name(item).startswith(elsewhere)
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    first = [item for item in keep if _name(item).startswith(LONGEST)]
    chosen = {id(item) for item in first}
    items[:] = first + [item for item in keep if id(item) not in chosen]


_outcomes: dict[str, dict[str, int]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        name = pathlib.Path(report.nodeid.split("::")[0]).name
        counts = _outcomes.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        counts[report.outcome] = counts.get(report.outcome, 0) + 1


def _facts() -> dict[str, str]:
    """How mixprec meets this release: what ``mixprec._compat`` decided, and the release's default tables."""
    import importlib

    from mixprec import policies

    def table(name: str) -> str:
        change = importlib.import_module(f"mixprec.policies.{policies.BUILTIN[name]}").RELEASES[_compat.release_name()]
        parts = [f"+{c} " + ", ".join(ops) for c, ops in change.items() if c != "removed"]
        parts += ["-" + ", ".join(change["removed"])] if change.get("removed") else []
        return "; ".join(parts) or "as 2.13"

    return {
        "CPU table vs 2.13": table("CPU"),
        "CUDA table vs 2.13": table("CUDA"),
        "A default-policy region in compiled code": "torch.autocast" if _compat.returns_torch_autocast()
        else "mixprec's region object",
        "Policies reach constant functions": "as objects" if _compat.CONSTANT_TAKES_OBJECTS else "by id",
        "Trace seen from kernels by": "is_compiling()" if _compat.at_least(2, 13)
        else "is_compiling() or the tracing context",
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("MIXPREC_COMPAT_RESULTS")
    if not target or getattr(session.config, "workerinput", None) is not None:
        return
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    config = session.config
    features = {}
    for feature, files in FEATURES.items():
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for name in files:
            for outcome, n in _outcomes.get(name, {}).items():
                counts[outcome] = counts.get(outcome, 0) + n
        features[feature] = counts
    result = {
        "release": _compat.release_name(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "run": "version-sensitive" if config.getoption("--version-sensitive")
        else "whole suite, less NEWEST_ONLY" if config.getoption("--not-newest") else "whole suite",
        "opinfo_sample": bool(config.getoption("--version-sensitive") or config.getoption("--opinfo-sample")),
        "exitstatus": int(exitstatus),
        "when": time.strftime("%Y-%m-%d", time.gmtime()),
        "features": features,
        "files": _outcomes,
        "facts": _facts(),
    }
    pathlib.Path(target).write_text(json.dumps(result, indent=1) + "\n")  # features in FEATURES order


@pytest.fixture(autouse=True)
def _inductor_roundings():
    """Put back inductor's ``emulate_precision_casts``, which tracing emulated compute turns on for the process
    (``_compat.keep_roundings``): each test compiles under torch's default."""
    config = sys.modules.get("torch._inductor.config")
    before = getattr(config, "emulate_precision_casts", None)
    yield
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.emulate_precision_casts = bool(before)


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
    mirror = _cast._torch_cache.entries()
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
        engine.reset()  # regions decided their compute on the real flags

    yield set_flags
    engine.reset()
