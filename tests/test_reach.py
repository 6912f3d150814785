"""Which Python composites the mode expands: mixprec._reach, checked by reading code and by running it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mixprec
from mixprec import _mode, _reach
from mixprec.policies import CPU, CUDA


def _names(policy: mixprec.policies.Policy) -> frozenset[str]:
    return _mode.compile_policy(policy).names


def test_relu_cannot_reach_a_cpu_op() -> None:
    assert not _reach.reaches(F.relu, _names(CPU))


def test_multi_head_attention_reaches_linear_through_its_helpers() -> None:
    assert _reach.reaches(F.multi_head_attention_forward, _names(CPU))


def test_wrapped_operator_reaches_the_callable_in_its_closure() -> None:
    assert _reach.reaches(torch.Tensor.__pow__, _names(CUDA))
    assert not _reach.reaches(torch.Tensor.__pow__, _names(CPU))


def _uses_matmul_operator(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def _calls_helper(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _uses_matmul_operator(a, b).relu()


def test_operators_and_helpers_are_followed() -> None:
    names = frozenset({"__matmul__"})
    assert _reach.reaches(_uses_matmul_operator, names)
    assert _reach.reaches(_calls_helper, names)
    assert not _reach.reaches(_calls_helper, frozenset({"softmax"}))


def test_ported_builtin_reaches() -> None:
    assert _reach.reaches(torch._C._nn.pad, _names(CPU))
    assert not _reach.reaches(torch.relu, _names(CPU))


def test_unexpanded_composite_runs_natively_and_expanded_one_is_cast() -> None:
    x = torch.randn(2, 5, 8)
    attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with mixprec.autocast("cpu"):
        assert F.relu(x).dtype == torch.float32
        assert attn(x, x, x, need_weights=False)[0].dtype == torch.bfloat16
    assert _mode.compile_policy(CPU).twins[F.relu] is None
    assert _mode.compile_policy(CPU).twins[F.multi_head_attention_forward] is not None
