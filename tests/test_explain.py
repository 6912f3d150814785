"""mixprec.explain: its category and dtype agree with what ops produce, under mixprec and native torch."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import mixprec
from _opsamples import POLICIES as TABLE_POLICIES
from _opsamples import UNREACHABLE, samples

CPU, CUDA = mixprec.policies.CPU, mixprec.policies.CUDA
RELEASE = mixprec.policies.describes(CPU)  # "torch 2.15": the installed release's table
bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@torch.library.custom_op("mixprec_explain::mm", mutates_args=())
def custom_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


def _t(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (3, 3))).to(dtype)


#: id -> (the op as explain is asked, a call, input dtypes)
CALLS = {
    "mm": (torch.mm, lambda a, b: torch.mm(a, b), 2),
    "aten-mm-overload": (torch.ops.aten.mm.default, lambda a, b: torch.ops.aten.mm.default(a, b), 2),
    "softmax": ("softmax", lambda a: torch.softmax(a, -1), 1),
    "F.softmax": (F.softmax, lambda a: F.softmax(a, -1), 1),
    "softmax-overload": (torch.ops.aten.softmax.int, lambda a: torch.ops.aten.softmax.int(a, -1), 1),
    "sum": (torch.sum, lambda a: torch.sum(a), 1),
    "exp": ("exp", lambda a: torch.exp(a), 1),
    "prod": (torch.prod, lambda a: torch.prod(a), 1),
    "cat": (torch.cat, lambda a, b: torch.cat([a, b]), 2),
    "stack": ("stack", lambda a, b: torch.stack([a, b]), 2),
    "linalg_inv": (torch.linalg.inv, lambda a: torch.linalg.inv(a + 3 * torch.eye(3, dtype=a.dtype)), 1),
    "add": (torch.add, lambda a, b: torch.add(a, b), 2),
    "custom": (custom_mm, lambda a, b: custom_mm(a, b), 2),
}

INPUTS = {
    "fp32": (f32, f32),
    "bf16": (bf16, bf16),
    "fp16": (f16, f16),
    "fp64": (f64, f64),
    "bf16+fp32": (bf16, f32),
    "fp32+bf16": (f32, bf16),
}

POLICIES = {
    "CPU": CPU,
    "CUDA": CUDA,
    "edited": CPU.with_ops(
        fp32=[torch.mm],
        promote=["exp", custom_mm],
        lower_precision_fp=[torch.ops.aten.softmax.int],
        fp32_set_opt_dtype=["sum"],
    ).without_ops(["cat", "prod"]),
}


def _actual(region, call, dtypes):
    args = [_t(d) for d in dtypes]
    with region:
        try:
            return call(*args).dtype
        except RuntimeError:
            return None


@pytest.mark.parametrize("autocast_dtype", [bf16, f16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("inputs", INPUTS.values(), ids=INPUTS.keys())
@pytest.mark.parametrize(("op", "call", "arity"), CALLS.values(), ids=CALLS.keys())
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_explained_dtype_is_the_dtype_produced(policy, op, call, arity, inputs, autocast_dtype):
    dtypes = inputs[:arity]
    why = mixprec.explain(op, "cpu", policy, dtype=autocast_dtype, input_dtypes=dtypes)
    got = _actual(mixprec.autocast("cpu", dtype=autocast_dtype, policy=policy), call, dtypes)
    if why.note is not None and why.op == "softmax":  # the policy lists an overload the call reaches
        assert why.category is None and why.runs_in is None and why.raises is None
        name = "aten::softmax.int"
        assert got is mixprec.explain(name, "cpu", policy, dtype=autocast_dtype, input_dtypes=dtypes).runs_in
    elif why.note is not None:  # an unlisted custom op: its kernel's mm decides, as natively
        assert why.category is None and why.runs_in is None and why.raises is None
        assert got is _actual(mixprec.autocast("cpu", dtype=autocast_dtype, policy=policy), torch.mm, dtypes), why
    elif why.raises is not None:
        assert got is None, why
    elif got is None:  # the kernel refuses the inputs autocast gives it (mm of two dtypes, inv of bfloat16)
        assert _actual(contextlib.nullcontext(), call, why.cast_inputs) is None, why
    else:
        assert why.runs_in is got, why
    if policy is CPU:
        native = _actual(torch.autocast("cpu", dtype=autocast_dtype), call, dtypes)
        assert native is got, "mixprec and native CPU autocast disagree"


def test_explain_reads_the_policy_and_dtype_in_force():
    edited = CPU.with_ops(fp32="mm")
    assert mixprec.explain("mm").runs_in is bf16
    with mixprec.autocast("cpu", dtype=f16, policy=edited):
        why = mixprec.explain("mm")
    assert (why.category, why.dtype, why.runs_in) == ("fp32", f16, f32)
    seen = []

    class Asks(torch.nn.Module):
        def forward(self, x):
            seen.append(mixprec.explain(torch.mm).source)
            return x

    module = torch.nn.Sequential(Asks())
    with mixprec.set_module_policy(module, edited), mixprec.autocast("cpu"):
        module(torch.randn(2, 2))
        seen.append(mixprec.explain(torch.mm).source)
    assert seen == ["user change (was lower_precision_fp in CPU)", f"default table CPU ({RELEASE})"]


@pytest.mark.parametrize(
    ("policy", "op", "source"),
    [
        (CPU, "mm", f"default table CPU ({RELEASE})"),
        (CUDA, torch.softmax, f"default table CUDA ({RELEASE})"),
        (mixprec.policies.CPU_DOCUMENTED, "gelu", "documented table CPU_DOCUMENTED"),
        (mixprec.policies.XPU, "mm", "documented table XPU"),
        (CPU, "add", f"default table CPU ({RELEASE}) does not list it"),
        (CPU.with_ops(fp32="mm"), "mm", "user change (was lower_precision_fp in CPU)"),
        (CPU.with_ops(fp32="softmax"), torch.softmax, "user change (was unlisted in CPU)"),
        (CPU.without_ops("cat"), "cat", "user change (was promote in CPU)"),
        (CPU.with_ops(fp32=custom_mm), torch.ops.mixprec_explain.mm.default, "user change (was unlisted in CPU)"),
        (mixprec.Policy.from_dict({"name": "mine", "ops": {"fp32": ["mm"]}}), "mm", "table of policy mine"),
        (mixprec.Policy.from_dict({"name": "mine"}), "mm", "table of policy mine does not list it"),
    ],
    ids=["default", "default-callable", "documented", "xpu", "unlisted", "moved", "added", "removed", "custom",
         "no-base", "no-base-unlisted"],
)
def test_provenance(policy, op, source):
    assert mixprec.explain(op, policy=policy).source == source


def test_overload_is_decided_by_its_op_unless_listed_itself():
    why = mixprec.explain(torch.ops.aten.mm.default)
    assert (why.op, why.entry, why.category) == ("aten::mm.default", "mm", "lower_precision_fp")
    why = mixprec.explain(torch.ops.aten.mm.default, policy=CPU.with_ops(fp32=[torch.ops.aten.mm.default]))
    assert (why.entry, why.category, why.runs_in) == ("aten::mm.default", "fp32", f32)


def test_banned_explains_the_error():
    why = mixprec.explain(F.binary_cross_entropy, "cpu", CUDA)
    assert why.runs_in is None and "BCEWithLogitsLoss" in why.raises and "with_ops(fp32=" in why.raises
    assert mixprec.explain(F.binary_cross_entropy, "cpu", CUDA, input_dtypes=(f64, f64)).runs_in is f64


def test_str_reads_as_a_sentence():
    text = str(mixprec.explain(torch.softmax, "cpu", CUDA, input_dtypes=(bf16,)))
    assert text == (
        "softmax under cpu autocast to bfloat16, policy CUDA: fp32_set_opt_dtype "
        f"(entry 'softmax', default table CUDA ({RELEASE})). With inputs (bfloat16) it runs in float32."
    )
    assert f"unlisted (default table CPU ({RELEASE}) does not list it)" in str(mixprec.explain("add"))
    assert str(mixprec.explain("binary_cross_entropy", policy=CUDA)).count("..") == 0


def test_unlisted_custom_op_is_explained_as_its_kernels_business():
    text = str(mixprec.explain(custom_mm, input_dtypes=(f32, f32)))
    assert "runs as its kernel decides: an unlisted custom op runs its kernel with autocast on" in text
    assert "Policy.with_ops" in text
    assert mixprec.explain(custom_mm, policy=CPU.with_ops(fp32=custom_mm), input_dtypes=(bf16, bf16)).runs_in is f32


def test_explanation_is_a_frozen_dataclass():
    why = mixprec.explain("mm")
    assert isinstance(why, mixprec.Explanation)
    with pytest.raises(dataclasses.FrozenInstanceError):
        why.category = "fp32"


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"op": "mmm"}, ValueError, r"op='mmm'.*Did you mean one of: mm"),
        ({"op": "mm", "device_type": "tpu"}, ValueError, r"device_type='tpu'.*Expected one of"),
        ({"op": "mm", "policy": "CPU"}, TypeError, r"policy='CPU'"),
        ({"op": "mm", "dtype": "bfloat16"}, TypeError, r"dtype='bfloat16'"),
        ({"op": "mm", "input_dtypes": ()}, TypeError, r"input_dtypes=\(\).*non-empty tuple of torch.dtype"),
        ({"op": "mm", "input_dtypes": ("float32",)}, TypeError, r"input_dtypes=\('float32',\)"),
    ],
    ids=["op", "device", "policy", "dtype", "no-inputs", "str-inputs"],
)
def test_bad_input(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        mixprec.explain(**kwargs)


# ---------------------------------------------------------------- explain against execution, every table op


MIXES = {"fp32": (f32,), "bf16": (bf16,), "fp32+bf16": (f32, bf16), "fp64+fp32": (f64, f32), "bf16+fp64": (bf16, f64)}


def _in_dtypes(value, dtypes):
    """The floating tensors of a sample in ``dtypes``, in order (the last one repeats)."""
    wanted, last = iter(dtypes), [None]

    def one(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            last[0] = next(wanted, last[0])
            return v.to(last[0])
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        if isinstance(v, dict):
            return {k: one(x) for k, x in v.items()}
        return v

    return one(value)


def _outcome_of(region, packet, args, kwargs):
    torch.manual_seed(0)
    with region:
        try:
            out = packet(*args, **kwargs)
        except Exception:
            return "raises"
    leaves = torch.utils._pytree.tree_leaves(out)
    floating = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return floating[0].dtype if floating else None


def _graph_outcome(packet, args, kwargs, policy, dtype):
    """The first floating output's dtype when the call, traced by make_fx (pre-dispatch, so composites stay as
    the ops policies name), is rewritten by ``mixprec.graph.apply_policy`` and run; "raises", or None if the
    call cannot be traced."""
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def call(*tensors):
        values = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            values[i] = t
        a, k = torch.utils._pytree.tree_unflatten(values, spec)
        return packet(*a, **k)

    tensors = [leaves[i] for i in where]
    for mode in ("fake", "real"):  # real: an op without a meta kernel (ctc_loss)
        try:
            gm = make_fx(call, pre_dispatch=True, tracing_mode=mode)(*tensors)
            break
        except Exception:
            continue
    else:
        return "untraceable"
    try:
        low = mixprec.graph.apply_policy(gm, policy, dtype, device_type="cpu")
        torch.manual_seed(0)
        out = low(*tensors)
    except Exception:
        return "raises"
    leaves = torch.utils._pytree.tree_leaves(out)
    floating = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return floating[0].dtype if floating else None


@pytest.mark.parametrize("autocast_dtype", [bf16, f16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("policy_name", TABLE_POLICIES)
def test_eager_fx_and_explain_agree_for_every_table_op(policy_name, autocast_dtype):
    """Every op of every shipped table, under five input dtype mixes: the eager kernels, the FX pass and explain
    give the same dtype (or all raise). All three decide through the engine's cast plan (``engine._plan``)."""
    policy = getattr(mixprec.policies, policy_name)
    names = sorted({n.split("::")[-1].split(".")[0] for n in policy.table})
    mismatches, declined, untraceable, checked = [], [], [], 0
    for name in names:
        if name in UNREACHABLE or not hasattr(torch.ops.aten, name) or not samples(name, f32):
            continue
        packet = getattr(torch.ops.aten, name)
        args, kwargs = samples(name, f32)[0]
        for mix, dtypes in MIXES.items():
            call_args, call_kwargs = _in_dtypes(args, dtypes), _in_dtypes(kwargs, dtypes)
            why = mixprec.explain(packet, "cpu", policy, dtype=autocast_dtype, example=call_args,
                                  example_kwargs=call_kwargs)
            got = _outcome_of(mixprec.autocast("cpu", dtype=autocast_dtype, policy=policy, compute="native"),
                              packet, call_args, call_kwargs)
            graph = _graph_outcome(packet, call_args, call_kwargs, policy, autocast_dtype)
            if graph == "untraceable":  # only a call that fails or returns no tensor without autocast makes none
                if _outcome_of(contextlib.nullcontext(), packet, call_args, call_kwargs) not in ("raises", None):
                    mismatches.append(f"{name}[{mix}]: make_fx could not trace a call that runs")
                untraceable.append(f"{name}[{mix}]")
            elif graph != got:
                mismatches.append(f"{name}[{mix}]: FX pass {graph}, eager {got}")
            if why.runs_in is None and why.raises is None:  # declined: a composite whose callees decide
                declined.append(f"{name}[{mix}]")
                continue
            checked += 1
            expected = "raises" if why.raises is not None else why.runs_in
            if expected != got:
                mismatches.append(f"{name}[{mix}]: explain {expected} ({why.raises or why.note}), eager {got}")
    assert not mismatches, "\n".join(mismatches)
    assert checked > 4 * len(declined), f"explain declined too often: {declined}"
    assert checked > 2 * len(untraceable), f"too few calls traced: {untraceable}"


