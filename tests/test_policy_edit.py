"""Policy.with_ops / without_ops / ops / diff / changes, checked through the dtypes ops produce.

Native torch cannot change its CPU lists, so a changed category is compared bit
for bit with the op run natively on inputs cast by hand to that category's
dtype; for custom ops torch has an answer, ``torch.library.register_autocast``,
and mixprec is compared with it.
"""

from __future__ import annotations

import pytest
import torch

import mixprec

CPU = mixprec.policies.CPU
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def _x(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def _under(policy: mixprec.Policy, fn, *args, dtype: torch.dtype = bf16, **kwargs):
    with mixprec.autocast("cpu", dtype=dtype, policy=policy):
        return fn(*args, **kwargs)


# --- with_ops: every category, every way of naming the op ------------------------------------------------

MM_SPELLINGS = {
    "docs": "mm",
    "aten": "aten::mm",
    "torch.mm": torch.mm,
    "Tensor.mm": torch.Tensor.mm,
    "packet": torch.ops.aten.mm,
}


@pytest.mark.parametrize("spelling", MM_SPELLINGS.values(), ids=MM_SPELLINGS.keys())
def test_with_ops_fp32_runs_mm_in_float32_bit_for_bit(spelling):
    a, b = _x(4, 8), _x(8, 3)
    policy = CPU.with_ops(fp32=[spelling])
    assert policy.category("mm") == "fp32" and policy.changes == {"mm": "fp32"}
    for call in (torch.mm, torch.Tensor.mm, torch.ops.aten.mm, torch.ops.aten.mm.default):
        got = _under(policy, call, a.to(bf16), b.to(bf16))
        assert got.dtype is f32
        torch.testing.assert_close(got, torch.mm(a.to(bf16).float(), b.to(bf16).float()), rtol=0, atol=0)
    assert _under(CPU, torch.mm, a.to(bf16), b.to(bf16)).dtype is bf16  # the original is unchanged


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
def test_with_ops_lower_precision_fp_casts_an_unlisted_op(dtype):
    x = _x(3, 5)
    policy = CPU.with_ops(lower_precision_fp=torch.softmax)
    got = _under(policy, torch.softmax, x, -1, dtype=dtype)
    torch.testing.assert_close(got, torch.softmax(x.to(dtype), -1), rtol=0, atol=0)
    assert _under(CPU, torch.softmax, x, -1, dtype=dtype).dtype is f32


@pytest.mark.parametrize("category", ["fp32_set_opt_dtype", "fp32_append_dtype"])
@pytest.mark.parametrize("op", ["sum", "cumsum"])
def test_with_ops_dtype_categories_pass_float32(category, op):
    x = _x(4, 6, dtype=bf16)
    policy = CPU.with_ops(**{category: [op]})
    got = _under(policy, getattr(torch, op), x, 0)
    torch.testing.assert_close(got, getattr(torch, op)(x, 0, dtype=f32), rtol=0, atol=0)
    assert _under(CPU, getattr(torch, op), x, 0).dtype is bf16


def test_with_ops_promote_widens_mixed_inputs():
    a, b = _x(4, 4, dtype=bf16), _x(4, 4)
    got = _under(CPU.with_ops(promote="mm"), torch.mm, a, b)
    torch.testing.assert_close(got, torch.mm(a.float(), b), rtol=0, atol=0)


def test_with_ops_banned_raises_naming_the_way_out():
    policy = CPU.with_ops(banned=[torch.mm])
    with pytest.raises(RuntimeError, match=r"mm is banned.*safe alternative.*with_ops\(fp32=\['mm'\]\)"):
        _under(policy, torch.mm, _x(2, 2), _x(2, 2))
    assert _under(policy, torch.mm, _x(2, 2, dtype=torch.float64), _x(2, 2, dtype=torch.float64)).dtype is torch.float64


def test_banned_error_lifts_to_fp32_as_it_says():
    target, logits = torch.rand(4), torch.rand(4)
    with pytest.raises(RuntimeError, match=r"mixprec.policies.CUDA.with_ops\(fp32=\['binary_cross_entropy'\]\)"):
        _under(mixprec.policies.CUDA, torch.nn.functional.binary_cross_entropy, logits, target)
    lifted = mixprec.policies.CUDA.with_ops(fp32=["binary_cross_entropy"])
    got = _under(lifted, torch.nn.functional.binary_cross_entropy, logits.to(bf16), target)
    torch.testing.assert_close(got, torch.nn.functional.binary_cross_entropy(logits.to(bf16).float(), target))


def test_a_banned_overload_names_its_own_entry_and_lifting_it_works():
    """The advice names the entry that decides (the overload's, spelled as listed), so following it lifts the ban."""
    policy = CPU.with_ops(banned=[torch.ops.aten.mm.default])
    with pytest.raises(RuntimeError, match=r"with_ops\(fp32=\['aten::mm.default'\]\)"):
        _under(policy, torch.mm, _x(2, 2), _x(2, 2))
    lifted = policy.with_ops(fp32=["aten::mm.default"])
    assert _under(lifted, torch.mm, _x(2, 2), _x(2, 2)).dtype is f32


def test_with_ops_several_categories_at_once():
    policy = CPU.with_ops(fp32=["mm", "bmm"], lower_precision_fp=[torch.softmax])
    assert policy.changes == {"bmm": "fp32", "mm": "fp32", "softmax": "lower_precision_fp"}
    assert _under(policy, torch.bmm, _x(2, 3, 3, dtype=bf16), _x(2, 3, 3, dtype=bf16)).dtype is f32


def test_with_ops_returns_a_new_policy():
    policy = CPU.with_ops(fp32="mm")
    assert policy is not CPU and CPU.category("mm") == "lower_precision_fp"
    assert CPU.with_ops() == CPU
    assert policy.base == "CPU" and policy.name == "CPU"


# --- overloads: an overload's entry wins over its op's ---------------------------------------------------


def test_overload_entry_wins_over_its_op():
    a, b = _x(3, 3), _x(3, 3)
    policy = CPU.with_ops(fp32=[torch.ops.aten.mm.default])
    assert policy.changes == {"aten::mm.default": "fp32"}
    assert _under(policy, torch.ops.aten.mm.default, a.to(bf16), b.to(bf16)).dtype is f32
    # torch.mm reaches aten::mm.default at the dispatcher, so the overload's entry applies to it too.
    assert _under(policy, torch.mm, a, b).dtype is f32
    padding_only = CPU.with_ops(fp32=[torch.ops.aten.conv1d.padding])
    assert _under(padding_only, torch.conv1d, _x(1, 2, 5), _x(3, 2, 2)).dtype is bf16  # reaches conv1d.default
    assert policy.category(torch.ops.aten.mm.default) == "fp32"
    # So does the policy's answer for torch.mm (a usual call reaches mm.default); the name "mm" is its own entry.
    assert policy.category(torch.mm) == policy.category(torch.Tensor.mm) == "fp32"
    assert policy.target(torch.mm) == "float32" and policy.category("mm") == "lower_precision_fp"


def test_without_ops_takes_an_ops_overload_entries_with_it():
    policy = CPU.with_ops(fp32=[torch.ops.aten.mm.default]).without_ops(torch.mm)
    assert "aten::mm.default" not in policy.table and "mm" not in policy.table
    assert _under(policy, torch.ops.aten.mm.default, _x(2, 2), _x(2, 2)).dtype is f32
    assert _under(policy, torch.mm, _x(2, 2, dtype=f16), _x(2, 2, dtype=f16)).dtype is f16


def test_without_ops_refuses_an_overload_its_op_still_covers():
    with pytest.raises(ValueError, match=r"listed as lower_precision_fp.*op='aten::mm.default'.*without_ops\('mm'\)"):
        CPU.without_ops(torch.ops.aten.mm.default)
    listed = CPU.with_ops(fp32=[torch.ops.aten.mm.default])
    with pytest.raises(ValueError, match="overload out of autocast on its own"):
        listed.without_ops(torch.ops.aten.mm.default)
    alone = CPU.without_ops("mm").with_ops(fp32=[torch.ops.aten.mm.default])
    assert alone.without_ops(torch.ops.aten.mm.default) == CPU.without_ops("mm")


# --- without_ops -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16, f16], ids=["fp32", "bf16", "fp16"])
def test_without_ops_runs_in_the_input_dtype(dtype):
    policy = CPU.without_ops(["mm", torch.cat])
    assert policy.changes == {"cat": None, "mm": None}
    a, b = _x(3, 3, dtype=dtype), _x(3, 3, dtype=dtype)
    torch.testing.assert_close(_under(policy, torch.mm, a, b), torch.mm(a, b), rtol=0, atol=0)
    assert _under(policy, torch.cat, [a, b]).dtype is dtype


def test_without_ops_of_an_unlisted_op_changes_nothing():
    assert CPU.without_ops("add") == CPU
    assert CPU.without_ops([]) == CPU


def test_ops_only_the_policy_knows_can_be_moved_and_removed():
    old = mixprec.Policy.from_lists("old", {"fp32": ["op_of_an_old_torch", "mm"]})
    assert old.with_ops(promote="op_of_an_old_torch").category("op_of_an_old_torch") == "promote"
    assert dict(old.without_ops("op_of_an_old_torch").table) == {"mm": mixprec.Category.FP32}


# --- ops / diff / changes / repr ---------------------------------------------------------------------------

#: ops to check categories through: name -> (callable, inputs in a given dtype).
RUNNERS = {
    "mm": (torch.mm, lambda d: (_x(3, 3, dtype=d), _x(3, 3, dtype=d))),
    "bmm": (torch.bmm, lambda d: (_x(2, 3, 3, dtype=d), _x(2, 3, 3, dtype=d))),
    "linear": (torch.nn.functional.linear, lambda d: (_x(2, 3, dtype=d), _x(4, 3, dtype=d))),
    "exp": (torch.exp, lambda d: (_x(3, dtype=d),)),
    "tanh": (torch.tanh, lambda d: (_x(3, dtype=d),)),
    "prod": (torch.prod, lambda d: (_x(3, dtype=d),)),
}


def _dtype_of(policy: mixprec.Policy, name: str, inputs: torch.dtype = bf16) -> torch.dtype:
    fn, make = RUNNERS[name]
    return _under(policy, fn, *make(inputs)).dtype


def test_ops_lists_what_runs_in_each_category():
    policy = CPU.with_ops(fp32=["mm", "exp"], lower_precision_fp=["tanh"]).without_ops("prod")
    assert {"mm", "exp"} <= set(policy.ops("fp32")) and "prod" not in policy.ops("fp32")
    assert "tanh" in policy.ops("lower_precision_fp") and "mm" not in policy.ops("lower_precision_fp")
    for name in RUNNERS:
        expected = {"fp32": f32, "lower_precision_fp": bf16, None: bf16}[policy.category(name)]
        assert _dtype_of(policy, name) is expected, name
        assert (name in policy.ops("fp32")) == (expected is f32)


def test_diff_names_exactly_the_ops_that_run_differently():
    policy = CPU.with_ops(fp32=["mm", "exp"], lower_precision_fp=["tanh", "linear"])
    assert set(policy.diff(CPU)) == {"exp", "mm", "tanh"}
    assert policy.diff(CPU)["mm"] == ("fp32", "lower_precision_fp")
    assert CPU.diff(policy)["exp"] == (None, "fp32")
    assert policy.diff(CPU)["tanh"] == ("lower_precision_fp", None)
    for name in RUNNERS:
        differs = any(_dtype_of(policy, name, d) is not _dtype_of(CPU, name, d) for d in (bf16, f32))
        assert differs == (name in policy.diff(CPU)), name


def test_diff_between_builtins_and_with_itself():
    assert CPU.diff(CPU) == {}
    assert mixprec.policies.CUDA.diff(CPU)["softmax"] == ("fp32_set_opt_dtype", None)


def test_diff_refuses_a_non_policy():
    with pytest.raises(TypeError, match=r"other=\{\} \(type builtins.dict\).*Expected a mixprec.Policy"):
        CPU.diff({})


def test_repr_is_short_and_counts_changes():
    assert repr(CPU).startswith("Policy(CPU: lower_precision_fp=")
    text = repr(CPU.with_ops(fp32="mm").without_ops("cat"))
    assert text.startswith("Policy(CPU, 2 changes to CPU: ") and len(text) < 100
    assert repr(mixprec.Policy.from_dict({"name": "mine"})) == "Policy(mine: empty)"


def test_policies_copy_and_pickle_as_values():
    import copy
    import pickle

    policy = CPU.with_ops(fp32="mm")
    assert copy.deepcopy(policy) is policy
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and _under(again, torch.mm, _x(2, 2, dtype=bf16), _x(2, 2, dtype=bf16)).dtype is f32
    # with its fp8 recipe (a policy handed to spawned workers, as DDP's mp.spawn does; it was lost before)
    for recipe in ({"scaling": "delayed", "history": 4}, {"scaling": "rowwise", "power_of_2": True}):
        fp8 = mixprec.policies.FP8.with_fp8_recipe(**recipe)
        again = pickle.loads(pickle.dumps(fp8))
        assert again == fp8 and again.fp8_recipe == fp8.fp8_recipe != mixprec.policies.FP8.fp8_recipe


# --- custom ops: torch.library.custom_op and torch.library.Library -----------------------------------------


@torch.library.custom_op("mixprec_edit::mm", mutates_args=())
def custom_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


_LIB = torch.library.Library("mixprec_edit_lib", "DEF")
_LIB.define("mm(Tensor a, Tensor b) -> Tensor")
_LIB.impl("mm", lambda a, b: torch.mm(a, b), "CompositeExplicitAutograd")


def _native_twin(name: str, cast_to: torch.dtype):
    """A custom op like custom_mm, with native autocast registered to cast to ``cast_to``."""
    ns = f"mixprec_edit_native_{str(cast_to).removeprefix('torch.')}"
    qualified = f"{ns}::{name}"

    @torch.library.custom_op(qualified, mutates_args=())
    def twin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)

    torch.library.register_autocast(qualified, "cpu", cast_to)
    return twin


