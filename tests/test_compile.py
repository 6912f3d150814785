"""mixprec.autocast under torch.compile: no graph break, eager dtypes, guarded state, and the limitations
that PyTorch's notes on autocast in TorchScript list, lifted.

Dynamo is where mixprec's rules run under torch.compile, so most cases compile with a
counting eager backend (fast); the inductor cases check the values end to end.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mixprec
from mixprec import _compat

torch.manual_seed(0)
LIN = torch.nn.Linear(8, 8)
X = torch.randn(4, 8)
BF16 = torch.bfloat16


def _dtypes(outputs):
    return [o.dtype for o in outputs]


def _compile(fn, backend="eager"):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _region_model(x):
    with mixprec.autocast("cpu"):
        y = LIN(x)
        return y, torch.softmax(y, -1), torch.nn.functional.layer_norm(y, (8,)), x + 1


def _plain_model(x):
    y = LIN(x)
    return y, torch.softmax(y, -1), torch.nn.functional.layer_norm(y, (8,))


@pytest.fixture(scope="module")
def inductor_region():
    torch._dynamo.reset()
    return torch.compile(_region_model, fullgraph=True)


@pytest.fixture(scope="module")
def inductor_plain():
    torch._dynamo.reset()
    return torch.compile(_plain_model, fullgraph=True)


def test_inductor_region_inside_gives_eager_dtypes_and_values(inductor_region):
    eager = _region_model(X)
    compiled = inductor_region(X)
    assert _dtypes(compiled) == _dtypes(eager)
    assert eager[0].dtype is BF16 and eager[-1].dtype is torch.float32
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)


def test_inductor_region_outside_then_float32_again(inductor_plain):
    with mixprec.autocast("cpu"):
        eager = _plain_model(X)
        inside = inductor_plain(X)
    assert _dtypes(inside) == _dtypes(eager)
    for c, e in zip(inside, eager, strict=True):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)
    assert _dtypes(inductor_plain(X)) == [torch.float32] * 3


def test_region_inside_compiles_to_one_graph():
    counter = CompileCounter()
    compiled = _compile(_region_model, counter)
    assert _dtypes(compiled(X)) == _dtypes(_region_model(X))
    compiled(X)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    ("region", "expected"),
    [
        (lambda: mixprec.autocast("cpu"), BF16),
        (lambda: mixprec.autocast("cpu", dtype=torch.float16), torch.float16),
        (lambda: mixprec.autocast("cpu", enabled=False), torch.float32),
        (lambda: mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA), torch.float16),
    ],
    ids=["bf16", "fp16", "disabled", "cuda-policy"],
)
def test_guards_follow_the_state_outside(region, expected):
    with region():  # registers the region's kernels: new kernels reset dynamo (see mixprec.engine._guard)
        pass
    counter = CompileCounter()
    compiled = _compile(lambda x: LIN(x), counter)
    assert compiled(X).dtype is torch.float32
    with region():
        assert compiled(X).dtype is expected
    assert compiled(X).dtype is torch.float32
    assert counter.frame_count <= 2


def test_guard_sees_a_disabled_subregion():
    compiled = _compile(lambda x: LIN(x), CompileCounter())
    with mixprec.autocast("cpu"):
        assert compiled(X).dtype is BF16
        with mixprec.autocast("cpu", enabled=False):
            assert compiled(X).dtype is torch.float32
        assert compiled(X).dtype is BF16


def test_guard_sees_the_policy():
    compiled = _compile(lambda x: torch.exp(x.half()), CompileCounter())
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
        assert compiled(X).dtype is torch.float32  # exp is fp32 on CUDA
    with mixprec.autocast("cpu", dtype=torch.float16):
        assert compiled(X).dtype is torch.float16  # and unlisted on CPU


def test_tables_and_twins_built_inside_the_trace():
    # Two policies no region has used yet, and a composite (F.hardtanh, whose gate sends it
    # to the mode) whose builtin only the first policy lists: all built during the trace.
    fresh = mixprec.Policy.from_lists("fresh", {"lower_precision_fp": ["linear"], "fp32": ["hardtanh"]})
    other = mixprec.Policy.from_lists("other", {"fp32": ["linear"]})

    def fn(x):
        with mixprec.autocast("cpu", policy=fresh):
            b = LIN(x)
            h = torch.nn.functional.hardtanh(b)
        with mixprec.autocast("cpu", policy=other):
            c = LIN(x.to(BF16))
        return b, h, c

    assert _dtypes(_compile(fn)(X)) == _dtypes(fn(X)) == [BF16, torch.float32, torch.float32]


# Seed 004: autocast decorators.
@mixprec.autocast("cpu")
def _decorated_helper(x):
    return LIN(x)


def test_decorated_helper_called_from_compiled_code():
    out = _compile(lambda x: (_decorated_helper(x), LIN(x)))(X)
    assert _dtypes(out) == [BF16, torch.float32]


def test_decorator_on_the_compiled_function():
    compiled = _compile(mixprec.autocast("cpu")(lambda x: LIN(x)))
    assert compiled(X).dtype is BF16
    assert LIN(X).dtype is torch.float32


# Seed 004: the enabled argument given by a runtime value.
@pytest.mark.parametrize(("use_amp", "expected"), [(True, BF16), (False, torch.float32)], ids=["on", "off"])
def test_enabled_from_a_runtime_value(use_amp, expected):
    def fn(x, use_amp):
        with mixprec.autocast("cpu", enabled=use_amp):
            return LIN(x)

    compiled = _compile(fn)
    assert compiled(X, use_amp).dtype is expected
    assert compiled(X, not use_amp).dtype is (torch.float32 if use_amp else BF16)


# Seed 004: uncommon usage patterns.
def test_instance_reused_and_bound_with_as():
    # A region torch's kernels serve is a torch.autocast under compile (mixprec.engine._compile): reused as torch's
    # is. One with a policy is mixprec's own, also re-entered through its ``as`` name.
    linear_fp32 = mixprec.policies.CPU.with_ops(fp32=["linear"])

    def fn(x):
        region = mixprec.autocast("cpu")
        with region:
            a = LIN(x)
        b = LIN(x)
        with region:
            c = LIN(x)
        policy = mixprec.autocast("cpu", policy=linear_fp32)
        with policy as again:
            d = torch.mm(x, x.T)
            with again:
                e = LIN(x), torch.mm(x, x.T)
            with region:
                f = LIN(x)
        return a, b, c, d, *e, f

    assert _dtypes(_compile(fn)(X)) == _dtypes(fn(X)) == [BF16, torch.float32, BF16, BF16, torch.float32, BF16, BF16]


def test_as_binding_of_a_region_torch_serves_is_torchs_under_compile():
    # Dynamo binds ``with torch.autocast(...) as a`` to None; so does a region that is torch's under compile.
    def native(x):
        with torch.autocast("cpu") as bound:
            return LIN(x), bound

    def mine(x):  # (native compute: "auto" emulates on a CPU without bf16 units, and the region is mixprec's)
        with mixprec.autocast("cpu", compute="native") as bound:
            return LIN(x), bound

    expected = _compile(native)(X)
    found = _compile(mine)(X)
    if _compat.returns_torch_autocast():
        assert (expected[0].dtype, expected[1]) == (found[0].dtype, found[1]) == (BF16, None)
    else:  # torch 2.10 and 2.11: dynamo cannot take a torch.autocast from __new__; the region stays mixprec's
        assert (expected[0].dtype, expected[1]) == (BF16, None)
        assert found[0].dtype is BF16 and isinstance(found[1], mixprec.autocast)


@pytest.mark.parametrize("compute", ["native", "emulated"])
def test_a_region_made_in_compiled_code_keeps_its_compute_when_entered_eagerly(compute):
    # A region that is mixprec's under compile (a policy of its own) can leave the frame: returned, then entered
    # in eager code, it computes as the same region made eagerly (the kernels' dtypes tell native from emulated).
    from test_emulate import _KernelDtypes

    policy = mixprec.policies.CPU.with_ops(fp32=["softmax"])

    def make(x):
        with mixprec.autocast("cpu", policy=policy, compute=compute) as bound:
            return LIN(x), bound

    out, region = _compile(make)(X)
    with _KernelDtypes() as seen, region:
        again = LIN(X)
    with _KernelDtypes() as expected, mixprec.autocast("cpu", policy=policy, compute=compute):
        eager = LIN(X)
    assert seen.seen == expected.seen == [("addmm", BF16 if compute == "native" else torch.float32)]
    assert out.dtype == again.dtype == eager.dtype == BF16
    assert torch.equal(again, eager) and repr(region) == repr(mixprec.autocast("cpu", policy=policy, compute=compute))
    # ... and, as a region made eagerly, it pickles and decorates
    assert repr(pickle.loads(pickle.dumps(region))) == repr(region)
    assert torch.equal(region(LIN)(X), eager)


# Seed 004: promote decided from the real dtypes.
def _graph_of(fn, *args):
    """The output and the ATen forward graph (where the Autocast-key kernels have made their casts)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=forward_compiler))(*args)
    return out, graphs[0]


