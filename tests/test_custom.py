"""custom_fwd / custom_bwd on custom autograd Functions, with and without cast_inputs."""

from __future__ import annotations

import collections
import contextlib
import types
from typing import ClassVar

import numpy as np
import pytest
import torch

import mixprec
from mixprec.engine._cast import cast_tree


class MyMM(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.seen = (a.dtype, mixprec.is_autocast_enabled("cpu"))
        return a.mm(b)

    @staticmethod
    @mixprec.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        MyMM.backward_state = (mixprec.is_autocast_enabled("cpu"), mixprec.get_autocast_dtype("cpu"))
        return grad.mm(b.t()), a.t().mm(grad)


class MyMMFloat32(torch.autograd.Function):
    @staticmethod
    @mixprec.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, container):
        ctx.save_for_backward(a, container["b"])
        MyMMFloat32.forward_state = (a.dtype, container["b"].dtype, mixprec.is_autocast_enabled("cpu"))
        return a.mm(container["b"])

    @staticmethod
    @mixprec.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        _, b = ctx.saved_tensors
        MyMMFloat32.backward_enabled = mixprec.is_autocast_enabled("cpu")
        return grad.mm(b.t()), None


def leaves():
    return torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)


def test_custom_fwd_without_cast_inputs_runs_in_surrounding_state():
    a, b = leaves()
    with mixprec.autocast("cpu", dtype=torch.float16):
        out = MyMM.apply(a, b)
    assert out.dtype is torch.float16  # mm inside forward was autocast
    out.float().sum().backward()
    assert MyMM.backward_state == (True, torch.float16)
    assert a.grad.dtype is torch.float32


def test_custom_fwd_outside_region_records_disabled():
    a, b = leaves()
    out = MyMM.apply(a, b)
    assert out.dtype is torch.float32
    out.sum().backward()
    assert MyMM.backward_state[0] is False


def test_cast_inputs_casts_and_disables_autocast_in_forward():
    a, b = leaves()
    with mixprec.autocast("cpu"):
        out = MyMMFloat32.apply(a.bfloat16(), {"b": b.bfloat16()})
    assert MyMMFloat32.forward_state == (torch.float32, torch.float32, False)
    assert out.dtype is torch.float32
    out.sum().backward()
    assert MyMMFloat32.backward_enabled is False
    assert a.grad is not None


def test_cast_inputs_is_a_no_op_outside_a_region():
    a, b = leaves()
    MyMMFloat32.apply(a.bfloat16(), {"b": b.bfloat16()})
    assert MyMMFloat32.forward_state == (torch.bfloat16, torch.bfloat16, False)


def test_cuda_namespace_signatures():
    fwd = mixprec.cuda.amp.custom_fwd(cast_inputs=torch.float32)
    assert callable(fwd)
    assert callable(mixprec.cuda.amp.custom_bwd(lambda ctx, g: g))


Point = collections.namedtuple("Point", "x y")