_NATIVE = {dtype: _native_twin("mm", dtype) for dtype in (bf16, f16, f32)}

CUSTOM_SPELLINGS = {
    "custom_op": (custom_mm, custom_mm),
    "custom_op-packet": (torch.ops.mixprec_edit.mm, torch.ops.mixprec_edit.mm),
    "custom_op-overload": (torch.ops.mixprec_edit.mm.default, torch.ops.mixprec_edit.mm.default),
    "custom_op-string": ("mixprec_edit::mm", custom_mm),
    "Library-packet": (torch.ops.mixprec_edit_lib.mm, torch.ops.mixprec_edit_lib.mm),
    "Library-overload": (torch.ops.mixprec_edit_lib.mm.default, torch.ops.mixprec_edit_lib.mm.default),
    "Library-string": ("mixprec_edit_lib::mm", torch.ops.mixprec_edit_lib.mm),
}


@pytest.mark.parametrize(("spelling", "call"), CUSTOM_SPELLINGS.values(), ids=CUSTOM_SPELLINGS.keys())
@pytest.mark.parametrize(
    ("category", "dtype", "cast_to"),
    [("lower_precision_fp", bf16, bf16), ("lower_precision_fp", f16, f16), ("fp32", bf16, f32)],
    ids=["lower-bf16", "lower-fp16", "fp32"],
)
def test_custom_op_gets_a_category_like_native_register_autocast(spelling, call, category, dtype, cast_to):
    a, b = _x(4, 5), _x(5, 2)
    if cast_to is f32:
        a, b = a.to(dtype), b.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        native = _NATIVE[cast_to](a, b)
    got = _under(CPU.with_ops(**{category: [spelling]}), call, a, b, dtype=dtype)
    assert native.dtype is cast_to
    torch.testing.assert_close(got, native, rtol=0, atol=0)