_CAST_TARGETS = ("aten._to_copy.default", "prims.convert_element_type.default")


def _casts_in(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in _CAST_TARGETS]


def test_promote_cat_of_two_bf16_stays_bf16_without_casts():
    def fn(a, b):
        with mixprec.autocast("cpu"):
            return torch.cat([a, b])

    out, gm = _graph_of(fn, X.to(BF16), X.to(BF16))
    assert out.dtype is BF16
    assert _casts_in(gm) == []


def test_promote_to_float32_casts_only_the_narrow_input():
    def fn(a, b):
        with mixprec.autocast("cpu"):
            return torch.cat([a, b])

    out, gm = _graph_of(fn, X.to(BF16), X)
    assert out.dtype is torch.float32
    assert len(_casts_in(gm)) == 1


# Seed 004: fp32_append_dtype (norm under the CUDA policy).
def test_norm_under_cuda_policy_runs_in_float32():
    def fn(x):
        with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
            return torch.norm(x), x.norm(p=2)

    x = X.half()
    eager = fn(x)
    compiled = _compile(fn)(x)
    assert _dtypes(compiled) == _dtypes(eager) == [torch.float32, torch.float32]
    torch.testing.assert_close(compiled, eager)


def test_private_builtins_are_routed_with_the_region_outside_the_compiled_function():
    # torch._VF.norm and torch._C._nn.binary_cross_entropy reach the mode under dynamo only once the
    # policy's builtins are registered, which a trace does on its first lookup of the policy.
    cuda_fp16 = mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA)
    norm = _compile(lambda x: torch.norm(x))
    with cuda_fp16:
        assert norm(X.half()).dtype is torch.float32
    bce = _compile(lambda a, b: torch.nn.functional.binary_cross_entropy(a, b))
    with cuda_fp16, pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
        bce(torch.rand(4).half(), torch.rand(4).half())