@pytest.mark.parametrize(
    ("op", "policy", "inputs", "expected"),
    [
        ("mm", CPU, (f32, f64), "raises"),
        ("index_copy", CUDA, (bf16, f32), "raises"),
        ("index_copy", mixprec.policies.XPU, (bf16, torch.int64, f32), "raises"),
        (torch.norm, mixprec.policies.CUDA_DOCUMENTED, (bf16,), bf16),
        (torch.linalg.vector_norm, CUDA, (bf16,), f32),
    ],
    ids=["mm-f32-f64", "index_copy-cuda", "index_copy-xpu-with-index-dtype", "torch.norm-documented", "vector_norm"],
)
def test_explain_without_an_example_runs_the_op(op, policy, inputs, expected):
    """The issue's three wrong predictions, each against execution (no example: explain makes the call)."""
    why = mixprec.explain(op, "cpu", policy, input_dtypes=inputs)
    assert ("raises" if why.raises is not None else why.runs_in) == expected, why
    if op is torch.norm:
        assert why.op == "linalg_vector_norm" and "reaches aten::linalg_vector_norm" in why.note
        with mixprec.autocast("cpu", policy=policy):
            assert torch.norm(torch.randn(3).bfloat16()).dtype is expected


def test_explain_changes_nothing_in_the_process():
    from mixprec.engine import _kernels

    before = _kernels.registered("cpu")
    state = (torch.random.get_rng_state(), torch.is_autocast_enabled("cpu"))
    mixprec.explain("dropout", "cpu", CPU.with_ops(fp32=["dropout", "mm"]), input_dtypes=(bf16,))
    assert _kernels.registered("cpu") == before
    assert torch.equal(torch.random.get_rng_state(), state[0]) and torch.is_autocast_enabled("cpu") is state[1]