def test_custom_op_category_is_seen_by_callable_and_name():
    policy = CPU.with_ops(fp32=[custom_mm], promote=[torch.ops.mixprec_edit_lib.mm.default])
    assert policy.changes == {"mixprec_edit::mm": "fp32", "mixprec_edit_lib::mm.default": "promote"}
    assert policy.category(torch.ops.mixprec_edit.mm) == "fp32"
    assert policy.category(torch.ops.mixprec_edit.mm.default) == "fp32"
    assert policy.category(torch.ops.mixprec_edit_lib.mm.default) == "promote"
    assert policy.category(torch.ops.mixprec_edit_lib.mm) == "promote"  # (its calls reach .default)
    assert policy.category("mixprec_edit_lib::mm") is None  # (the name is the table's: no entry of its own)
    assert policy.category(custom_mm) == policy.category("mixprec_edit::mm") == "fp32"
    assert policy.category("aten::mm") == policy.category("mm") == "lower_precision_fp"
    a, b = _x(3, 3, dtype=bf16), _x(3, 3)
    assert _under(policy, torch.ops.mixprec_edit_lib.mm.default, a, b).dtype is f32


def test_custom_op_without_ops_removes_it():
    policy = CPU.with_ops(fp32=[custom_mm]).without_ops("mixprec_edit::mm")
    assert policy == CPU
    a = _x(2, 2, dtype=bf16)
    assert _under(CPU.with_ops(fp32=[custom_mm]), custom_mm, a, a).dtype is f32
    assert _under(policy, custom_mm, a, a).dtype is bf16  # unlisted again: its inner mm is autocast