# Seed 004: mixing tracing and compiled autocast.
def _disabled_helper(a, b):
    with mixprec.autocast("cpu", enabled=False):
        return torch.mm(a, b) * 2.0


def test_compiled_calling_traced_keeps_the_traced_disable():
    traced = torch.jit.trace(_disabled_helper, (X, X.T))

    def fn(a, b):
        with mixprec.autocast("cpu"):
            return traced(a, b), torch.mm(a, b)

    assert _dtypes(_compile(fn)(X, X.T)) == [torch.float32, BF16]


def test_compiled_calling_traced_keeps_the_traced_region():
    def helper(a, b):
        with mixprec.autocast("cpu"):
            return torch.mm(a, b)

    traced = torch.jit.trace(helper, (X, X.T))
    assert _compile(lambda a, b: traced(a, b))(X, X.T).dtype is BF16


def test_exported_code_calling_compiled_code_keeps_its_region():
    def export(region):
        inner = torch.compile(lambda a: LIN(a) + 1, fullgraph=True, backend="eager")

        class Outer(torch.nn.Module):
            def forward(self, x):
                with region("cpu"):
                    return inner(x)

        torch._dynamo.reset()
        try:
            return torch.export.export(Outer(), (X,))
        except AssertionError as error:  # torch 2.10's dynamo: "Guard failed on the same frame it was created"
            return type(error), str(error).split(".")[0]

    native, program = export(torch.autocast), export(mixprec.autocast)
    if isinstance(native, tuple):  # where torch.autocast cannot do it, a mixprec region fails the same way
        assert program == native
        return
    assert program.module()(X).dtype is BF16
    assert "torch.bfloat16" in program.graph_module.code