_A, _B = torch.rand(4, 4), torch.rand(4, 4)


_CALLABLES = {
    "mse_loss": (torch.nn.functional.mse_loss, (_A, _B), {}),  # (reaches broadcast_tensors first)
    "l1_loss": (torch.nn.functional.l1_loss, (_A, _B), {}),
    "smooth_l1_loss": (torch.nn.functional.smooth_l1_loss, (_A, _B), {}),
    "softmin": (torch.nn.functional.softmin, (_A,), {"dim": -1}),  # (neg, then softmax)
    "einsum": (torch.einsum, ("ij,jk->ik", _A, _B), {}),  # (a list argument; listed on CUDA only)
    "multi_dot": (torch.linalg.multi_dot, ([_A, _B],), {}),
}


@pytest.mark.parametrize(
    ("policy", "fn", "args", "kwargs"),
    [
        pytest.param(policy, *call, id=f"{name}-{policy}")
        for name, call in _CALLABLES.items()
        for policy in (["CUDA"] if name in ("einsum", "multi_dot") else ["CPU", "CUDA"])
    ],
)
def test_a_python_callable_is_explained_by_the_op_that_decides_its_dtype(policy, fn, args, kwargs):
    """A callable is explained by the first ATen call it makes that has a category (not a helper such as
    ``broadcast_tensors`` it reaches first), and a call with a list argument is cast as the kernels cast it:
    the dtype explain gives is the one a region gives."""
    chosen = getattr(mixprec.policies, policy)
    why = mixprec.explain(fn, "cpu", chosen, dtype=torch.bfloat16, example=args, example_kwargs=kwargs)
    with mixprec.autocast("cpu", dtype=torch.bfloat16, policy=chosen, compute="native"):
        got = fn(*args, **kwargs)
    assert why.runs_in is got.dtype, why