# --- unlisted custom ops: native autocast falls through to the kernel, with autocast still on ---------------


@torch.library.custom_op("mixprec_edit::mm_autograd", mutates_args=())
def custom_mm_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    return (grad @ b.to(grad.dtype).t()).to(a.dtype), (a.to(grad.dtype).t() @ grad).to(b.dtype)


custom_mm_autograd.register_autograd(_backward, setup_context=_setup)

UNLISTED = {
    "custom_op": custom_mm,
    "custom_op-packet": torch.ops.mixprec_edit.mm,
    "custom_op-overload": torch.ops.mixprec_edit.mm.default,
    "Library-packet": torch.ops.mixprec_edit_lib.mm,
    "Library-overload": torch.ops.mixprec_edit_lib.mm.default,
}


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("call", UNLISTED.values(), ids=UNLISTED.keys())
def test_unlisted_custom_op_autocasts_its_inner_ops_like_native(call, dtype):
    a, b = _x(4, 5), _x(5, 2)
    with torch.autocast("cpu", dtype=dtype):
        native = call(a, b)
    got = _under(CPU, call, a, b, dtype=dtype)
    assert native.dtype is dtype
    torch.testing.assert_close(got, native, rtol=0, atol=0)


def test_unlisted_custom_op_with_autograd_matches_native_gradients():
    a, b = _x(4, 5).requires_grad_(), _x(5, 2).requires_grad_()
    with torch.autocast("cpu"):
        native = custom_mm_autograd(a, b)
    native.float().sum().backward()
    expected = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    got = _under(CPU, custom_mm_autograd, a, b)
    got.float().sum().backward()
    torch.testing.assert_close(got, native, rtol=0, atol=0)
    torch.testing.assert_close((a.grad, b.grad), expected, rtol=0, atol=0)