# Seed 004: disabling eager autocast from compiled code.
CONV = torch.nn.Conv2d(3, 4, 3)


def test_enabled_false_inside_compiled_code_really_disables():
    def fn(x, image):
        with mixprec.autocast("cpu", enabled=False):
            q = x.view(1, 4, 8)
            return LIN(x), CONV(image), torch.nn.functional.scaled_dot_product_attention(q, q, q)

    # inductor: its extern kernels (addmm with out=, convolution, SDPA) stay in float32 even
    # though the eager region's mode sees them at run time (README: "debug backends").
    compiled = _compile(fn, "inductor")
    image = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), mixprec.autocast("cpu"):
        assert _dtypes(compiled(X, image)) == [torch.float32] * 3
        assert LIN(X).dtype is BF16


# Seed 004: diagnostics name the user's source line.
def _bce(x, y):
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA):
        return torch.nn.functional.binary_cross_entropy(x, y)  # the user's line


def test_error_inside_compiled_region_names_the_user_line():
    x = torch.rand(4)
    line = _bce.__code__.co_firstlineno + 2
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits") as info:
        _compile(_bce)(x, x)
    assert f'{__file__}", line {line}' in str(info.value)


def test_encoder_layer_composites_are_autocast_in_the_trace():
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(2, 5, 16)

    def fn(x):
        with mixprec.autocast("cpu"):
            return layer(x)

    eager = fn(x)
    compiled = _compile(fn)(x)
    assert compiled.dtype is eager.dtype
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=3e-2)


def _bad_argument(x):
    with mixprec.autocast("cpu", enabled="yes"):  # the user's line
        return x + 1


def test_argument_error_inside_compiled_region_names_the_user_line():
    line = _bad_argument.__code__.co_firstlineno + 1
    with pytest.raises(RuntimeError, match="autocast argument 'enabled' has the wrong type") as info:
        _compile(_bad_argument)(X)
    assert f'{__file__}", line {line}' in str(info.value)


# set_module_policy, custom-op categories and emulated compute under torch.compile


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 8)

    def forward(self, x):
        a = self.first(x)
        return a, self.second(a)


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("setting", ["fp32", "policy"])
def test_module_policy_under_compile_gives_the_eager_dtypes(where, setting):
    torch.manual_seed(0)
    block = _Block()
    # "fp32": the module runs in float32; a policy that moves linear to fp32 does the same by its table.
    policy = "fp32" if setting == "fp32" else mixprec.policies.CPU.with_ops(fp32=["linear"])
    handle = mixprec.set_module_policy(block.second, policy)

    def inside(x):
        with mixprec.autocast("cpu"):
            return block(x)

    counter = CompileCounter()
    if where == "inside":
        eager, compiled = inside(X), _compile(inside, counter)(X)
    else:  # inductor: debug backends re-run the graph op by op under the eager region (docs/graph_modes.md)
        compiled_block = _compile(block, "inductor")
        with mixprec.autocast("cpu"):
            eager, compiled = block(X), compiled_block(X)
    assert _dtypes(eager) == [BF16, torch.float32]
    assert _dtypes(compiled) == _dtypes(eager)
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)
    assert counter.frame_count == (1 if where == "inside" else 0)  # one graph, no break (inductor: not counted)
    handle.remove()


def test_module_policy_removed_after_compiling_is_seen_by_the_guards():
    block = _Block()
    handle = mixprec.set_module_policy(block.second, "fp32")
    compiled = _compile(block, "inductor")
    with mixprec.autocast("cpu"):
        assert _dtypes(compiled(X)) == [BF16, torch.float32]
        handle.remove()
        assert _dtypes(compiled(X)) == [BF16, BF16]