@pytest.mark.parametrize(
    ("policy", "op", "dtype", "call"),
    [
        ("CPU", torch.Tensor.__matmul__, torch.float32, lambda x: x @ x),
        ("CPU", "__matmul__", torch.float32, lambda x: x @ x),
        ("CPU", F.cross_entropy, torch.bfloat16, lambda x: F.cross_entropy(x, x.softmax(-1))),
        ("CUDA", torch.Tensor.__rpow__, torch.bfloat16, lambda x: 2.0**x),
    ],
    ids=["Tensor.__matmul__", "'__matmul__'", "F.cross_entropy", "Tensor.__rpow__"],
)
def test_explain_without_an_example_runs_a_python_callable_with_as_many_tensors_as_it_takes(policy, op, dtype, call):
    """Explain traced a callable with one tensor (input_dtypes' count), which ``x @ y`` and ``F.cross_entropy``
    cannot take, then answered from the absent table entry of the Python name: float32 for ``__matmul__``, which
    runs in bfloat16."""
    policy = getattr(mixprec.policies, policy)
    x = torch.randn(8, 8, dtype=dtype)
    with mixprec.autocast("cpu", policy=policy):
        ran = call(x).dtype
    assert mixprec.explain(op, "cpu", policy, input_dtypes=(dtype,)).runs_in is ran


def test_explain_with_an_example_that_raises_under_autocast_says_so(capfd):
    """A trace of ``torch.dot(bfloat16, float32)`` raises (autocast off); explain then ignored the example and gave
    a dtype, after fake tensors logged the error with its traceback."""
    a, b = torch.randn(8).bfloat16(), torch.randn(8)
    with pytest.raises(RuntimeError, match="same dtype") as native, torch.autocast("cpu"):
        torch.dot(a, b)
    why = mixprec.explain(torch.dot, "cpu", example=(a, b))
    assert why.runs_in is None and why.raises is not None and "same dtype" in why.raises
    assert "same dtype" in str(native.value) and "fake_tensor" not in capfd.readouterr().err
