"""How ops are named in a policy: docs spelling, torch callables, torch.ops packets and overloads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixprec.policies import _names, _resolve


@torch.library.custom_op("mixprec_names::scale", mutates_args=())
def custom_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.parametrize(
    ("op", "name"),
    [
        ("softmax", "softmax"),
        (" softmax ", "softmax"),
        ("aten::softmax", "softmax"),
        ("aten::softmax.int", "aten::softmax.int"),
        (torch.softmax, "softmax"),
        (torch.Tensor.softmax, "softmax"),
        (F.softmax, "softmax"),
        (torch.ops.aten.softmax, "softmax"),
        (torch.ops.aten.softmax.int, "aten::softmax.int"),
        (torch.linalg.inv, "linalg_inv"),
        (torch.fft.rfft, "fft_rfft"),
        (F.cross_entropy, "cross_entropy"),
        (torch.Tensor.__rtruediv__, "__rdiv__"),  # the same function as __rdiv__; both names reach it
        (custom_scale, "mixprec_names::scale"),
        (torch.ops.mixprec_names.scale, "mixprec_names::scale"),
        (torch.ops.mixprec_names.scale.default, "mixprec_names::scale.default"),
        ("mixprec_names::scale.default", "mixprec_names::scale.default"),
    ],
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__qualname__", None) or str(v),
)
def test_op_name(op, name):
    assert _names.op_name(op) == name


@pytest.mark.parametrize(
    ("name", "reaches"),
    [
        ("mixprec_names::scale", [torch.ops.mixprec_names.scale, torch.ops.mixprec_names.scale.default]),
        ("mixprec_names::scale.default", [torch.ops.mixprec_names.scale.default]),
        ("aten::softmax.int", [torch.ops.aten.softmax.int]),
    ],
)
def test_qualified_names_reach_packets_and_overloads(name, reaches):
    assert list(_resolve.callables(name)) == reaches


@pytest.mark.parametrize(
    "name", ["mixprec_names::nope", "mixprec_names::scale.nope", "aten::mm.nope", "nons::x"], ids=str
)
def test_qualified_names_that_name_nothing(name):
    assert _resolve.callables(name) == ()
    with pytest.raises(ValueError, match="names no op"):
        _names.op_name(name)


def test_a_name_only_the_policy_lists_is_accepted():
    assert _names.op_name("op_of_an_old_torch", {"op_of_an_old_torch": None}) == "op_of_an_old_torch"
    with pytest.raises(ValueError, match="names no op"):
        _names.op_name("op_of_an_old_torch")


def test_op_names_takes_one_op_or_many_and_drops_repeats():
    assert _names.op_names(torch.mm) == ["mm"]
    assert _names.op_names("mm") == ["mm"]
    assert _names.op_names(("mm", torch.mm, torch.ops.aten.mm, "bmm")) == ["mm", "bmm"]