@torch.library.custom_op("mixprec_edit::two", mutates_args=())
def custom_two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x @ x, x + 1


@torch.library.custom_op("mixprec_edit::into", mutates_args=("out",))
def custom_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x @ x)


@torch.library.custom_op("mixprec_edit::scaled", mutates_args=())
def custom_scaled(x: torch.Tensor, scale: float = 2.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    return (x @ x) * scale if bias is None else (x @ x) * scale + bias


SHAPES = {
    "two-outputs": lambda x: custom_two(x),
    "mutates": lambda x: (custom_into(x, out := torch.empty(3, 3)), out),
    "keyword": lambda x: custom_scaled(x, bias=x),
    "packet-positional": lambda x: torch.ops.mixprec_edit.scaled(x, 3.0),
}


@pytest.mark.parametrize("call", SHAPES.values(), ids=SHAPES.keys())
def test_unlisted_custom_ops_of_every_shape_match_native(call):
    x = _x(3, 3)
    with torch.autocast("cpu"):
        native = call(x)
    got = _under(CPU, call, x)
    torch.testing.assert_close(got, native, rtol=0, atol=0)


# --- edits that could change nothing are refused -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "names"),
    [
        (torch.Tensor.__matmul__, "matmul"),
        ("__matmul__", "matmul"),
        (torch.Tensor.__rpow__, "pow"),
        (torch.nn.functional.cross_entropy, "cross_entropy_loss"),
        (torch.nn.functional.normalize, "ATen ops it calls"),
        (torch.ops.aten.exp.out, "'exp'"),
        ("aten::mm.out", "'mm'"),
        ("add_", "'add'"),
        ("_batch_norm_with_update", "'_batch_norm_with_update_functional'"),
    ],
    ids=["Tensor.__matmul__", "__matmul__", "Tensor.__rpow__", "F.cross_entropy", "F.normalize", "exp.out",
         "aten::mm.out", "add_", "_batch_norm_with_update"],
)
def test_an_edit_of_a_name_no_autocast_kernel_sees_is_refused_with_what_to_name(op, names):
    """Autocast acts on the dispatcher's functional ATen overloads: an operator spelling, a Python function over
    other ops, or an out= / in-place overload would be moved and then change nothing (``x @ x`` stayed bfloat16
    with ``__matmul__`` moved to fp32)."""
    with pytest.raises(ValueError, match="Cannot edit this op") as raised:
        CPU.with_ops(fp32=[op])
    assert names in str(raised.value)
    with pytest.raises(ValueError, match="Cannot edit this op"):
        mixprec.Policy.from_dict({"base": "CPU", "ops": {"fp32": [op if isinstance(op, str) else _name(op)]}})