@torch.library.custom_op("mixprec_test_compile::scaled", mutates_args=())
def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w * 0.5


@_scaled.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


@pytest.mark.parametrize(
    ("category", "expected"), [("lower_precision_fp", BF16), ("fp32", torch.float32)], ids=["lower", "fp32"]
)
@pytest.mark.parametrize("spelling", ["object", "packet", "name"])
def test_custom_op_category_under_compile(category, expected, spelling):
    op = {"object": _scaled, "packet": torch.ops.mixprec_test_compile.scaled, "name": "mixprec_test_compile::scaled"}
    policy = mixprec.policies.CPU.with_ops(**{category: [op[spelling]]})
    w = torch.randn(8, 8)
    given = X.to(BF16) if category == "fp32" else X  # fp32 must cast a bf16 input up

    def run(x):
        with mixprec.autocast("cpu", policy=policy):
            return _scaled(x, w)

    counter = CompileCounter()
    eager, compiled = run(given), _compile(run, counter)(given)
    assert eager.dtype is expected and compiled.dtype is expected
    assert torch.equal(compiled, eager)
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_emulated_compute_under_inductor(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)

    def run(x):
        with mixprec.autocast("cpu", dtype=dtype, compute="emulated"):
            return torch.relu(lin(x))

    x = torch.randn(16, 64)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = run(x_eager)
    compiled = _compile(run, "inductor")(x_compiled)
    assert eager.dtype is dtype and compiled.dtype is dtype
    # Both round the same float32 products once: equal up to float32 accumulation order.
    tolerance = {BF16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(compiled.float(), eager.float(), atol=tolerance, rtol=tolerance)
    eager.float().sum().backward()
    compiled.float().sum().backward()
    assert x_compiled.grad.dtype is torch.float32
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, atol=tolerance, rtol=tolerance)


def test_constant_marks_a_function_as_torch_compiler_does():
    from mixprec._compat import constant

    def ours():
        return 1

    def torchs():
        return 1

    constant(ours)
    torch.compiler.assume_constant_result(torchs)
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_import_and_eager_regions_do_not_import_dynamo():
    import subprocess
    import sys

    code = (
        "import sys, torch, mixprec\n"
        "x = torch.randn(4, 4)\n"
        "with mixprec.autocast('cpu'):\n"
        "    torch.mm(x, x); torch.nn.functional.binary_cross_entropy(torch.rand(4), torch.rand(4))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# A graph traced under one policy is never reused under another: the call recompiles.
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_function_follows_the_policy_of_the_region_around_it(backend):
    mm_fp32 = mixprec.policies.CPU.with_ops(fp32=["mm"])
    a = torch.randn(8, 8)
    compiled = _compile(lambda x: torch.mm(x, x), backend=backend)
    seen = []
    for policy in (mm_fp32, None, mm_fp32, mixprec.policies.CUDA, None):
        with mixprec.autocast("cpu", policy=policy, compute="native"):
            seen.append(compiled(a).dtype)
    assert seen == [torch.float32, BF16, torch.float32, BF16, BF16]
    with torch.autocast("cpu"):  # no mixprec setting: native, as traced under none
        assert compiled(a).dtype is BF16


def test_a_policy_made_inside_the_compiled_function_is_refused_clearly():
    # Dynamo hands mixprec an object built while tracing without its attributes; say what to do instead.
    def inside(x):
        with mixprec.autocast("cpu", policy=mixprec.policies.CPU.with_ops(fp32=["mm"])):
            return torch.mm(x, x.T)

    with pytest.raises(Exception, match=r"policy made inside the compiled function.*outside the compiled function"):
        _compile(inside)(X)


# The decorator's wrapper and AutocastModule's forward are mixprec frames that dynamo compiles as the root.
@pytest.mark.parametrize(
    "settings", [{}, {"policy": mixprec.policies.CPU.with_ops(fp32=["linear"])}, {"compute": "emulated"}],
    ids=["default", "policy", "emulated"],
)
@pytest.mark.parametrize("form", ["decorator", "AutocastModule"])
def test_decorated_function_and_autocast_module_compile_with_fullgraph(form, settings):
    if form == "decorator":
        fn = mixprec.autocast("cpu", **settings)(lambda x: LIN(x).relu())
    else:
        fn = mixprec.AutocastModule(torch.nn.Sequential(LIN, torch.nn.ReLU()), "cpu", **settings)
    counter = CompileCounter()
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=counter)(X)
    assert counter.frame_count == 1
    eager = fn(X)
    assert out.dtype is eager.dtype and torch.equal(out, eager)


