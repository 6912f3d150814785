"""The supported torch range, release by release: what ``nox -s tests-X`` proves on each.

* the release check at import (older: ImportError; newer: one warning, and it keeps working);
* the default tables are the installed release's native Autocast kernels, with no MixprecWarning;
* the drift warning stays useful on a release newer than the range;
* the two compiled-code cases the range was broken on: a module compiled once and called under policy A, B,
  A, B gives A's and B's dtypes each time, and mixprec and torch.autocast regions nest in any order;
* ``_compat.tracing`` sees a trace from inside a dispatcher kernel on every release;
* every version-sensitive torch internal is reached through ``mixprec._compat`` only.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import mixprec
from mixprec import _compat, engine
from mixprec.engine import _tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
BF16, F32 = torch.bfloat16, torch.float32


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error::mixprec.MixprecWarning", "-c", code],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )


# ---------------------------------------------------------------- the range


def test_the_installed_release_is_in_the_tested_range():
    assert _compat.release_name() in _compat.TESTED
    assert torch.__version__.split("+")[0] == _compat.TESTED[_compat.release_name()]


@pytest.mark.parametrize("version", ["2.9.1", "2.4.0+cu121", "1.13.1"])
def test_an_older_torch_is_refused_at_import_naming_both_releases(version):
    with pytest.raises(ImportError) as raised:
        _compat.require_supported(version)
    text = str(raised.value)
    assert f"mixprec does not support torch {version}" in text
    assert f"torch {_compat.OLDEST} to {_compat.NEWEST}" in text and f"torch>={_compat.OLDEST}" in text


def test_an_older_torch_is_refused_by_import_mixprec_itself():
    done = _python("import torch; torch.__version__ = '2.9.1'; import mixprec")
    assert done.returncode == 1
    assert "ImportError: mixprec does not support torch 2.9.1" in done.stderr
    assert f"supports torch {_compat.OLDEST} to {_compat.NEWEST}" in done.stderr


def test_a_newer_torch_warns_once_and_keeps_working():
    code = (
        "import warnings, torch\n"
        "torch.__version__ = '2.99.0'\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    import mixprec, mixprec.policies\n"
        "    import importlib; importlib.import_module('mixprec')\n"
        "    with mixprec.autocast('cpu', compute='native'):\n"
        "        dtype = torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype\n"
        "print(dtype, [type(w.message).__name__ for w in seen])\n"
        "print(seen[0].message if seen else '')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    first, message = done.stdout.splitlines()[0], "\n".join(done.stdout.splitlines()[1:])
    dtype, kinds = first.split(" ", 1)
    assert dtype == "torch.bfloat16"
    # once; then the newest table applies, and where this torch's kernels differ from it the first region says so
    assert kinds.startswith("['UntestedTorchWarning'") and kinds.count("UntestedTorchWarning") == 1
    assert "mixprec has not been tested on torch 2.99.0" in message and _compat.NEWEST in message
    assert issubclass(_compat.UntestedTorchWarning, mixprec.MixprecWarning)


def test_a_newer_torch_uses_the_newest_tables():
    assert _compat.table_release() == _compat.release_name()
    newer = (int(_compat.NEWEST.split(".")[0]), int(_compat.NEWEST.split(".")[1]) + 1)
    original = _compat.RELEASE
    try:
        _compat.RELEASE = newer
        assert _compat.table_release() == _compat.NEWEST
    finally:
        _compat.RELEASE = original


def test_pyproject_and_readme_declare_the_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={_compat.OLDEST}"' in pyproject
    readme = (ROOT / "README.md").read_text()
    assert f"torch {_compat.OLDEST} to {_compat.NEWEST}" in readme
    assert "nox -s tests-" in readme


def test_the_noxfile_reads_the_same_range():
    source = (ROOT / "noxfile.py").read_text()
    assert "_compat.py" in source  # it parses TESTED out of _compat.py rather than keeping a copy
    assert re.search(r"TESTED\s*=\s*_tested\(\)", source)


# ---------------------------------------------------------------- tables per release


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_default_table_names_the_ops_this_release_autocasts(device_type):
    key = _tables.autocast_key(device_type)
    assert key is not None
    torch_ops, table = _tables.native_difference(device_type, key)
    assert torch_ops == table, (sorted(torch_ops - table), sorted(table - torch_ops))


def test_a_region_on_this_release_gives_no_mixprec_warning():
    done = _python(
        "import torch, mixprec\n"
        "from mixprec.engine import _tables\n"
        "with mixprec.autocast('cpu', compute='native'):\n"
        "    torch.mm(torch.randn(2, 2), torch.randn(2, 2))\n"
        "with mixprec.autocast('cpu', policy=mixprec.policies.CPU.with_ops(fp32=['mm'])):\n"
        "    torch.mm(torch.randn(2, 2), torch.randn(2, 2))\n"
        "_tables.check_native('cuda')\n"
        "print(mixprec.explain('mm').source)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"default table CPU (torch {_compat.release_name()})"


def test_the_ops_a_release_adds_behave_as_their_category_natively():
    # Each op a release's table adds is checked against torch's own kernel here, when that release runs.
    module = importlib.import_module("mixprec.policies.cpu")
    added = module.RELEASES[_compat.release_name()]
    spd = torch.randn(4, 4, dtype=torch.float64)
    spd = (spd @ spd.T + torch.eye(4, dtype=torch.float64)).float()
    for category, ops in added.items():
        if category == "removed":
            continue
        for name in ops:
            op = getattr(torch.ops.aten, name).default
            with torch.autocast("cpu"):
                low_in, high_in = op(spd.bfloat16()).dtype, op(spd).dtype
            expected = {"fp32": (F32, F32), "lower_precision_fp": (BF16, BF16)}[category]
            assert (low_in, high_in) == expected, name
            assert mixprec.policies.CPU.category(name) == category


def test_the_drift_warning_names_what_a_newer_release_changed(monkeypatch):
    key = _tables.autocast_key("cpu")
    real = _tables.native_registrations(key)
    monkeypatch.setattr(_tables, "native_registrations", lambda k: real | {"aten::frobnicate"} if k == key else real)
    monkeypatch.setattr(_tables, "_checked", set())
    with pytest.warns(mixprec.MixprecWarning) as seen:
        _tables.check_native("cpu")
    text = str(seen[0].message)
    assert "does not match this torch's autocast kernels" in text and "frobnicate" in text
    assert "newer than the releases mixprec is tested on" in text


def test_every_release_has_a_table_and_the_shown_one_is_the_newest():
    for name in mixprec.policies.NATIVE:
        module = importlib.import_module(f"mixprec.policies.{mixprec.policies.BUILTIN[name]}")
        assert set(module.RELEASES) == set(_compat.TESTED)
    with pytest.raises(ValueError, match=r"No CPU table for torch 2\.9"):
        mixprec.policies.lists("CPU", "2.9")


# ---------------------------------------------------------------- compiled code on this release


LIN = torch.nn.Linear(8, 8)
X = torch.randn(4, 8)
B_POLICY = mixprec.policies.CPU.with_ops(fp32=["linear"])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_module_compiled_once_follows_policy_a_then_b_then_a(backend):
    torch._dynamo.reset()
    module = torch.compile(torch.nn.Linear(8, 8), backend=backend)
    seen = []
    for policy in (mixprec.policies.CPU, B_POLICY, mixprec.policies.CPU, B_POLICY):
        with mixprec.autocast("cpu", policy=policy, compute="native"):
            seen.append(module(X).dtype)
    assert seen == [BF16, F32, BF16, F32]


def _torch(enabled=True):
    return torch.autocast("cpu", enabled=enabled)


def _mine(enabled=True):
    return mixprec.autocast("cpu", enabled=enabled, compute="native")


def _mine_b(enabled=True):
    return mixprec.autocast("cpu", enabled=enabled, policy=B_POLICY, compute="native")


NESTINGS = {
    "torch>mixprec": (_torch, _mine),
    "torch>mixprec-policy": (_torch, _mine_b),
    "mixprec>torch": (_mine, _torch),
    "mixprec-policy>torch": (_mine_b, _torch),
    "torch>mixprec-off": (_torch, lambda: _mine(False)),
    "mixprec-policy>torch-off": (_mine_b, lambda: _torch(False)),
    "torch-off>mixprec-policy": (lambda: _torch(False), _mine_b),
    "mixprec-policy>torch>mixprec": (_mine_b, _torch, _mine),
    "torch>mixprec-policy>torch": (_torch, _mine_b, _torch),
    "torch>torch": (_torch, _torch),
}


def _nested(regions, graph_break):
    def fn(x):
        def enter(i):
            if i == len(regions):
                if graph_break:
                    torch._dynamo.graph_break()
                return LIN(x) * 2
            with regions[i]():
                return enter(i + 1)

        return enter(0)

    return fn


@pytest.mark.parametrize("graph_break", [False, True], ids=["one-graph", "graph-break"])
@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_mixprec_and_torch_regions_nest_in_any_order_in_compiled_code(nesting, graph_break):
    fn = _nested(NESTINGS[nesting], graph_break)
    eager = fn(X)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=not graph_break)(X)
    assert compiled.dtype is eager.dtype
    assert torch.equal(compiled, eager)


# ---------------------------------------------------------------- the compatibility module


def test_tracing_is_seen_from_inside_a_dispatcher_kernel():
    engine.reset()  # mm has no kernel of mixprec's that earlier tests left
    seen = []
    library = torch.library.Library("aten", "IMPL")
    after = _compat.keyset_after(_compat.dispatch_key("AutocastCPU"))

    def kernel(keyset, *args, **kwargs):
        seen.append(_compat.tracing())
        return torch.ops.aten.mm.default.redispatch(keyset & after, *args, **kwargs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _compat.register_kernel(library, "mm", kernel, "AutocastCPU")

        def fn(a):
            with torch.autocast("cpu"):
                return torch.mm(a, a)

        torch._dynamo.reset()
        a = torch.randn(4, 4)
        torch.compile(fn, backend="aot_eager")(a)
        traced = list(seen)
        seen.clear()
        fn(a)
        assert traced and all(traced)  # torch 2.10 to 2.12: is_compiling() alone answers False here
        assert seen == [False]
    finally:
        _compat.destroy_library(library)
        engine.reset()
        torch._dynamo.reset()


#: Internals whose use differs between releases: only mixprec/_compat.py may name them.
_INTERNALS = (
    "torch._dynamo", "torch._inductor", "torch._guards", "torch.compiler.is_compiling(",
    "_dispatch_get_registrations_for_dispatch_key", "_dispatch_keyset_full_after", "_dispatch_key_for_device",
    "_ExcludeDispatchKeyGuard", "with_keyset=True", "._destroy()", "_top_saved_tensors_default_hooks",
    "_current_graph_task_id", "_dynamo_marked_constant", "CheckpointFunction", "add_lambda_guard",
    "_dispatch_has_kernel_for_dispatch_key", "_op_dk", "_jit_resolve_packet", "_current_autograd_node",
    "_get_fsdp_state", "_fsdp_param_group", "_unsharded_param",
)


def test_version_sensitive_internals_are_reached_through_compat_only():
    found = []
    for path in sorted((ROOT / "src" / "mixprec").rglob("*.py")):
        if path.name == "_compat.py":
            continue
        text = path.read_text()
        docstrings = {  # the lines of docstrings, which may name an internal to explain it
            line
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        }
        for number, line in enumerate(text.splitlines(), 1):
            if number in docstrings:
                continue
            code = line.split("#")[0]
            for name in _INTERNALS:
                if name in code:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not found, "use mixprec._compat for:\n" + "\n".join(found)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_extension_build_is_built_again_by_the_next_load(tmp_path, monkeypatch, raised):
    # torch records a build as made before running it: after a Ctrl-C mid-build, the next load in the process
    # built nothing and failed to import the library ("cannot open shared object file"), for good.
    from torch.utils import cpp_extension

    def interrupted(name, *args, **kwargs):
        cpp_extension.JIT_EXTENSION_VERSIONER.entries[name] = object()  # (as _jit_compile records it first)
        raise raised("stopped mid-build")

    monkeypatch.setattr(cpp_extension, "load", interrupted)
    with pytest.raises(raised):
        _compat.load_extension("mixprec_interrupted_test", "unused.cpp", tmp_path)
    assert "mixprec_interrupted_test" not in cpp_extension.JIT_EXTENSION_VERSIONER.entries


def test_batched_tells_both_vmaps_batched_tensors_from_plain_ones():
    """``_compat.batched``: torch.func's vmap, and the legacy one autograd.grad(is_grads_batched=True) runs
    backward under (mixprec's emulated linear leaves its slices there)."""
    seen = []

    def probe(t):
        seen.append(_compat.batched(t))
        return t * 2

    torch.func.vmap(probe)(torch.ones(3, 2))

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(_compat.batched(g))
            return g * 2

    x = torch.ones(2, requires_grad=True)
    torch.autograd.grad(Spy.apply(x), x, torch.ones(3, 2), is_grads_batched=True)
    assert seen == [True, True] and not _compat.batched(torch.ones(2))
