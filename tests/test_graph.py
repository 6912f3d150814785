"""Graph modes: torch.jit.trace + freeze, torch.export, and mixprec.graph.apply_policy."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import mixprec
from _counting import CountCasts
from mixprec import engine
from mixprec.graph import apply_policy, cast_nodes
from mixprec.graph._casts import cast_source, is_cast

BF16 = torch.bfloat16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
        self.l2, self.l3 = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.ln(self.l1(x))
        return self.l2(h) + self.l3(h), torch.softmax(self.l2(x), -1), torch.cat([self.l3(x), self.l3(x)])


class MixprecNet(Net):
    def forward(self, x):
        with mixprec.autocast("cpu"):
            return super().forward(x)


class NativeNet(Net):
    def forward(self, x):
        with torch.autocast("cpu"):
            return super().forward(x)


torch.manual_seed(0)
NET = Net().eval()
X = torch.randn(4, 8)


def _like(cls):
    net = cls().eval()
    net.load_state_dict(NET.state_dict())
    return net


@pytest.fixture(scope="module")
def exported():
    return torch.export.export(NET, (X,)).module()


@pytest.fixture(scope="module")
def rewritten(exported):
    return apply_policy(exported, mixprec.policies.CPU, BF16)


@pytest.fixture(scope="module")
def native():
    return torch.export.export(_like(NativeNet), (X,)).run_decompositions({}).module()


def _eager():
    with mixprec.autocast("cpu"):
        return NET(X)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_trace_and_freeze_record_the_casts(grad):
    # As torch's own docs ask of torch.autocast: the cast cache off while tracing, or a cached copy reaches
    # the tracer as a constant that requires grad. Native compute: the trace records torch's casts (an
    # emulated op is a Python autograd Function, which the tracer records differently on each run).
    with torch.set_grad_enabled(grad), mixprec.autocast("cpu", cache_enabled=False, compute="native"):
        traced = torch.jit.trace(NET, X)
        eager = NET(X)
    frozen = torch.jit.freeze(traced)
    assert "BFloat16" in str(frozen.graph)
    with torch.no_grad():
        for f, e in zip(frozen(X), eager, strict=True):
            assert f.dtype is e.dtype and torch.equal(f, e)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_trace_with_the_cache_on_fails_as_native_does(grad):
    # The region is torch's autocast state, cache flag included: tracing under it behaves as under torch.autocast
    # (with torch's own kernels: mixprec's that earlier tests registered keep their own cache).
    engine.reset()
    outcomes = []
    for region in (torch.autocast("cpu"), mixprec.autocast("cpu", compute="native")):
        with torch.set_grad_enabled(grad), region:
            assert torch.is_autocast_cache_enabled()
            try:
                torch.jit.trace(NET, X)
                outcomes.append("traced")
            except Exception as error:  # a RuntimeError; torch 2.10's sanity check raises TracingCheckError
                outcomes.append(f"{type(error).__name__}: {str(error).splitlines()[0].split('.')[0]}")
    assert outcomes[0] == outcomes[1]


class _AddsNumbers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 1, x * 2.5 + 1


@pytest.mark.parametrize("region", ["policy", "emulated", "install"])
def test_a_traced_graph_with_python_numbers_runs_in_a_region_of_mixprecs_own_kernels(region):
    # The tracer records ``+ 1`` as a wrapped number, which TorchScript's autocast pass feeds to a cast op; torch
    # unboxes it to an int on the way to mixprec's kernel there, which returned the int ("Unable to cast 1 to
    # Tensor") where torch's returns the number's tensor.
    torch.manual_seed(0)
    module, x = _AddsNumbers(), torch.randn(4, 8)
    traced = torch.jit.trace(module, x)
    regions = {
        "policy": lambda: mixprec.autocast("cpu", policy=mixprec.policies.CPU.with_ops(fp32=["linear"])),
        "emulated": lambda: mixprec.autocast("cpu", compute="emulated"),
        "install": lambda: contextlib.ExitStack(),
    }
    with contextlib.ExitStack() as stack:
        if region == "install":
            stack.enter_context(mixprec.install(mixprec.policies.CPU.with_ops(fp32=["linear"])))
            stack.enter_context(torch.autocast("cpu"))
        stack.enter_context(regions[region]())
        eager = module(x)
        for _ in range(3):  # (TorchScript's profiling executor optimises the graph on later runs)
            for t, e in zip(traced(x), eager, strict=True):
                assert t.dtype is e.dtype and torch.equal(t, e)


def test_export_of_a_mixprec_forward_gives_the_eager_outputs():
    net = _like(MixprecNet)
    program = torch.export.export(net, (X,), strict=False)
    for p, e in zip(program.module()(X), net(X), strict=True):
        assert p.dtype is e.dtype is BF16 and torch.equal(p, e)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_records_the_region_as_torch_autocast(strict):
    net = _like(MixprecNet)
    program = torch.export.export(net, (X,), strict=strict)
    hops = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.wrap_with_autocast]
    assert len(hops) == 1 and hops[0].args[:3] == ("cpu", BF16, True)
    native = torch.export.export(_like(NativeNet), (X,), strict=strict)
    for p, e, n in zip(program.module()(X), net(X), native.module()(X), strict=True):
        assert p.dtype is e.dtype is n.dtype is BF16 and torch.equal(p, e) and torch.equal(p, n)


LINEAR_FP32 = mixprec.policies.CPU.with_ops(fp32=["linear"])


class EditedNet(Net):
    def forward(self, x):
        with mixprec.autocast("cpu", policy=LINEAR_FP32):
            return super().forward(x)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_of_a_region_whose_policy_it_would_drop_is_refused(strict):
    # The exported program keeps torch's autocast state only: it would cast linear to bfloat16.
    with pytest.raises(Exception, match=r"cannot be exported.*native categories.*mixprec.graph.apply_policy"):
        torch.export.export(_like(EditedNet), (X,), strict=strict)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_of_a_region_with_a_module_policy_it_would_drop_is_refused(strict):
    # Strict export traced the module policy's level through dynamo, which wrote nothing of it into the program:
    # the program ran that linear in bfloat16 where eager runs it in float32, silently.
    net = _like(MixprecNet)
    submodule = next(m for m in net.modules() if isinstance(m, torch.nn.Linear))
    with mixprec.set_module_policy(submodule, LINEAR_FP32), pytest.raises(
        Exception, match=r"cannot be exported.*native categories.*mixprec.graph.apply_policy"
    ):
        torch.export.export(net, (X,), strict=strict)


def test_apply_policy_gives_the_eager_and_native_outputs(rewritten, native):
    for r, e, n in zip(rewritten(X), _eager(), native(X), strict=True):
        assert r.dtype is e.dtype is n.dtype
        assert torch.equal(r, e) and torch.equal(r, n)


def test_apply_policy_does_not_mutate_its_input():
    gm = torch.export.export(NET, (X,)).module()
    code, nodes = gm.code, len(gm.graph.nodes)
    apply_policy(gm, mixprec.policies.CPU, BF16)
    assert gm.code == code and len(gm.graph.nodes) == nodes
    assert all(o.dtype is torch.float32 for o in gm(X))


def test_fewer_casts_than_native(rewritten, native):
    assert 0 < cast_nodes(rewritten) < cast_nodes(native)


def test_no_cast_chains(rewritten):
    casts = [n for n in rewritten.graph.nodes if cast_source(n) is not None]
    assert all(cast_source(cast_source(n)) is None for n in casts)


def test_a_weight_is_cast_once_and_any_other_tensor_at_each_use_as_eager_casts(rewritten):
    # Eager autocast keeps a weight's cast for reuse and casts anything else afresh at each use: x feeds four
    # linears, l2's weights two and l3's three (h, the layer norm's output, is bf16 already).
    sources = Counter(str(cast_source(n).target) for n in rewritten.graph.nodes if cast_source(n) is not None)
    assert sources == {"x": 4, **{f"{layer}.{p}": 1 for layer in ("l1", "l2", "l3") for p in ("weight", "bias")}}
    with CountCasts() as eager, mixprec.autocast("cpu", compute="native"):  # (the graph pass: native compute)
        NET(X)
    assert cast_nodes(rewritten) == eager.casts


class _RoundTrip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x.float())  # x is bf16: the .float() copy would be cast straight back


def test_no_cast_back_pairs():
    model = _RoundTrip()
    x = X.to(BF16)
    low = apply_policy(torch.export.export(model, (x,)).module(), mixprec.policies.CPU, BF16)
    placeholder = next(n for n in low.graph.nodes if n.op == "placeholder" and n.name == "x")
    linear = next(n for n in low.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert linear.args[0] is placeholder
    with mixprec.autocast("cpu"):
        assert torch.equal(low(x), model(x))


def test_promote_of_two_bf16_inputs_adds_no_cast():
    def cat(a, b):
        return torch.cat([a, b])

    a = X.to(BF16)
    from torch.fx.experimental.proxy_tensor import make_fx

    low = apply_policy(make_fx(cat, pre_dispatch=True)(a, a), mixprec.policies.CPU, BF16)
    assert cast_nodes(low) == 0 and low(a, a).dtype is BF16


def test_fp32_append_dtype_norm_under_cuda_policy():
    class Norm(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.norm.Scalar(x, 2)

    x = X.half()
    low = apply_policy(torch.export.export(Norm(), (x,)).module(), mixprec.policies.CUDA, torch.float16)
    assert any(n.target is torch.ops.aten.norm.ScalarOpt_dtype for n in low.graph.nodes)
    out = low(x)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, torch.linalg.vector_norm(x.float()))


def test_banned_op_names_the_users_line():
    class Bce(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.binary_cross_entropy(x, x)  # the user's line

    x = torch.rand(4)
    gm = torch.export.export(Bce(), (x,)).module()
    with pytest.raises(RuntimeError, match=r"binary_cross_entropy_with_logits.*test_graph.py.*line"):
        apply_policy(gm, mixprec.policies.CUDA, torch.float16)


@pytest.mark.parametrize(
    ("args", "name"),
    [((NET, "policy"), "gm"), (("exported", "p", BF16), "policy"), (("exported", None, "bf16"), "dtype")],
    ids=["gm", "policy", "dtype"],
)
def test_apply_policy_checks_types(args, name, exported):
    gm, policy, *rest = args
    gm = exported if gm == "exported" else gm
    policy = mixprec.policies.CPU if policy in (None, "policy") else policy
    dtype = rest[0] if rest else BF16
    with pytest.raises(TypeError, match=f"apply_policy argument '{name}'"):
        apply_policy(gm, policy, dtype)


class Nested(torch.nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        with self.region("cpu"):
            y = self.linear(x)
            with self.region("cpu", enabled=False):
                z = self.linear(y.float())
            w = self.linear(z)
        return y, z, w


def _export_outcome(region, strict):
    torch.manual_seed(0)
    net = Nested(region)
    try:
        return torch.export.export(net, (X,), strict=strict).module()(X), net(X)
    except Exception as error:
        return type(error), str(error).split("\n")[0]


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_of_nested_regions_gives_what_it_gives_for_torch_autocast(strict):
    # Non-strict export gives native's program; strict export of this nesting fails in torch 2.13 for
    # torch.autocast itself (a dtype assertion in the program), and fails the same way for mixprec.
    ours, theirs = _export_outcome(mixprec.autocast, strict), _export_outcome(torch.autocast, strict)
    if isinstance(theirs[0], type):
        assert ours == theirs
        return
    (program, eager), (native, _) = ours, theirs
    assert [t.dtype for t in program] == [BF16, torch.float32, BF16]
    for p, e, n in zip(program, eager, native, strict=True):
        assert p.dtype is e.dtype is n.dtype and torch.equal(p, e) and torch.equal(p, n)


def _native(fn, *args):
    with torch.autocast("cpu", dtype=BF16):
        return fn(*args)


def _assert_bitwise(got, expected):
    got, expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype is e.dtype and torch.equal(g, e)


def _mutate_a_view_of_the_weight(x, w):
    a = torch.mm(x, w)
    w[0].zero_()  # select + zero_: w changes through a view
    return a, torch.mm(x, w)


def _mutate_the_base_of_a_view(x, w):
    v = w.t()
    a = torch.mm(x, v)
    w.relu_()  # v changes with its base
    return a, torch.mm(x, v)


def _mutate_the_source_of_a_widened_copy(x, w):
    y = x.float()  # x is bf16: a cast of y is a cast of x, until x changes
    x.mul_(3)
    return torch.mm(y, w), torch.mm(x.float(), w)


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [
        (_mutate_a_view_of_the_weight, torch.float32),
        (_mutate_the_base_of_a_view, torch.float32),
        (_mutate_the_source_of_a_widened_copy, BF16),
    ],
    ids=["view-of-weight", "base-of-view", "source-of-widened-copy"],
)
def test_a_cast_made_before_an_in_place_op_is_not_reused_after_it(fn, dtype):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(4, 8).to(dtype), torch.randn(8, 8)
    low = apply_policy(make_fx(fn)(x.clone(), w.clone()), mixprec.policies.CPU, BF16)
    _assert_bitwise(low(x.clone(), w.clone()), _native(fn, x.clone(), w.clone()))


class _MutatesItsInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, w):
        a = self.linear(x) @ w
        x[:, 0] = 0.0  # select + fill_ in the exported graph; later uses read x's node again
        w.relu_()
        return a, self.linear(x) @ w


def test_an_exported_graph_that_mutates_its_inputs_gives_the_native_outputs():
    model, x, w = _MutatesItsInputs(), torch.randn(4, 8), torch.randn(8, 8)
    low = apply_policy(torch.export.export(model, (x.clone(), w.clone())).module(), mixprec.policies.CPU, BF16)
    _assert_bitwise(low(x.clone(), w.clone()), _native(model, x.clone(), w.clone()))


class _MixedEinsum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, h):
        # einsum has no category: eager autocast runs its CompositeImplicitAutograd kernel and casts the bmm it
        # calls, on one bf16 input (the linear's) and one f32 one. argwhere's size depends on the data.
        return torch.einsum("ij,jk->ik", self.linear(x), h), torch.argwhere(x > 0)


def test_a_composite_with_inputs_of_mixed_dtypes_is_decomposed_as_eager_autocast_runs_it():
    model, x, h = _MixedEinsum(), torch.randn(8, 8), torch.randn(8, 8)
    low = apply_policy(torch.export.export(model, (x, h)).module(), mixprec.policies.CPU, BF16)
    expected = _native(model, x, h)
    assert [t.dtype for t in expected] == [BF16, torch.int64]
    _assert_bitwise(low(x, h), expected)


class _Einsums(torch.nn.Module):
    def forward(self, a, b):
        # The same op on the same dtypes: the first reaches no op with a category, the second reaches bmm.
        return torch.einsum("ij,ij->ij", a, b), torch.einsum("ij,jk->ik", a, b)


def test_a_composite_call_that_stays_whole_does_not_keep_a_different_call_whole():
    model, a, b = _Einsums(), torch.randn(4, 4), torch.randn(4, 4)
    low = apply_policy(torch.export.export(model, (a, b)).module(), mixprec.policies.CPU, BF16)
    expected = _native(model, a, b)
    assert [t.dtype for t in expected] == [torch.float32, BF16]
    _assert_bitwise(low(a, b), expected)


class _Tensordot(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, h):
        return torch.tensordot(self.linear(x), h, dims=1)  # its kernel refuses a bf16 and an f32 input


def test_a_composite_whose_decomposition_fails_is_refused_not_left_whole():
    model, x, h = _Tensordot(), torch.randn(4, 8), torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="same dtype"):
        _native(model, x, h)
    gm = torch.export.export(model, (x, h)).module()
    with pytest.raises(RuntimeError, match=r"apply_policy cannot rewrite aten.tensordot.*same dtype.*test_graph.py"):
        apply_policy(gm, mixprec.policies.CPU, BF16)


class _Widens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)  # bf16 after the rewrite; export checks the float32 it had before each .float()
        return self.linear(y.float()), y.float() + 1, y.to(torch.float32)


def test_export_dtype_checks_follow_the_rewritten_dtypes():
    model, x = _Widens(), torch.randn(4, 8)
    gm = torch.export.export(model, (x,)).module()
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in gm.graph.nodes)
    low = apply_policy(gm, mixprec.policies.CPU, BF16)
    _assert_bitwise(low(x), _native(model, x))


class _Subgraphs(torch.nn.Module):
    """A linear inside each higher-order op export writes: the op calls a subgraph, which the rewrite must reach."""

    def __init__(self, kind):
        super().__init__()
        self.linear, self.inner, self.kind = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), kind

    def forward(self, x):
        return getattr(self, self.kind)(x)

    def cond(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.linear(t), lambda t: self.linear(-t), (x,))

    def nested_cond(self, x):
        def inner(t):
            return torch.cond(t.mean() > 1, lambda u: self.linear(u), lambda u: self.linear(u * 2), (t,))

        return torch.cond(x.sum() > 0, inner, lambda t: self.linear(-t), (self.linear(x).float(),))

    def while_loop(self, x):
        def body(i, t):
            return i + 1, torch.tanh(self.linear(t)).float()  # a carried value keeps its dtype, as eager requires

        return torch._higher_order_ops.while_loop(lambda i, t: i < 3, body, (torch.zeros((), dtype=torch.int64), x))

    def map(self, x):
        return torch._higher_order_ops.map(lambda t: self.linear(t), x.reshape(2, 2, 8))

    def scan(self, x):
        def combine(carry, t):
            new = torch.tanh(self.linear(carry + t)).float()
            return new, self.linear(new)

        return torch._higher_order_ops.scan(combine, x[:1], x.reshape(4, 1, 8))

    def no_grad(self, x):
        y = self.linear(x)
        with torch.no_grad():
            z = self.linear(y)
        return self.linear(z)

    def autocast_disabled(self, x):
        y = self.linear(x)
        r = y.relu()  # (y itself after y.float() would be that .float(): the float32 trace cannot tell them apart)
        with torch.autocast("cpu", enabled=False):
            z = self.linear(y.float())  # float32 inside, from the bf16 output of the region around
        return r, z, self.linear(z)

    def autocast_float16(self, x):
        y = self.linear(x)
        with torch.autocast("cpu", dtype=torch.float16):
            # float16: the inner region replaces the policy, as a nested torch.autocast does (another linear:
            # torch's cast cache, keyed by the weight alone, would hand this one the outer region's bf16 copy)
            z = self.inner(y)
        return y.relu(), z, self.linear(z.float())


SUBGRAPH_KINDS = [
    "cond", "nested_cond", "while_loop", "map", "scan", "no_grad", "autocast_disabled", "autocast_float16"
]


@pytest.mark.parametrize("kind", SUBGRAPH_KINDS)
def test_the_subgraphs_of_higher_order_ops_are_rewritten(kind):
    torch.manual_seed(0)
    model, x = _Subgraphs(kind), torch.randn(4, 8).abs()
    gm = torch.export.export(model, (x,)).module()
    low = apply_policy(gm, mixprec.policies.CPU, BF16)
    for inputs in (x, -x, x * 0.01):  # each branch of the conds
        expected, plain = _native(model, inputs), torch.utils._pytree.tree_leaves(gm(inputs))
        assert not all(map(torch.equal, plain, torch.utils._pytree.tree_leaves(expected)))  # the policy matters
        _assert_bitwise(low(inputs), expected)


def test_a_subgraph_called_twice_on_other_dtypes_is_rewritten_once_for_each():
    # invoke_subgraph (a nested_compile_region, as AOTAutograd writes it): the first call takes x in float32,
    # the second the first's bf16 output, so each gets its own rewrite (and identifier).
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    linear, x = torch.nn.Linear(8, 8), torch.randn(4, 8)

    @torch.compiler.nested_compile_region
    def block(t):
        return torch.relu(linear(t))

    def twice(t):
        return block(block(t))

    graphs = []
    with torch.no_grad():
        torch.compile(twice, backend=aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm), fullgraph=True)(x)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 2 and len({n.args[0].target for n in calls}) == 1
    low = apply_policy(gm, mixprec.policies.CPU, BF16)
    calls = [n for n in low.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len({n.args[0].target for n in calls}) == len({n.args[1] for n in calls}) == 2
    inputs = [{"x": x, "weight": linear.weight, "bias": linear.bias}[_aot_input(gm, n)] for n in _placeholders(gm)]
    with torch.no_grad():
        _assert_bitwise(low(*inputs), (_native(twice, x),))


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _aot_input(gm, placeholder):
    """Which of x, weight, bias an AOTAutograd placeholder is, by its shape."""
    return {(4, 8): "x", (8, 8): "weight", (8,): "bias"}[tuple(placeholder.meta["val"].shape)]


class _BadSubgraphs(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.linear, self.kind = torch.nn.Linear(8, 8), kind

    def forward(self, x):
        if self.kind == "cond":  # a bf16 branch and a float32 one
            return torch.cond(x.sum() > 0, lambda t: self.linear(t), lambda t: t * 2, (x,))
        if self.kind == "while_loop":  # the body turns the carried float32 value into bf16
            return torch._higher_order_ops.while_loop(
                lambda i, t: i < 3, lambda i, t: (i + 1, self.linear(t)), (torch.zeros((), dtype=torch.int64), x)
            )
        from torch._higher_order_ops.hints_wrap import hints_wrapper

        return hints_wrapper(lambda t: self.linear(t), (x,), {}, hints={"outer_body": True})


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("cond", RuntimeError, "torch.cond: under the policy its branches return different dtypes"),
        ("while_loop", RuntimeError, "while_loop: under the policy its body returns a carried value"),
        ("hints_wrapper", NotImplementedError, "the higher-order op hints_wrapper: it runs a subgraph"),
    ],
)
def test_a_higher_order_op_the_rewrite_cannot_express_is_refused(kind, error, match):
    model, x = _BadSubgraphs(kind), torch.randn(4, 8)
    gm = torch.export.export(model, (x,)).module()
    if kind != "hints_wrapper":  # eager autocast refuses these too
        with pytest.raises(Exception, match=r"same metadata|dtype"):
            _native(model, x)
    with pytest.raises(error, match=rf"apply_policy cannot rewrite {match}.*test_graph.py"):
        apply_policy(gm, mixprec.policies.CPU, BF16)


class _TwoUses(torch.nn.Module):
    """A float32 tensor that two mm's use: an activation, or a weight."""

    def __init__(self, used):
        super().__init__()
        self.used = used
        self.w, self.v = torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        if self.used == "activation":
            h = x.sin()
            return torch.mm(h, self.w), torch.mm(h, self.v)
        return torch.mm(x.sin(), self.w), torch.mm(x.cos(), self.w)


