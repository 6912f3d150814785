"""to_dict / from_dict / from_file / to_toml, random edit sequences against a plain dict model, bad input."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixprec
from mixprec.policies import _names

CPU = mixprec.policies.CPU
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


@torch.library.custom_op("mixprec_serial::mm", mutates_args=())
def custom_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


# --- round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(mixprec.policies.BUILTIN))
def test_builtin_round_trips_as_its_name_alone(name, tmp_path):
    policy = getattr(mixprec.policies, name)
    assert policy.to_dict() == {"name": name, "base": name, "ops": {}}
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy
    path = tmp_path / "policy.toml"
    path.write_text(policy.to_toml())
    assert mixprec.Policy.from_file(path) == policy


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(max_size=12))
def test_any_name_round_trips_through_a_file(name, tmp_path):
    """A policy's name is any string, control characters and quotes included: ``to_toml`` escapes what TOML
    allows no raw (it wrote them raw, and ``from_file`` then refused its own file)."""
    policy = mixprec.Policy.from_dict({"name": name, "base": "CPU", "ops": {"fp32": ["softmax"]}})
    path = tmp_path / "named.toml"
    path.write_text(policy.to_toml(), encoding="utf-8")
    loaded = mixprec.Policy.from_file(path)
    assert loaded == policy and loaded.name == name


def test_a_hand_written_file_beside_a_training_config(tmp_path):
    path = tmp_path / "amp.toml"
    path.write_text(
        '# mixed precision for the finetune run\n'
        'name = "finetune"\n'
        'base = "CPU"\n'
        'without_ops = ["cat"]\n'
        "\n"
        "[ops]\n"
        'fp32 = ["mm", "mixprec_serial::mm"]\n'
        "lower_precision_fp = 'softmax'\n"
    )
    policy = mixprec.Policy.from_file(str(path))
    expected = CPU.with_ops(fp32=["mm", custom_mm], lower_precision_fp="softmax").without_ops("cat")
    assert policy == dataclasses.replace(expected, name="finetune")
    assert policy.changes == {"cat": None, "mixprec_serial::mm": "fp32", "mm": "fp32", "softmax": "lower_precision_fp"}
    a = torch.randn(3, 3, dtype=bf16)
    with mixprec.autocast("cpu", policy=policy):
        assert torch.mm(a, a).dtype is f32
        assert custom_mm(a, a).dtype is f32
        assert torch.softmax(a.float(), -1).dtype is bf16
        assert torch.cat([a, a.float()]).dtype is f32  # unlisted: type promotion, not autocast


def test_a_policy_without_base_is_its_ops():
    policy = mixprec.Policy.from_dict({"ops": {"fp32": ["mm"]}})
    assert policy.name == "custom" and policy.base is None and dict(policy.table) == {"mm": mixprec.Category.FP32}
    assert policy.to_dict() == {"name": "custom", "ops": {"fp32": ["mm"]}}
    with mixprec.autocast("cpu", policy=policy):
        assert torch.mm(torch.randn(2, 2, dtype=bf16), torch.randn(2, 2, dtype=bf16)).dtype is f32
        assert torch.nn.functional.linear(torch.randn(2, 2), torch.randn(2, 2)).dtype is f32  # not listed


# --- random edit sequences against a plain dict model -----------------------------------------------------

#: (how the op is given, the name the table keys it by)
OPS = [
    ("mm", "mm"),
    (torch.mm, "mm"),
    (torch.ops.aten.mm.default, "aten::mm.default"),
    (torch.softmax, "softmax"),
    ("aten::softmax.int", "aten::softmax.int"),
    (torch.cat, "cat"),
    ("stack", "stack"),
    ("sum", "sum"),
    (torch.exp, "exp"),
    (torch.linalg.inv, "linalg_inv"),
    (custom_mm, "mixprec_serial::mm"),
    (torch.ops.mixprec_serial.mm.default, "mixprec_serial::mm.default"),
]
CATEGORIES = list(mixprec.policies.CATEGORIES)
_DTYPE_CATEGORIES = ("fp32_set_opt_dtype", "fp32_append_dtype")
_TAKE_DTYPE = {"softmax", "aten::softmax.int", "sum"}  # of OPS, the ops with a dtype argument


def _model_without(model: dict[str, str], names: list[str]) -> None:
    for name in names:
        model.pop(name, None)
        prefix = f"{name}." if "::" in name else f"aten::{name}."
        for key in [k for k in model if k.startswith(prefix)]:
            del model[key]


_step = st.one_of(
    st.tuples(st.just("with"), st.sampled_from(CATEGORIES), st.lists(st.sampled_from(OPS), max_size=4)),
    st.tuples(st.just("without"), st.just(None), st.lists(st.sampled_from(OPS), max_size=4)),
)


@functools.cache
def _base(name: str) -> mixprec.Policy:
    return getattr(mixprec.policies, name)


def _fp8_op(name: str) -> bool:
    return name.removeprefix("aten::").split(".")[0] in _names.FP8_OPS


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=st.sampled_from(["CPU", "CUDA", "CPU_DOCUMENTED"]), steps=st.lists(_step, max_size=8))
def test_edit_sequences_agree_with_a_dict_and_round_trip(base, steps, tmp_path):
    policy = _base(base)
    model = {op: category.value for op, category in policy.table.items()}
    for kind, category, ops in steps:
        names = [name for _, name in ops]
        if kind == "with" and category in _DTYPE_CATEGORIES and not all(n in _TAKE_DTYPE for n in names):
            with pytest.raises(ValueError, match=f"Cannot put this op in {category}.*takes no dtype argument"):
                policy.with_ops(**{category: [op for op, _ in ops]})
        elif kind == "with" and category == "fp8" and not all(_fp8_op(n) for n in names):
            with pytest.raises(ValueError, match=r"Cannot put this op in fp8.*GEMMs of linear, mm, addmm and matmul"):
                policy.with_ops(fp8=[op for op, _ in ops])
        elif kind == "with":
            policy = policy.with_ops(**{category: [op for op, _ in ops]})
            model.update(dict.fromkeys(names, category))
        elif any(_names.op_of_overload(n) in model and _names.op_of_overload(n) not in names for n in names):
            with pytest.raises(ValueError, match="Cannot take an overload out of autocast on its own"):
                policy.without_ops([op for op, _ in ops])
        else:
            policy = policy.without_ops([op for op, _ in ops])
            _model_without(model, names)
        assert {op: c.value for op, c in policy.table.items()} == model
    for category in CATEGORIES:
        assert policy.ops(category) == tuple(sorted(op for op, c in model.items() if c == category))
    original = {op: c.value for op, c in _base(base).table.items()}
    assert policy.changes == {op: model.get(op) for op in sorted(set(model) | set(original))
                              if model.get(op) != original.get(op)}
    assert mixprec.Policy.from_dict(policy.to_dict()) == policy
    path = tmp_path / "policy.toml"
    path.write_text(policy.to_toml())
    assert mixprec.Policy.from_file(path) == policy
    _check_dtypes(policy, model)


#: (op, call, takes dtype=, the table names of the overload the call reaches, its own first): ops whose produced
#: dtype is checked after each random sequence.
_CALLS = [
    (torch.mm, lambda a: torch.mm(a, a), False, ("aten::mm.default", "mm")),
    (torch.ops.aten.mm.default, lambda a: torch.ops.aten.mm.default(a, a), False, ("aten::mm.default", "mm")),
    (torch.softmax, lambda a: torch.softmax(a, -1), True, ("aten::softmax.int", "softmax")),
    (torch.ops.aten.softmax.int, lambda a: torch.ops.aten.softmax.int(a, -1), True, ("aten::softmax.int", "softmax")),
    (torch.sum, lambda a: torch.sum(a), True, ("aten::sum.default", "sum")),
    (torch.cat, lambda a: torch.cat([a, a]), False, ("aten::cat.default", "cat")),
    (torch.exp, lambda a: torch.exp(a), False, ("aten::exp.default", "exp")),
    (custom_mm, lambda a: custom_mm(a, a), False, ("mixprec_serial::mm.default", "mixprec_serial::mm")),
]


def _check_dtypes(policy: mixprec.Policy, model: dict[str, str]) -> None:
    """The model's category for each op is what explain reports, and explain's dtype is what the op produces."""
    for op, call, takes_dtype, reached in _CALLS:
        entry = next((n for n in reached if n in model), None)
        category = model.get(entry) if entry else None
        assert takes_dtype or category not in _DTYPE_CATEGORIES  # with_ops refuses that
        for dtype in (f32, bf16):
            why = mixprec.explain(op, "cpu", policy, input_dtypes=(dtype, dtype) if call is not None else (dtype,))
            assert why.category == category, (op, why)
            with mixprec.autocast("cpu", policy=policy):
                try:
                    got = call(torch.randn(3, 3, dtype=dtype)).dtype
                except RuntimeError:
                    got = None
            if why.note is None:
                assert got is why.runs_in, (op, why)


# --- bad input: the bad value and the valid choices --------------------------------------------------------


def test_unknown_category_in_with_ops():
    with pytest.raises(ValueError, match=r"category='fp4'.*Expected one of: lower_precision_fp, fp32, .*banned"):
        CPU.with_ops(fp4=["mm"])


def test_unknown_category_in_a_dict():
    with pytest.raises(ValueError, match=r"category='half'.*Expected one of: lower_precision_fp"):
        mixprec.Policy.from_dict({"base": "CPU", "ops": {"half": ["mm"]}})


@pytest.mark.parametrize(
    ("spelling", "suggests"),
    [("sofmax", "softmax"), ("linalg.inv", "linalg_inv"), ("aten::mmm", None), ("nosuchlib::op", None)],
    ids=["typo", "dotted", "aten-typo", "no-namespace"],
)
def test_an_op_name_that_names_nothing(spelling, suggests):
    with pytest.raises(ValueError, match=r"names no op torch has.*Received: op=.*Expected an op name") as raised:
        CPU.with_ops(fp32=[spelling])
    assert repr(spelling) in str(raised.value)
    if suggests:
        assert f"Did you mean one of: {suggests}" in str(raised.value) or suggests in str(raised.value)
    with pytest.raises(ValueError, match="names no op"):
        CPU.without_ops(spelling)
    with pytest.raises(ValueError, match="names no op"):
        mixprec.Policy.from_dict({"base": "CPU", "ops": {"fp32": [spelling]}})


@pytest.mark.parametrize("category", ["fp32_set_opt_dtype", "fp32_append_dtype"])
def test_dtype_categories_need_an_op_with_a_dtype_argument(category):
    pattern = rf"in {category}.*op='mm'.*Expected an op with a dtype argument.*use the fp32"
    with pytest.raises(ValueError, match=pattern):
        CPU.with_ops(**{category: [torch.mm]})
    with pytest.raises(ValueError, match=r"op='mixprec_serial::mm'"):
        mixprec.Policy.from_dict({"base": "CPU", "ops": {category: ["mixprec_serial::mm"]}})
    assert CPU.with_ops(**{category: [torch.softmax, "cumsum", torch.linalg.vector_norm, "norm"]}).ops(category)


def test_a_callable_that_is_not_a_torch_op():
    with pytest.raises(ValueError, match=r"not a torch op or op name.*function"):
        CPU.with_ops(fp32=[lambda x: x])


def test_something_that_is_not_an_op_at_all():
    with pytest.raises(TypeError, match=r"ops=3 \(type builtins.int\)"):
        CPU.with_ops(fp32=3)


def test_one_op_in_two_categories():
    with pytest.raises(ValueError, match=r"listed under both fp32 and promote.*op='mm'"):
        CPU.with_ops(fp32=["mm"], promote=[torch.mm])
    with pytest.raises(ValueError, match=r"both fp32 and without_ops.*op='mm'"):
        mixprec.Policy.from_dict({"base": "CPU", "ops": {"fp32": ["mm"]}, "without_ops": ["mm"]})


def test_invalid_toml_names_the_file_and_the_layout(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('base = "CPU"\n[ops\nfp32 = ["mm"]\n')
    pattern = r"not valid TOML \(.*line 2.*\).*broken.toml.*Expected a TOML file with the keys"
    with pytest.raises(ValueError, match=pattern):
        mixprec.Policy.from_file(path)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"base": "TPU"}, r"base='TPU'.*Expected one of: CPU, CUDA, XPU, CPU_DOCUMENTED, CUDA_DOCUMENTED"),
        ({"bsae": "CPU"}, r"unknown key.*key='bsae'.*Expected one of: name, base, ops, without_ops"),
        ({"name": 3}, r"name=3 \(type builtins.int\)"),
        ({"ops": ["mm"]}, r"ops must map categories.*ops=\['mm'\]"),
        ({"ops": {"fp32": [torch.mm]}}, r"op names as strings"),
        ({"without_ops": 3}, r"without_ops=3"),
    ],
    ids=["base", "key", "name", "ops-list", "ops-callable", "without-int"],
)
def test_bad_dicts(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        mixprec.Policy.from_dict(data)


def test_bad_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "amp.toml"
    path.write_text('base = "CPU"\n[opps]\nfp32 = ["mm"]\n')
    with pytest.raises(ValueError, match=r"Invalid policy file '.*amp.toml'.*key='opps'"):
        mixprec.Policy.from_file(path)


def test_from_dict_needs_a_mapping():
    with pytest.raises(TypeError, match=r"data=\['mm'\].*Expected a dict with keys: name, base, ops, without_ops"):
        mixprec.Policy.from_dict(["mm"])