def _name(op) -> str:
    from mixprec.policies import _names

    return _names.table_key(op)


def test_a_documented_lists_spellings_stay_editable_where_a_table_lists_them():
    """A documented list holds Python spellings (``__matmul__``, ``cross_entropy``): its own data moves and
    round-trips (``from_lists`` of ``CUDA_DOCUMENTED``'s lists, then ``to_dict`` and ``from_dict``), while a table
    that does not list them refuses them."""
    documented = mixprec.policies.CUDA_DOCUMENTED
    assert documented.with_ops(fp32=["__matmul__"]).changes == {"__matmul__": "fp32"}
    assert "__matmul__" not in documented.without_ops("__matmul__").table
    rebuilt = mixprec.Policy.from_lists("doc", mixprec.policies.lists("CUDA_DOCUMENTED"))
    assert mixprec.Policy.from_dict(rebuilt.to_dict()) == rebuilt
    with pytest.raises(ValueError, match="Cannot edit this op"):
        CPU.with_ops(fp32=["__matmul__"])


def test_an_overload_entry_spelled_without_its_namespace_counts_as_aten_s():
    policy = mixprec.Policy.from_lists("p", {"lower_precision_fp": ["mm"], "fp32": ["mm.default"]})
    assert policy.category(torch.mm) == "fp32" and "mm.default" not in policy.without_ops("mm").table


def test_a_policy_file_cannot_take_an_overload_out_on_its_own_either(tmp_path):
    """``without_ops("aten::mm.default")`` raises; the same line in a file was dropped without a word, and the
    policy then equalled CPU."""
    path = tmp_path / "p.toml"
    path.write_text('base = "CPU"\nwithout_ops = ["aten::mm.default"]\n')
    with pytest.raises(ValueError, match="Cannot take an overload out of autocast on its own"):
        mixprec.Policy.from_file(path)
    with pytest.raises(ValueError, match="Cannot take an overload out of autocast on its own"):
        mixprec.Policy.from_dict({"base": "CPU", "without_ops": ["aten::mm.default"]})


def test_from_lists_spells_names_as_every_other_way_in_does():
    policy = mixprec.Policy.from_lists("p", {"fp32": ["aten::mm"]})
    assert dict(policy.table) == {"mm": mixprec.policies.Category.FP32}
    assert policy.category(torch.mm) == policy.category("mm") == "fp32"
    assert "mm" not in policy.without_ops("mm").table
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize(
    ("given", "suggested"),
    [("mm.default", "aten::mm.default"), ("torch.mm", "mm"), ("torch.linalg.inv", "linalg_inv")],
)
def test_a_name_spelled_as_python_or_without_its_namespace_gets_its_table_name_suggested(given, suggested):
    with pytest.raises(ValueError, match=f"Did you mean one of: {suggested}\\?"):
        CPU.with_ops(fp32=[given])


def test_explain_says_what_an_overload_entry_replaced():
    policy = CPU.with_ops(fp32=[torch.ops.aten.mm.default])
    assert mixprec.explain(torch.mm, "cpu", policy).source == "user change (was lower_precision_fp in CPU)"
