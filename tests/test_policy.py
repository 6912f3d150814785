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
    with pytest.raises(ValueError, match=r"category='fp8'.*Expected one of: lower_precision_fp, fp32"):
        mixprec.policies.CPU.ops("fp8")


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
