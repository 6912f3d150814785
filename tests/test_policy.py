"""The Policy object and the generated policy document."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.policies import _report

DOC = pathlib.Path(__file__).parent.parent / "docs" / "policy_tables.md"


@pytest.mark.parametrize(
    ("policy", "op", "category"),
    [
        ("CUDA", "softmax", "fp32_set_opt_dtype"),
        ("CUDA", torch.softmax, "fp32_set_opt_dtype"),
        ("CUDA", torch.Tensor.softmax, "fp32_set_opt_dtype"),
        ("CUDA", "norm", "fp32_append_dtype"),
        ("CUDA", "binary_cross_entropy", "banned"),
        ("CUDA", torch._C._nn.binary_cross_entropy, "banned"),
        ("CUDA", "tensordot", "promote"),
        ("CUDA", "cat", None),
        ("CPU", "cat", "promote"),
        ("CPU", torch.mm, "lower_precision_fp"),
        ("CPU", F.linear, "lower_precision_fp"),
        ("CPU", torch.linalg.inv, "fp32"),
        ("CPU", "linalg_inv", "fp32"),
        ("CPU", torch.fft.rfft, "fp32"),
        ("CPU", "softmax", None),
        ("CPU", torch.add, None),
        ("CUDA_DOCUMENTED", "__rtruediv__", "fp32"),
        ("CUDA_DOCUMENTED", torch.Tensor.__rtruediv__, "fp32"),
        ("CUDA_DOCUMENTED", "__matmul__", "lower_precision_fp"),
        ("CUDA_DOCUMENTED", F.cross_entropy, "fp32"),
        ("CPU_DOCUMENTED", "symeig", "fp32"),
        ("XPU", "linalg_multi_dot", "lower_precision_fp"),
    ],
)
def test_category_by_name_or_callable(policy, op, category):
    assert getattr(mixprec.policies, policy).category(op) == category


def test_ops_and_unknown_category():
    assert "mm" in mixprec.policies.CPU.ops("lower_precision_fp")
    with pytest.raises(ValueError, match=r"category='fp4'.*Expected one of: lower_precision_fp, fp32"):
        mixprec.policies.CPU.ops("fp4")


def test_policies_are_built_lazily_and_once():
    assert mixprec.policies.CPU is mixprec.policies.CPU
    assert mixprec.get_policy("cpu") is mixprec.policies.CPU
    with pytest.raises(AttributeError):
        mixprec.policies.TPU  # noqa: B018


def test_policy_is_immutable():
    with pytest.raises(AttributeError):
        mixprec.policies.CPU.name = "x"
    with pytest.raises(TypeError):
        mixprec.policies.CPU.table["mm"] = mixprec.Category.FP32


def test_repr_is_short():
    text = repr(mixprec.policies.CUDA)
    assert text.startswith("Policy(CUDA: lower_precision_fp=") and "banned=1" in text


def test_policy_document_is_current():
    assert DOC.read_text() == _report.render(), "regenerate: python -m mixprec.policies._report > docs/policy_tables.md"


def test_documented_cpu_list_differs_from_native_on_conv_transpose():
    assert mixprec.policies.CPU_DOCUMENTED.category("conv_transpose2d") == "fp32"
    assert mixprec.policies.CPU.category("conv_transpose2d") == "lower_precision_fp"
    x = torch.randn(1, 2, 4, 4)
    w = torch.randn(2, 2, 3, 3)
    with mixprec.autocast("cpu", policy=mixprec.policies.CPU_DOCUMENTED):
        assert F.conv_transpose2d(x, w).dtype is torch.float32
    with mixprec.autocast("cpu"):
        assert F.conv_transpose2d(x, w).dtype is torch.bfloat16


# ---------------------------------------------------------------------------------------------------------
# A category is an action and a target format


def test_each_category_is_atens_action_and_target():
    """ATen's cast policies (autocast_mode.h) read as data, and mixprec's fp8: what each does and which format it
    aims at."""
    from mixprec.policies._category import ATEN_CATEGORIES, TREATMENTS

    found = {c.value: (c.action.value, c.target) for c in mixprec.policies.Category}
    assert found == {
        "lower_precision_fp": ("cast", "region"),
        "fp32": ("cast", "float32"),
        "fp32_set_opt_dtype": ("set_dtype", "float32"),
        "fp32_append_dtype": ("append_dtype", "float32"),
        "promote": ("promote", None),
        "banned": ("ban", None),
        "fp8": ("scaled_mm", "float8_e4m3fn"),
        "fp16": ("cast", "float16"),  # (torch's cuDNN RNN kernel: float16 in a bfloat16 region too)
    }
    assert set(TREATMENTS) == set(mixprec.policies.Category)
    assert {c.value for c in ATEN_CATEGORIES} == set(found) - {"fp8", "fp16"}


def test_cudnn_rnn_runs_in_float16_whatever_the_region_dtype_as_torchs_kernel():
    """torch's AutocastRNN.cpp casts cuDNN's RNN to float16 in a bfloat16 region too (an nn.LSTM on an H200
    under bfloat16 autocast returns float16): the CUDA policies say so (the kernels on a GPU: tests/cuda's
    nn_LSTM, nn_GRU and nn_RNN against native; a build without cuDNN registers no such op)."""
    for policy in (mixprec.policies.CUDA, mixprec.policies.FP8):
        assert policy.category("_cudnn_rnn") == "fp16" and policy.target("_cudnn_rnn") == "float16"


@pytest.mark.parametrize("region", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("category", ["lower_precision_fp", "fp32", "fp16"])
def test_an_op_runs_in_its_targets_dtype_in_eager_explain_and_the_policy(region, category):
    policy = mixprec.policies.CPU.with_ops(**{category: ["mm"]})
    target = mixprec.policies.Category(category).target_format
    assert target is not None and policy.target("mm") == target.name
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with mixprec.autocast("cpu", dtype=region, policy=policy):
        out = torch.mm(a, b)
    assert out.dtype is target.resolve(region)
    why = mixprec.explain("mm", "cpu", policy, dtype=region, input_dtypes=(torch.float32, torch.float32))
    assert (why.target, why.runs_in) == (target.name, out.dtype)


@pytest.mark.parametrize("op", ["cat", "binary_cross_entropy", "add"])  # promote, banned, unlisted
def test_ops_whose_inputs_decide_or_that_do_not_run_have_no_target(op):
    policy = mixprec.policies.CPU.with_ops(banned=["binary_cross_entropy"])
    assert policy.target(op) is None
    assert mixprec.explain(op, "cpu", policy).target is None


def test_a_new_format_is_one_value_for_an_existing_action():
    """What fp8 will do: a Format, and the action's rule made for it (no consumer changes)."""
    from mixprec.engine import _plan
    from mixprec.policies._category import Action
    from mixprec.policies._format import FORMATS, Format

    half = Format("float16", torch.float16, cached=False)
    decide = _plan._ACTIONS[Action.CAST](half)
    assert decide(torch.bfloat16, (), False, "").cast_to is torch.float16
    with_dtype = _plan._ACTIONS[Action.SET_DTYPE](half)
    assert with_dtype(torch.bfloat16, (), True, "") == _plan.CastPlan(dtype_arg=torch.float16)
    assert with_dtype(torch.bfloat16, (), False, "") is _plan.AS_IS
    appended_in_region = _plan._ACTIONS[Action.APPEND_DTYPE](FORMATS["region"])  # no category does this yet
    assert appended_in_region(torch.float16, (), True, "") == _plan.CastPlan(dtype_arg=torch.float16, sibling=True)
    with pytest.raises(ValueError, match="has no target format"):
        _plan._ACTIONS[Action.CAST](None)


def test_a_treatment_without_its_target_or_with_an_unknown_one_is_refused():
    from mixprec.policies._category import Action, Treatment

    with pytest.raises(ValueError, match="promote and ban take no target format"):
        Treatment(Action.CAST, None)
    with pytest.raises(ValueError, match="promote and ban take no target format"):
        Treatment(Action.PROMOTE, "float32")
    with pytest.raises(ValueError, match="Unknown format"):
        Treatment(Action.CAST, "float8_e4m3fnuz")