#: mm in the 'fp16' category: cast to float16, whose format keeps no weight's cast (torch's cuDNN RNN's rule).
FP16_MM = mixprec.policies.CPU.with_ops(fp16=["mm"])
TWO_USES = [
    ("activation", "lower_precision_fp"),  # eager casts h at each use
    ("activation", "fp16"),
    ("weight", "fp16"),  # eager casts w at each use: float16 keeps no weight's cast
    ("weight", "lower_precision_fp"),  # eager casts w once: the region's dtype keeps a weight's cast
]


def _grads(model, x, run):
    """The outputs of ``run(x)`` and the gradients of x and of the model's weights, for fixed output gradients."""
    model.zero_grad()
    x = x.clone().requires_grad_()
    outputs = run(x)
    gen = torch.Generator().manual_seed(1)
    torch.autograd.backward(outputs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outputs])
    return [*outputs, x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("region", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("used", "category"), TWO_USES, ids=["-".join(c) for c in TWO_USES])
def test_gradients_through_a_tensor_two_ops_use_are_eager_mixprecs(used, category, region):
    # A cast two ops share sums their gradients in the cast's dtype, two casts in float32: the graph shares a
    # cast exactly where eager autocast keeps one (a weight's, to a format that keeps it).
    torch.manual_seed(0)
    model, x = _TwoUses(used), torch.randn(32, 32)
    policy = FP16_MM if category == "fp16" else mixprec.policies.CPU
    low = apply_policy(torch.export.export(model, (x,)).module(), policy, region)

    def eager(inputs):
        with mixprec.autocast("cpu", dtype=region, policy=policy, compute="native"):
            return model(inputs)

    _assert_bitwise(_grads(model, x, low), _grads(model, x, eager))


def _regions_by_calls(x, w):
    with torch.autocast("cpu", enabled=False):
        a = torch.mm(x, w)
        with torch.autocast("cpu", dtype=torch.float16):
            b = torch.mm(x, w)
        c = torch.mm(a, w)
    return a, b, c, torch.mm(x, w)


def test_a_region_that_make_fx_records_as_calls_takes_its_own_rules():
    # make_fx writes a torch.autocast region as _enter_autocast / _exit_autocast calls (export: a HOP): the ops
    # between them run by the region's rules (none where disabled, torch's at its dtype), as in eager code
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    low = apply_policy(make_fx(_regions_by_calls, pre_dispatch=True)(x, w), mixprec.policies.CPU, BF16)
    with mixprec.autocast("cpu", compute="native"):
        expected = _regions_by_calls(x, w)
    got = low(x, w)
    assert [t.dtype for t in got] == [torch.float32, torch.float16, torch.float32, BF16]
    _assert_bitwise(got, expected)


class _BlockBetween(torch.nn.Module):
    """Two mm's of one weight around a no_grad or torch.autocast block that reads x, or writes a buffer."""

    def __init__(self, block, writes):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.register_buffer("seen", torch.zeros(8, 8))
        self.block, self.writes = block, writes

    def forward(self, x):
        a = torch.mm(x, self.w)
        with self.block():
            r = torch.relu(x)
            if self.writes:
                self.seen.add_(r)
        return a, torch.mm(x, self.w) + r


BLOCKS = {"no_grad": torch.no_grad, "autocast_disabled": lambda: torch.autocast("cpu", enabled=False)}


@pytest.mark.parametrize("writes", [False, True], ids=["reads", "writes_a_buffer"])
@pytest.mark.parametrize("block", BLOCKS)
def test_a_block_that_reads_its_inputs_keeps_a_weights_cast(block, writes):
    # A higher-order op whose subgraph writes none of its inputs writes nothing: w's cast made before it serves
    # the mm after it, as eager autocast's cache does (so w's gradient sums in bf16, as eager's); one that writes
    # a buffer (an attribute with a storage of its own) writes that alone, and w's cast stands too.
    torch.manual_seed(0)
    model, x = _BlockBetween(BLOCKS[block], writes), torch.randn(8, 8)
    low = apply_policy(torch.export.export(model, (x,)).module(), mixprec.policies.CPU, BF16)
    assert sum(1 for n in low.graph.nodes if is_cast(n) and cast_source(n).target == "w") == 1

    def eager(inputs):
        with mixprec.autocast("cpu", compute="native"):
            return model(inputs)

    _assert_bitwise(_grads(model, x, low), _grads(model, x, eager))


class _Siamese(torch.nn.Module):
    """One encoder (a weight, a BatchNorm in training) applied to two views: the BatchNorm writes its running
    statistics between the weight's two uses."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x, y):
        return torch.mm(self.bn(torch.mm(x, self.w)), self.w), torch.mm(self.bn(torch.mm(y, self.w)), self.w)


def test_a_buffer_written_between_a_weights_uses_keeps_the_weights_cast():
    # The running statistics' update writes the buffers alone: eager autocast's cache keeps w's cast through it,
    # and so does the graph (w's gradient sums the four uses in bf16, as eager's does).
    torch.manual_seed(0)
    model, x, y = _Siamese().train(), torch.randn(8, 8), torch.randn(8, 8)
    low = apply_policy(torch.export.export(model, (x, y)).module(), mixprec.policies.CPU, BF16)
    assert sum(1 for n in low.graph.nodes if is_cast(n) and cast_source(n).target == "w") == 1

    def eager(x, y):
        with mixprec.autocast("cpu", compute="native"):
            return model(x, y)

    def grads(run, bn):
        model.zero_grad()
        bn.running_mean.zero_(), bn.running_var.fill_(1.0)
        outputs = run(x, y)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        return [*outputs, model.w.grad, bn.running_mean.clone(), bn.running_var.clone()]

    _assert_bitwise(grads(low, low.bn), grads(eager, model.bn))


def test_a_region_by_calls_on_another_devices_tensors_is_refused_without_a_device_type():
    # make_fx's CPU region around an mm of meta tensors: with no device_type the pass casts on every device, the
    # region on the CPU alone; which rules the mm takes is ambiguous, so it is refused (as for export's HOP)
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, m):
        with torch.autocast("cpu", dtype=torch.float16):
            return torch.mm(x, x), torch.mm(m, m)

    gm = make_fx(f, pre_dispatch=True)(torch.randn(4, 4), torch.randn(4, 4, device="meta"))
    with pytest.raises(NotImplementedError, match=r"region is for cpu and holds tensors on other devices.*meta"):
        apply_policy(gm, mixprec.policies.CPU, BF16)
    low = apply_policy(gm, mixprec.policies.CPU, BF16, device_type="cpu")  # the CPU's rules for CPU tensors
    # (the meta mm keeps float32: a CPU region does not cast meta tensors, in eager code either)
    assert [t.dtype for t in low(torch.randn(4, 4), torch.randn(4, 4, device="meta"))] == [torch.float16, torch.float32]


@pytest.mark.parametrize("leaf", [False, True], ids=["view", "leaf"])
def test_an_input_cast_twice_is_shared_where_it_is_a_weight_when_the_graph_runs(leaf):
    # The trace cannot say whether x will be a leaf that requires grad (a weight, whose cast eager keeps): its
    # second use reuses the first cast where it is, and casts afresh where not; compiled whole, the same.
    class Square(torch.nn.Module):
        def forward(self, x):
            return x @ x

    torch.manual_seed(0)
    model, x = Square(), torch.randn(8, 8)
    low = apply_policy(torch.export.export(model, (x,)).module(), mixprec.policies.CPU, BF16)
    assert sum(1 for n in low.graph.nodes if is_cast(n)) == 2  # (one _to_copy, one cast_unless_weight)

    def grad(run):
        leaf_x = x.clone().requires_grad_()
        out = run(leaf_x if leaf else leaf_x.view_as(leaf_x))
        out.backward(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(out.dtype))
        return [out, leaf_x.grad]

    def eager(inputs):
        with mixprec.autocast("cpu", compute="native"):
            return model(inputs)

    expected = grad(eager)
    _assert_bitwise(grad(low), expected)
    _assert_bitwise(grad(torch.compile(low, backend="aot_eager", fullgraph=True)), expected)


class _Widened(torch.nn.Module):
    """A float32 copy of a bf16 tensor, used once, by two mm's, by an mm and a float32 op, or twice by one mm."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w, self.v = torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        h = x.sin().to(BF16).float()
        if self.kind == "once":
            return (torch.mm(h, self.w),)
        if self.kind == "three_mms":
            return torch.mm(h, self.w), torch.mm(h, self.v), torch.mm(h, self.w.t())
        if self.kind == "mm_and_float32_op":
            return torch.mm(h, self.w), h * 3
        return (torch.mm(h, h),)


@pytest.mark.parametrize("kind", ["once", "three_mms", "mm_and_float32_op", "one_mm_twice"])
def test_gradients_through_a_widened_copy_are_eager_mixprecs(kind):
    # A widened copy's cast is its source only where the copy has no other use: with others, eager sums their
    # gradients in float32 and narrows the sum once (h.grad from h * 3 in float32, and from three bf16 mm's).
    torch.manual_seed(0)
    model, x = _Widened(kind), torch.randn(32, 32)
    low = apply_policy(torch.export.export(model, (x,)).module(), mixprec.policies.CPU, BF16)

    def eager(inputs):
        with mixprec.autocast("cpu", compute="native"):
            return model(inputs)

    _assert_bitwise(_grads(model, x, low), _grads(model, x, eager))
    with CountCasts() as counted, mixprec.autocast("cpu", compute="native"):
        model(x)
    assert cast_nodes(low) == counted.casts - (kind == "once")  # used once: the cast of h is a cast of its source


@pytest.mark.parametrize(("category", "casts"), [("lower_precision_fp", 1), ("fp16", 2)])
def test_a_lifted_parameter_is_a_weight(category, casts):
    # export's own graph takes the parameters as placeholders (recorded as leaves that require grad).
    torch.manual_seed(0)
    model, x = _TwoUses("weight"), torch.randn(32, 32)
    policy = FP16_MM if category == "fp16" else mixprec.policies.CPU
    lifted = torch.export.export(model, (x,)).graph_module
    low = apply_policy(lifted, policy, BF16)
    assert sum(1 for n in low.graph.nodes if cast_source(n) is not None and cast_source(n).name == "p_w") == casts

    def eager(inputs):
        with mixprec.autocast("cpu", policy=policy, compute="native"):
            return model(inputs)

    _assert_bitwise(_grads(model, x, lambda inputs: low(model.w, model.v, inputs)), _grads(model, x, eager))