def test_a_fresh_process_compiling_a_decorated_region_first_keeps_the_cpp_kernels():
    # The first region of the process is traced with fullgraph=True: the kernels it registers are built eagerly.
    import subprocess
    import sys

    code = (
        "import torch, mixprec\n"
        "from mixprec.engine import _fastpath\n"
        "lin, x = torch.nn.Linear(8, 8), torch.randn(4, 8)\n"
        "fn = mixprec.autocast('cpu', policy=mixprec.policies.CPU.with_ops(fp32=['linear']))(lambda x: lin(x))\n"
        "out = torch.compile(fn, fullgraph=True, backend='aot_eager')(x)\n"
        "print(out.dtype, torch.equal(out, fn(x)), _fastpath.disabled_reason())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = "torch.float32 True " + str(_compat_reason())
    assert out.stdout.strip() == expected, out.stderr


def _compat_reason():
    from mixprec.engine import _fastpath

    _fastpath.extension()
    return _fastpath.disabled_reason()  # None where this machine builds the C++ kernels (MIXPREC_CPP=0: that)


@pytest.mark.parametrize("where", ["region-policy", "module-policy"])
def test_a_compiled_region_leaves_the_thread_holding_nothing(where):
    # The graph's pushes marked the thread as holding mixprec state and its pops never unmarked it: every
    # default-policy region in every thread then skipped its fast entry until this thread closed an eager region.
    import threading

    from mixprec.engine import _state

    policy = mixprec.policies.CPU.with_ops(fp32=["linear"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def step(x):
        with mixprec.autocast("cpu", policy=policy if where == "region-policy" else None):
            return model(x)

    with mixprec.set_module_policy(model[0], policy) if where == "module-policy" else contextlib.nullcontext():
        compiled = _compile(step)
        assert compiled(X).dtype is torch.float32
    assert threading.get_ident() not in _state.holders


def test_inductor_keeps_emulated_computes_roundings():
    """Inductor folded ``x.to(float16).float()`` into ``x.float()``: an emulated float16 linear whose products
    overflow came out finite compiled (102400, where eager mixprec and native give inf, so the GradScaler never
    backed off), and a bfloat16 one gave float32's values."""
    import torch._inductor.config as config

    lin = torch.nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        lin.weight.fill_(40.0)
    x = torch.full((2, 64), 40.0)  # each product 64 * 1600 = 102400, past float16's largest

    def step(x, dtype):
        with mixprec.autocast("cpu", dtype=dtype, compute="emulated"):
            return lin(x).float(), (lin(x * 1.001) * 1.0).float()  # (the consumers cast up)

    assert not config.emulate_precision_casts  # (torch's default: the conftest puts it back after each test)
    if not _compat._inductor_emulates_casts():  # torch 2.10 to 2.12: inductor cannot keep them: a warning
        torch._dynamo.reset()
        _compat._warn_roundings_lost.cache_clear()  # (once a process)
        with pytest.warns(UserWarning, match="cannot keep emulated compute's roundings"):
            _compile(step, "inductor")(x, torch.float16)
        assert not config.emulate_precision_casts
        return
    for dtype in (torch.float16, BF16):
        torch._dynamo.reset()
        eager, compiled = step(x, dtype), _compile(step, "inductor")(x, dtype)
        assert all(torch.equal(c, e) for c, e in zip(compiled, eager, strict=True))
    assert eager[0].isfinite().all() and compiled[0].isfinite().all()  # (bf16's range)
    assert torch.compile(step, backend="inductor")(x, torch.float16)[0].isinf().all()
    assert config.emulate_precision_casts
