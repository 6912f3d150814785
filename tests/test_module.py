"""set_module_policy and AutocastModule: per-module precision, nesting, reuse, removal, exceptions.

Native torch has an answer for two of these: an ``"fp32"`` module is what a
forward wrapped in ``torch.autocast(enabled=False)`` on float32 inputs does, and
``AutocastModule`` is a forward wrapped in ``torch.autocast``; both are
compared with it bit for bit, gradients included.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import mixprec

CPU = mixprec.policies.CPU
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


class Probe(nn.Module):
    """Records, on each call, the autocast state its forward sees and the dtype an mm gets."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, str, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        policy = mixprec.get_policy("cpu")
        label = policy.name if not policy.changes else f"{policy.name}{sorted(policy.changes.items())}"
        self.seen.append((mixprec.is_autocast_enabled("cpu"), label, torch.mm(x, x.t()).dtype))
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 4))


def _dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, torch.dtype]:
    """The output dtype of every submodule on one forward."""
    out: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            out.setdefault(name, output.dtype)

        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules()]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return out


class NativeFP32(nn.Module):
    """Native torch's way to run a module in float32 inside an autocast region."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.module(x.float())


# --- "fp32" ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [bf16, f16], ids=["bf16", "fp16"])
def test_fp32_module_matches_native_autocast_disabled_bit_for_bit(dtype):
    model, native = _model(), _model()
    native[1] = NativeFP32(native[1])
    x = torch.randn(4, 8)
    with mixprec.set_module_policy(model[1], "fp32"):
        with mixprec.autocast("cpu", dtype=dtype):
            got = model(x)
            inner = _dtypes(model, x)
        got.float().sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        expected = native(x)
    expected.float().sum().backward()
    assert inner == {"0": dtype, "1.0": f32, "1.1": f32, "1": f32, "2": dtype, "": dtype}
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), native.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_fp32_module_casts_keyword_and_nested_inputs():
    class TwoInputs(nn.Module):
        def forward(self, x, *, extra):
            return x.dtype, extra["y"].dtype, extra["n"].dtype

    module = TwoInputs()
    handle = mixprec.set_module_policy(module, "fp32")
    x, y = torch.randn(2, dtype=bf16), torch.randn(2, dtype=f16)
    with mixprec.autocast("cpu"):
        assert module(x, extra={"y": y, "n": torch.randn(2, dtype=torch.float64)}) == (f32, f32, torch.float64)
    assert module(x, extra={"y": y, "n": y}) == (bf16, f16, f16)  # no region open: nothing is cast
    handle.remove()


# --- a Policy ----------------------------------------------------------------------------------------------


def test_module_policy_covers_the_module_and_its_children_only():
    model = _model()
    handle = mixprec.set_module_policy(model[1], CPU.with_ops(fp32=["linear"]).without_ops(["mm"]))
    with mixprec.autocast("cpu"):
        dtypes = _dtypes(model, torch.randn(4, 8))
    assert dtypes == {"0": bf16, "1.0": f32, "1.1": f32, "1": f32, "2": bf16, "": bf16}
    handle.remove()
    with mixprec.autocast("cpu"):
        assert _dtypes(model, torch.randn(4, 8))["1.0"] is bf16


def test_module_policies_nest_innermost_wins_and_outer_returns():
    outer, inner, after = Probe(), Probe(), Probe()
    block = nn.Sequential(Probe(), nn.Sequential(inner), after)
    block[0] = outer
    h1 = mixprec.set_module_policy(block, CPU.with_ops(fp32="mm"))
    h2 = mixprec.set_module_policy(block[1], CPU.without_ops("mm"))
    x = torch.randn(3, 3)
    with mixprec.autocast("cpu"):
        block(x)
        assert mixprec.get_policy("cpu") is CPU
    assert outer.seen == [(True, "CPU[('mm', 'fp32')]", f32)]
    assert inner.seen == [(True, "CPU[('mm', None)]", f32)]
    assert after.seen == [(True, "CPU[('mm', 'fp32')]", f32)]
    h2.remove()
    h1.remove()


def test_module_policy_inside_a_disabled_region_casts_nothing():
    probe = Probe()
    with mixprec.set_module_policy(probe, CPU.with_ops(fp32="mm")):
        with mixprec.autocast("cpu"), mixprec.autocast("cpu", enabled=False):
            probe(torch.randn(2, 2))
        probe(torch.randn(2, 2))  # no region open
    x = torch.randn(2, 2, dtype=bf16)
    with mixprec.set_module_policy(probe, CPU.with_ops(fp32="mm")):
        probe(x)
    # Autocast is off in all three calls, so the module policy has nothing to apply to.
    assert probe.seen == [(False, "CPU", f32), (False, "CPU", f32), (False, "CPU", bf16)]


def test_regions_opened_inside_a_module_policy():
    class Opens(nn.Module):
        def forward(self, x):
            with mixprec.autocast("cpu"):  # policy=None: the module's policy
                a = torch.mm(x, x)
                with mixprec.autocast("cpu", policy=CPU):  # an explicit policy wins
                    b = torch.mm(x, x)
                with mixprec.autocast("cpu", enabled=False):
                    c = torch.mm(x, x)
            return a.dtype, b.dtype, c.dtype

    module = Opens()
    with mixprec.set_module_policy(module, CPU.with_ops(fp32="mm")):
        assert module(torch.randn(2, 2)) == (f32, bf16, f32)
        assert module(torch.randn(2, 2, dtype=bf16)) == (f32, bf16, bf16)


def test_fp32_module_inside_a_policy_module_and_a_region_reopened_inside():
    class Reopens(nn.Module):
        def forward(self, x):
            off = (mixprec.is_autocast_enabled("cpu"), x.dtype, torch.mm(x, x).dtype)
            with mixprec.autocast("cpu", dtype=f16):
                on = (mixprec.get_policy("cpu").changes, torch.mm(x, x).dtype, torch.exp(x).dtype)
            return off, on

    inner = Reopens()
    outer = nn.Sequential(inner)
    h1, h2 = mixprec.set_module_policy(outer, CPU.with_ops(fp32="exp")), mixprec.set_module_policy(inner, "fp32")
    with h1, h2, mixprec.autocast("cpu"):
        off, on = outer(torch.randn(2, 2, dtype=bf16))
    assert off == (False, f32, f32)
    assert on == ({"exp": "fp32"}, f16, f32)


# --- reuse, removal, exceptions ----------------------------------------------------------------------------


def test_same_module_called_twice_and_shared_inside_one_forward():
    shared = Probe()
    model = nn.Sequential(shared, nn.Linear(3, 3), shared)
    with mixprec.set_module_policy(shared, "fp32"), mixprec.autocast("cpu"):
        model(torch.randn(3, 3))
        model(torch.randn(3, 3))
        assert mixprec.is_autocast_enabled("cpu")
    assert shared.seen == [(False, "CPU", f32)] * 4


def test_recursive_call_of_the_same_module():
    class Recurse(nn.Module):
        def forward(self, x, depth):
            seen = [(mixprec.is_autocast_enabled("cpu"), torch.mm(x, x).dtype)]
            return seen + (self(x.to(bf16), depth - 1) if depth else [])

    module = Recurse()
    with mixprec.set_module_policy(module, CPU.with_ops(fp32="mm")), mixprec.autocast("cpu"):
        assert module(torch.randn(2, 2), 3) == [(True, f32)] * 4
        assert mixprec.get_policy("cpu") is CPU


def test_removed_cleanly():
    model = _model()
    hooks_before = (dict(model[1]._forward_pre_hooks), dict(model[1]._forward_hooks))
    handle = mixprec.set_module_policy(model[1], "fp32")
    handle.remove()
    handle.remove()  # a second remove does nothing
    assert (dict(model[1]._forward_pre_hooks), dict(model[1]._forward_hooks)) == hooks_before
    assert not {"forward", "_replicate_for_data_parallel", "__prepare_scriptable__"} & set(model[1].__dict__)
    with mixprec.autocast("cpu"):
        assert _dtypes(model, torch.randn(2, 8))["1.0"] is bf16


def test_a_removed_policy_keeps_no_module_alive():
    """The wrapped forward refers to its module (a reference cycle, freed by a full collection, documented); once
    the policy is removed, ``del`` frees the module at once, though the caller keeps the handle."""
    gc.collect()
    model = nn.Linear(4, 4)
    weight = weakref.ref(model.weight)
    handle = mixprec.set_module_policy(model, "fp32")
    with handle:
        model(torch.randn(2, 4))
    del model
    assert weight() is None and handle._forward is None
    handle.remove()  # (again: nothing)


@pytest.mark.parametrize("own_forward", [False, True], ids=["class-forward", "instance-forward"])
@pytest.mark.parametrize("policy", ["fp32", CPU.with_ops(fp32=["linear"])], ids=["fp32", "policy"])
def test_a_data_parallel_replica_runs_itself_under_the_policy(policy, own_forward):
    """``nn.DataParallel``'s ``replicate`` makes each replica by ``_replicate_for_data_parallel`` (a copy of the
    module's ``__dict__``) and gives it its own parameters: the replica runs itself, under the policy, as a
    replica of a module without one runs itself."""
    x = torch.randn(2, 4)
    model = nn.Linear(4, 4)
    if own_forward:
        model.forward = model.forward  # (an instance attribute: the method bound to the original)
    handle = mixprec.set_module_policy(model, policy)

    def replicate(module: nn.Module, bias: float) -> nn.Module:  # as replicate() does, with other parameters
        replica = module._replicate_for_data_parallel()
        replica._parameters.update(weight=torch.zeros(4, 4), bias=torch.full((4,), bias))
        return replica

    replica = replicate(model, 1.0)
    second = replicate(replica, 2.0)  # (a replica's replica)
    expected = model(x)  # (float32: no region)
    with mixprec.autocast("cpu"):
        assert torch.equal(replica(x), torch.ones(2, 4)) and torch.equal(second(x), torch.full((2, 4), 2.0))
        assert torch.equal(model(x), expected)
    handle.remove()
    with mixprec.autocast("cpu"):
        assert model(x).dtype is bf16 and replicate(model, 1.0)(x).dtype is bf16


@pytest.mark.parametrize("own_forward", [False, True], ids=["class-forward", "instance-forward"])
def test_a_shallow_copy_given_a_policy_runs_itself(own_forward):
    """A shallow ``copy.copy`` shares the original's ``forward`` (its ``__dict__`` is copied), which runs the
    original: given a policy of its own, the copy runs itself (its mode, its parameters), under the policies set
    on it alone; a forward the original had as an instance attribute (a method bound to it) is bound to the
    copy."""
    x = torch.ones(4, 4)
    original = nn.Dropout(0.5)
    if own_forward:
        original.forward = original.forward  # (an instance attribute: the method bound to the original)
    mixprec.set_module_policy(original, CPU.with_ops(fp32=["dropout"]))
    shallow = copy.copy(original)
    handle = mixprec.set_module_policy(shallow, "fp32")
    shallow.eval()  # the copy's mode, not the original's (still training)
    with mixprec.autocast("cpu"):
        assert torch.equal(shallow(x), x) and not torch.equal(original(x), x)
        assert torch.equal(shallow(x.to(bf16)), x)  # ("fp32" casts the input: the copy's policy alone runs)
    handle.remove()
    assert torch.equal(shallow(x), x) and ("forward" in shallow.__dict__) is own_forward
    linear = nn.Linear(4, 4)
    mixprec.set_module_policy(linear, CPU)
    other = copy.copy(linear)
    other._parameters = {"weight": nn.Parameter(torch.zeros(4, 4)), "bias": linear.bias}
    mixprec.set_module_policy(other, CPU)
    with mixprec.autocast("cpu"):
        assert torch.equal(other(x), linear.bias.to(bf16).expand(4, 4))


class Boom(nn.Module):
    def forward(self, x):
        torch.mm(x, x)
        raise KeyError("boom")


@pytest.mark.parametrize("policy", ["fp32", CPU.with_ops(fp32="mm")], ids=["fp32", "policy"])
def test_state_is_restored_when_forward_raises(policy):
    module = Boom()
    with mixprec.set_module_policy(module, policy), mixprec.autocast("cpu"):
        for _ in range(2):
            with pytest.raises(KeyError, match="boom"):
                module(torch.randn(2, 2))
            assert mixprec.is_autocast_enabled("cpu") and mixprec.get_policy("cpu") is CPU
            assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is bf16


def test_state_is_kept_when_an_earlier_pre_hook_raises():
    module = Probe()

    def refuse(mod, args):
        raise ValueError("refused")

    module.register_forward_pre_hook(refuse)
    handle = mixprec.set_module_policy(module, "fp32")
    with mixprec.autocast("cpu"):
        with pytest.raises(ValueError, match="refused"):
            module(torch.randn(2, 2))
        assert mixprec.is_autocast_enabled("cpu")
    handle.remove()


def test_remove_inside_forward_takes_effect_at_the_next_call_and_state_stays_whole():
    class RemovesItself(nn.Module):
        def forward(self, x):
            self.handle.remove()
            return x

    module = RemovesItself()
    module.handle = mixprec.set_module_policy(module, "fp32")
    with mixprec.autocast("cpu"):
        assert module(torch.randn(2, dtype=bf16)).dtype is torch.float32  # this call keeps its level
        assert mixprec.is_autocast_enabled("cpu")
        assert module(torch.randn(2, dtype=bf16)).dtype is bf16
    assert "forward" not in module.__dict__
    module.handle.remove()


def test_module_policy_state_is_per_thread():
    import threading

    probe = Probe()
    seen_in_thread = []
    with mixprec.set_module_policy(probe, "fp32"), mixprec.autocast("cpu"):
        worker = threading.Thread(target=lambda: seen_in_thread.append(probe(torch.randn(2, 2, dtype=bf16)).dtype))
        worker.start()
        worker.join()
        probe(torch.randn(2, 2))
        assert mixprec.is_autocast_enabled("cpu")
    assert seen_in_thread == [bf16]
    assert probe.seen == [(False, "CPU", bf16), (False, "CPU", f32)]


# --- bad input ---------------------------------------------------------------------------------------------


def test_module_must_be_a_module():
    with pytest.raises(TypeError, match=r"module=.*Expected a torch.nn.Module"):
        mixprec.set_module_policy(lambda x: x, "fp32")


@pytest.mark.parametrize(("policy", "error"), [("fp16", ValueError), ({"mm": "fp32"}, TypeError)], ids=["str", "dict"])
def test_policy_must_be_a_policy_or_fp32(policy, error):
    with pytest.raises(error, match=r"Received: policy=.*Expected a mixprec.Policy .* or 'fp32'"):
        mixprec.set_module_policy(nn.Linear(2, 2), policy)


# --- AutocastModule ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"dtype": f16}, {"enabled": False}, {"cache_enabled": False}],
    ids=["default", "fp16", "disabled", "no-cache"],
)
def test_autocast_module_matches_native_torch_autocast(kwargs):
    model, native = _model(), _model()
    wrapped = mixprec.AutocastModule(model, "cpu", **kwargs)
    x = torch.randn(4, 8)
    got = wrapped(x)
    with torch.autocast("cpu", **kwargs):
        expected = native(x)
    got.float().sum().backward()
    expected.float().sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for p, q in zip(model.parameters(), native.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_autocast_module_takes_a_policy_and_is_a_module():
    wrapped = mixprec.AutocastModule(nn.Linear(3, 3), "cpu", policy=CPU.with_ops(fp32="linear"))
    assert wrapped(torch.randn(2, 3)).dtype is f32
    assert set(wrapped.state_dict()) == {"module.weight", "module.bias"}
    assert "autocast(device_type='cpu', dtype=torch.bfloat16" in repr(wrapped)
    assert copy.deepcopy(wrapped)(torch.randn(2, 3)).dtype is f32
    assert not mixprec.is_autocast_enabled("cpu")


@pytest.mark.parametrize("compute", ["native", "emulated"])
def test_autocast_module_takes_compute(compute):
    model = _model()
    wrapped = mixprec.AutocastModule(model, "cpu", compute=compute)
    x = torch.randn(4, 8)
    with mixprec.autocast("cpu", compute=compute):
        expected = model(x)
    assert torch.equal(wrapped(x), expected)
    assert f"compute='{compute}'" in repr(wrapped)


def test_autocast_module_with_an_fp32_child():
    model = _model()
    wrapped = mixprec.AutocastModule(model, "cpu")
    with mixprec.set_module_policy(model[2], "fp32"):
        dtypes = _dtypes(wrapped, torch.randn(2, 8))
    assert dtypes["module.0"] is bf16 and dtypes["module.2"] is f32


def test_autocast_module_checks_its_arguments():
    with pytest.raises(ValueError, match="device_type='tpu'"):
        mixprec.AutocastModule(nn.Linear(2, 2), "tpu")
    with pytest.raises(TypeError, match=r"Expected a torch\.nn\.Module"):
        mixprec.AutocastModule("linear", "cpu")


def test_fp32_on_a_module_with_low_precision_weights_names_the_policy_in_its_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    failed = r"Linear failed under set_module_policy\(module, .fp32.\).*bfloat16"
    policy = mixprec.set_module_policy(model[1], "fp32")
    with policy, mixprec.autocast("cpu"), pytest.raises(RuntimeError, match=failed):
        model(torch.randn(2, 4))
    # A Policy moving linear to fp32 casts the weights: the fix the message gives.
    with mixprec.set_module_policy(model[1], mixprec.policies.CPU.with_ops(fp32=["linear"])), mixprec.autocast("cpu"):
        assert model(torch.randn(2, 4)).dtype is torch.float32