class _Output(collections.OrderedDict):
    """A Hugging Face ``ModelOutput``'s shape: an OrderedDict whose items are also attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __init__(self, **items):
        super().__init__()
        for key, value in items.items():
            self[key] = value


class _List(list):
    pass


class _Tuple(tuple):
    pass


@pytest.mark.parametrize(
    ("name", "value", "check"),
    [
        ("str", "abc", lambda out: out == "abc"),
        ("bytes", b"abc", lambda out: out == b"abc"),
        ("numpy", np.ones(3), lambda out: isinstance(out, np.ndarray)),
        ("list", [torch.ones(1), 2], lambda out: type(out) is list and out[0].dtype is torch.float16 and out[1] == 2),
        ("tuple", (torch.ones(1),), lambda out: isinstance(out, tuple) and out[0].dtype is torch.float16),
        ("namedtuple", Point(torch.ones(1), 3), lambda out: isinstance(out, Point) and out.x.dtype is torch.float16),
        ("dict", {"k": torch.ones(1)}, lambda out: isinstance(out, dict) and out["k"].dtype is torch.float16),
        ("float64 stays", torch.ones(1, dtype=torch.float64), lambda out: out.dtype is torch.float64),
        ("int stays", torch.ones(1, dtype=torch.long), lambda out: out.dtype is torch.long),
        ("other device stays", torch.ones(1, device="meta"), lambda out: out.dtype is torch.float32),
        ("nested", {"a": [(torch.ones(1),)]}, lambda out: out["a"][0][0].dtype is torch.float16),
        # Subclasses keep their type (torch's custom_fwd gives a plain dict, or the list/tuple type rebuilt).
        ("ordered-dict", collections.OrderedDict(k=torch.ones(1)),
         lambda out: type(out) is collections.OrderedDict and out["k"].dtype is torch.float16),
        ("user-dict", collections.UserDict(k=torch.ones(1)),
         lambda out: type(out) is collections.UserDict and out["k"].dtype is torch.float16),
        ("model-output-like", _Output(logits=torch.ones(1)),
         lambda out: type(out) is _Output and out.logits.dtype is torch.float16 and out["logits"] is out.logits),
        ("read-only-mapping", types.MappingProxyType({"k": torch.ones(1)}),
         lambda out: type(out) is dict and out["k"].dtype is torch.float16),
        ("list-subclass", _List([torch.ones(1)]), lambda out: type(out) is _List and out[0].dtype is torch.float16),
        ("tuple-subclass", _Tuple((torch.ones(1),)), lambda out: type(out) is _Tuple and out[0].dtype is torch.float16),
    ],
)
def test_cast_walks_containers(name, value, check):
    assert check(cast_tree(value, "cpu", torch.float16))


class _Cache:
    """An object an argument carries through (a KV cache): iterable, and not to be rebuilt."""

    def __init__(self) -> None:
        self.items = [torch.ones(1)]

    def __iter__(self):
        return iter(self.items)


@pytest.mark.parametrize(
    "value",
    [_Cache(), iter([torch.ones(1)]), (x for x in [torch.ones(1)]), collections.OrderedDict(k=torch.ones(1).half()),
     [torch.ones(1, dtype=torch.float16), "x"], {"k": 3}, range(3), torch.Size([2, 3])],
    ids=["custom-iterable", "iterator", "generator", "nothing-to-cast-dict-subclass", "nothing-to-cast-list",
         "plain-dict", "range", "size"],
)
def test_cast_passes_every_other_object_through_as_the_same_object(value):
    assert cast_tree(value, "cpu", torch.float16) is value


def test_custom_fwd_validates_device_type():
    with pytest.raises(ValueError, match="device_type"):
        mixprec.custom_fwd(device_type="gpu")


class _LoggedMM(torch.autograd.Function):
    """mm in forward and in backward, each dtype logged."""

    log: ClassVar[dict[str, torch.dtype]] = {}

    @staticmethod
    @mixprec.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = torch.mm(x, w)
        _LoggedMM.log["forward"] = y.dtype
        return y

    @staticmethod
    @mixprec.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = torch.mm(grad, w.t())
        _LoggedMM.log["backward"] = gx.dtype
        return gx.to(x.dtype), None


class _Calls(torch.nn.Module):
    opens = False  # whether forward opens a torch.autocast region itself

    def forward(self, x, w):
        with torch.autocast("cpu") if self.opens else contextlib.nullcontext():
            return _LoggedMM.apply(x, w)


@pytest.mark.parametrize("where", ["region", "install", "install-module-policy", "install-module-policy-inside"])
def test_custom_bwd_after_the_region_is_gone_runs_forwards_policy(where):
    """Backward after the region (and the installation) is gone runs under forward's setting: under ``install``
    forward saved no setting (the installed one is found in the kernels), so backward ran the default policy."""
    policy = mixprec.policies.CPU.with_ops(fp32=["mm"])
    module, x, w = _Calls(), torch.randn(3, 4, requires_grad=True), torch.randn(4, 4)
    _LoggedMM.log.clear()
    if where == "region":
        with mixprec.autocast("cpu", policy=policy):
            y = module(x, w)
    elif where == "install":
        with mixprec.install(policy), torch.autocast("cpu"):
            y = module(x, w)
    elif where == "install-module-policy":
        with mixprec.install(), mixprec.set_module_policy(module, policy), torch.autocast("cpu"):
            y = module(x, w)
    else:  # (the module is entered with autocast off: the kernels find its policy's installed setting)
        module.opens = True
        with mixprec.install(), mixprec.set_module_policy(module, policy):
            y = module(x, w)
    y.float().sum().backward()
    assert _LoggedMM.log == {"forward": torch.float32, "backward": torch.float32}
