"""GradScaler's call-order state machine and each public method, against torch.amp.GradScaler.

A hypothesis state machine drives random call sequences through both scalers
in lockstep; then one test (or a few) per method and behaviour.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from torch import nn

import mixprec
from mixprec.engine import _devices
from mixprec.scaler import ScaleRecord, ScalerStateError

# torch's exception for a misuse -> the exceptions mixprec may raise for it. ScalerStateError is also an
# AssertionError and a RuntimeError, so `except` clauses written for torch keep working; bad *values*
# (update(new_scale=...)) get ValueError, where torch asserts.
_MAPPING: dict[type[BaseException], tuple[type[BaseException], ...]] = {
    AssertionError: (ScalerStateError, ValueError),
    RuntimeError: (ScalerStateError, RuntimeError),
    ValueError: (ValueError,),
    # torch fails reading `.device` off an int: update(new_scale=<int>), or a fused optimizer's kernel handed
    # found_inf=0 when its grads appeared after unscale_() had recorded no inf check.
    AttributeError: (ValueError, ScalerStateError),
}


def _outcome(fn: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _same_kind(ours: BaseException | None, theirs: BaseException | None) -> None:
    assert (ours is None) == (theirs is None), f"mixprec: {ours!r}, torch: {theirs!r}"
    if ours is None or theirs is None:
        return
    if type(theirs) not in _MAPPING:
        raise theirs  # not a scaler error at all: the test itself is broken
    allowed = _MAPPING[type(theirs)]
    assert type(ours) in allowed, f"torch raised {theirs!r}; mixprec raised {ours!r}, expected one of {allowed}"
    if type(ours) is ScalerStateError:
        if not isinstance(theirs, AttributeError):  # torch's accident, not an error it means to raise
            assert isinstance(ours, type(theirs)), "code catching torch's exception must catch mixprec's"
        assert "update()" in str(ours), "the message names the required call order"


# ------------------------------------------------------------------ lockstep machine
class _Side:
    def __init__(self, scaler_cls: Any) -> None:
        torch.manual_seed(0)
        self.parts = [nn.Linear(3, 2), nn.Linear(2, 2)]
        self.optimizers = [
            torch.optim.SGD(self.parts[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(self.parts[1].parameters(), lr=0.1, fused=True),  # _step_supports_amp_scaling
        ]
        self.scaler_cls = scaler_cls
        self.scaler = scaler_cls("cpu", init_scale=2.0**4, growth_interval=2)

    def params(self) -> list[torch.Tensor]:
        return [p for part in self.parts for p in part.parameters()]


class LockstepMachine(RuleBasedStateMachine):
    """Both scalers see the same calls; they must raise alike and hold the same state."""

    def __init__(self) -> None:
        super().__init__()
        self.ours = _Side(mixprec.GradScaler)
        self.theirs = _Side(torch.amp.GradScaler)
        self.skipped: list[bool] = []  # this iteration's skips, as torch's own bookkeeping tells them

    def both(self, call: Any) -> bool:
        """Call on both sides; True if neither raised."""
        _, ours = _outcome(lambda: call(self.ours))
        _, theirs = _outcome(lambda: call(self.theirs))
        _same_kind(ours, theirs)
        return ours is None

    def updated(self) -> None:
        assert self.ours.scaler.last_step_skipped is (any(self.skipped) if self.skipped else None)
        self.skipped = []

    @rule(x=st.floats(-4, 4), plant=st.sampled_from([None, None, "inf", "-inf", "nan"]), part=st.integers(0, 1))
    def scale_and_backward(self, x: float, plant: str | None, part: int) -> None:
        def call(side: _Side) -> None:
            loss = side.parts[1](torch.tanh(side.parts[0](torch.full((1, 3), x)))).sum()
            side.scaler.scale(loss).backward()
            if plant is not None:
                side.parts[part].weight.grad.view(-1)[0] = float(plant)

        self.both(call)

    @rule(nested=st.sampled_from(["list", "tuple", "dict"]))
    def scale_nested(self, nested: str) -> None:
        def call(side: _Side) -> None:
            loss = side.parts[0](torch.ones(1, 3)).sum()
            # torch maps over a dict's keys (no answer to compare with): a list makes its scale alike.
            kind = "list" if side is self.theirs and nested == "dict" else nested
            outputs = {"list": [loss], "tuple": (loss,), "dict": {"loss": loss}}[kind]
            side.scaler.scale(outputs)

        self.both(call)

    @rule(i=st.integers(0, 1))
    def zero_grad(self, i: int) -> None:
        self.both(lambda side: side.optimizers[i].zero_grad(set_to_none=True))

    @rule(i=st.integers(0, 1))
    def unscale_(self, i: int) -> None:
        self.both(lambda side: side.scaler.unscale_(side.optimizers[i]))

    @rule(i=st.integers(0, 1))
    def step(self, i: int) -> None:
        ok = self.both(lambda side: side.scaler.step(side.optimizers[i]))
        # When a fused optimizer's step raises, torch leaves grad_scale / found_inf set on it (and its next
        # step multiplies by that stale value); mixprec removes them in a `finally`. Clean torch's up.
        assert not hasattr(self.ours.optimizers[i], "grad_scale") and not hasattr(self.ours.optimizers[i], "found_inf")
        for name in ("grad_scale", "found_inf"):
            if hasattr(self.theirs.optimizers[i], name):
                delattr(self.theirs.optimizers[i], name)
        if ok:
            found_inf = self.theirs.scaler._found_inf_per_device(self.theirs.optimizers[i])
            self.skipped.append(sum(v.item() for v in found_inf.values()) > 0)

    @rule(i=st.integers(0, 1))
    def step_with_closure(self, i: int) -> None:
        self.both(lambda side: side.scaler.step(side.optimizers[i], closure=lambda: 0.0))

    @rule()
    def update(self) -> None:
        if self.both(lambda side: side.scaler.update()):
            self.updated()

    @rule(kind=st.sampled_from(["float", "tensor", "int", "two_elements", "requires_grad", "meta"]))
    def update_new_scale(self, kind: str) -> None:
        values = {
            "float": lambda: 8.0,
            "tensor": lambda: torch.tensor(32.0),
            "int": lambda: 8,
            "two_elements": lambda: torch.tensor([1.0, 2.0]),
            "requires_grad": lambda: torch.tensor(2.0, requires_grad=True),
            "meta": lambda: torch.tensor(2.0, device="meta"),
        }
        if self.both(lambda side: side.scaler.update(values[kind]())):
            self.updated()

    @rule()
    def get_scale(self) -> None:
        assert self.ours.scaler.get_scale() == self.theirs.scaler.get_scale()

    @rule(fresh_defaults=st.booleans())
    def state_dict_round_trip(self, fresh_defaults: bool) -> None:
        def call(side: _Side) -> None:
            saved = side.scaler.state_dict()
            fresh = side.scaler_cls("cpu") if fresh_defaults else side.scaler_cls("cpu", init_scale=3.0)
            fresh.load_state_dict(saved)
            side.scaler = fresh

        self.both(call)
        self.skipped = []

    @rule()
    def load_torch_state_dict(self) -> None:
        saved = self.theirs.scaler.state_dict()
        self.both(lambda side: side.scaler.load_state_dict(dict(saved)))

    @rule(deep=st.booleans())
    def pickle_round_trip(self, deep: bool) -> None:
        def call(side: _Side) -> None:
            side.scaler = copy.deepcopy(side.scaler) if deep else pickle.loads(pickle.dumps(side.scaler))

        self.both(call)

    @invariant()
    def same_state(self) -> None:
        ours, theirs = self.ours.scaler.state_dict(), self.theirs.scaler.state_dict()
        assert {k: ours[k] for k in theirs} == theirs
        for p_ours, p_theirs in zip(self.ours.params(), self.theirs.params(), strict=True):
            # NaN: a grad planted after unscale_() is stepped with (by both) without a check.
            torch.testing.assert_close(p_ours, p_theirs, rtol=0, atol=0, equal_nan=True)
            assert (p_ours.grad is None) == (p_theirs.grad is None)
            if p_ours.grad is not None:
                torch.testing.assert_close(p_ours.grad, p_theirs.grad, rtol=0, atol=0, equal_nan=True)


LockstepMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLockstep = LockstepMachine.TestCase


# ------------------------------------------------------------------ helpers
def _setup(scaler: Any, *, n_optimizers: int = 1, dtype: torch.dtype = torch.float32) -> tuple[list[nn.Linear], list]:
    torch.manual_seed(0)
    parts = [nn.Linear(3, 2).to(dtype) for _ in range(n_optimizers)]
    optimizers = [torch.optim.SGD(part.parameters(), lr=0.1) for part in parts]
    return parts, optimizers


def _backward(scaler: Any, parts: list[nn.Linear], inf_in: int | None = None) -> None:
    loss = sum(part(torch.ones(1, 3, dtype=part.weight.dtype)).float().sum() for part in parts)
    scaler.scale(loss).backward()
    if inf_in is not None:
        parts[inf_in].weight.grad.view(-1)[0] = float("inf")


def _iteration(scaler: Any, parts: list[nn.Linear], optimizers: list, inf_in: int | None = None) -> None:
    for opt in optimizers:
        opt.zero_grad()
    _backward(scaler, parts, inf_in)
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()


def _train_a_little(scaler: Any) -> tuple[Any, ...]:
    """Three iterations (the second with an inf): what the scaler and the parameters end with."""
    parts, opts = _setup(scaler)
    for inf_in in (None, 0, None):
        _iteration(scaler, parts, opts, inf_in)
    return bool(scaler.is_enabled()), scaler.get_scale(), [p.detach().clone() for p in parts[0].parameters()]


def _same_training(ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> None:
    assert ours[:2] == theirs[:2]
    assert all(torch.equal(o, t) for o, t in zip(ours[2], theirs[2], strict=True))


# ------------------------------------------------------------------ enabled=False
def test_disabled_scaler_is_a_pass_through() -> None:
    scaler = mixprec.GradScaler("cpu", enabled=False)
    (part,), (opt,) = _setup(scaler)
    loss = part(torch.ones(1, 3)).sum()
    outputs = [loss, {"x": loss}]
    assert scaler.scale(loss) is loss
    assert scaler.scale(outputs) is outputs
    assert scaler.scale("not a tensor") == "not a tensor"
    loss.backward()
    grads = [p.grad.clone() for p in part.parameters()]
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(part.parameters(), grads, strict=True))
    before = [p.detach().clone() for p in part.parameters()]
    assert scaler.step(opt, closure=lambda: 7.0) == 7.0  # closures are fine when disabled, as in torch
    assert not any(torch.equal(p, b) for p, b in zip(part.parameters(), before, strict=True))
    scaler.update()
    scaler.update(4.0)
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    assert not scaler.is_enabled()
    assert scaler.last_step_skipped is None
    assert scaler.history == [] and scaler.scale_events() == []
    assert pickle.loads(pickle.dumps(scaler)).state_dict() == {}
    theirs = torch.amp.GradScaler("cpu", enabled=False)
    assert theirs.get_scale() == scaler.get_scale() and theirs.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"growth_factor": 1.0},
        {"growth_interval": 0},
        {"backoff_factor": 2.0},
        {"init_scale": -1.0},
        {"growth_factor": "2"},
        {"hysteresis": 0},
        {"min_scale": 8.0, "max_scale": 4.0},
        {"allow_fp16_grads": "yes"},
    ],
    ids=repr,
)
def test_disabled_scaler_checks_no_other_argument_like_torch(kwargs: dict[str, Any]) -> None:
    """A run without loss scaling (e.g. bfloat16) may pass settings meant for none: torch ignores them."""
    torch_kwargs = {k: v for k, v in kwargs.items() if k in ("growth_factor", "growth_interval", "backoff_factor",
                                                             "init_scale")}
    theirs = torch.amp.GradScaler("cpu", enabled=False, **torch_kwargs)
    ours = mixprec.GradScaler("cpu", enabled=False, **kwargs)
    assert ours.is_enabled() is theirs.is_enabled() is False
    (part,), (opt,) = _setup(ours)
    loss = part(torch.ones(1, 3)).sum()
    assert ours.scale(loss) is loss
    loss.backward()
    ours.step(opt)
    ours.update()
    assert ours.get_scale() == theirs.get_scale() == 1.0 and ours.state_dict() == theirs.state_dict() == {}
    with pytest.raises((TypeError, ValueError), match=f"Received: {next(iter(kwargs))}="):
        mixprec.GradScaler("cpu", **kwargs)  # enabled, each is checked


class _StepOnly:
    """A thin optimizer wrapper that exposes step() and nothing else."""

    def step(self, *args: Any, **kwargs: Any) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        return "stepped", args, kwargs


@pytest.mark.parametrize("cls", [mixprec.GradScaler, torch.amp.GradScaler])
def test_disabled_scaler_passes_any_object_with_step_through(cls: Any) -> None:
    scaler = cls("cpu", enabled=False)
    assert scaler.unscale_(_StepOnly()) is None
    assert scaler.step(_StepOnly(), 1, closure=None) == ("stepped", (1,), {"closure": None})


def test_disabled_scaler_refuses_an_object_without_step() -> None:
    with pytest.raises(AttributeError):
        torch.amp.GradScaler("cpu", enabled=False).step(object())
    for method in ("step", "unscale_"):
        with pytest.raises(TypeError, match=rf"^GradScaler.{method}\(\) cannot use this optimizer: it has no step\(\)"):
            getattr(mixprec.GradScaler("cpu", enabled=False), method)(object())


@pytest.mark.parametrize("enabled", [1, 0, True, False], ids=repr)
def test_enabled_takes_an_int_like_torch(enabled: Any) -> None:
    """argparse's ``type=int`` gives 1 or 0."""
    kwargs = {"init_scale": 4.0, "growth_interval": 1, "enabled": enabled}
    ours = mixprec.GradScaler("cpu", **kwargs)
    assert ours.is_enabled() is bool(enabled)
    _same_training(_train_a_little(ours), _train_a_little(torch.amp.GradScaler("cpu", **kwargs)))


@pytest.mark.parametrize("bad", ["False", None, 1.0], ids=repr)
def test_enabled_refuses_what_is_not_a_bool_or_an_int(bad: Any) -> None:
    """torch reads these by truth (the string "False" enables it): mixprec refuses them."""
    with pytest.raises(TypeError, match=r"^GradScaler enabled is invalid") as info:
        mixprec.GradScaler("cpu", enabled=bad)
    assert f"Received: enabled={bad!r}" in str(info.value)


# ------------------------------------------------------------------ unavailable device
def _cuda_available(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    """Pretend CUDA is (not) available, whatever this machine has: the test never skips."""
    spec = dataclasses.replace(_devices.DEVICES["cuda"], available=lambda: available)
    monkeypatch.setitem(_devices.DEVICES, "cuda", spec)


@pytest.mark.parametrize("make", [lambda: mixprec.GradScaler("cuda"), lambda: mixprec.cuda.amp.GradScaler()])
def test_unavailable_device_warns_and_disables(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    _cuda_available(monkeypatch, False)
    with pytest.warns(mixprec.AutocastDisabledWarning, match="'cuda' is not available") as record:
        scaler = make()
    assert record[0].filename == __file__, "the warning points at the user's line"
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0


def test_available_device_stays_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_available(monkeypatch, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mixprec.GradScaler("cuda").is_enabled()


def test_explicitly_disabled_unavailable_device_does_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_available(monkeypatch, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not mixprec.GradScaler("cuda", enabled=False).is_enabled()


# ------------------------------------------------------------------ device forms
@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu"), torch.device("cpu", 0)], ids=repr)
def test_device_with_an_index_or_as_torch_device_trains_like_torch(device: Any) -> None:
    kwargs = {"init_scale": 4.0, "growth_interval": 1}
    ours = mixprec.GradScaler(device, **kwargs)
    _same_training(_train_a_little(ours), _train_a_little(torch.amp.GradScaler(device, **kwargs)))
    assert ours._device == "cpu" and "device='cpu'" in repr(ours)
    # update(new_scale) checks the tensor's device type against the scaler's: "cpu" (torch compares it with
    # the string as given, and so refuses a CPU tensor for a GradScaler("cpu:0")).
    ours.update(torch.tensor(8.0))
    assert ours.get_scale() == 8.0


@pytest.mark.parametrize("device", ["cuda:0", torch.device("cuda"), torch.device("cuda", 1)], ids=repr)
@pytest.mark.parametrize("available", [True, False])
def test_cuda_device_forms_act_as_cuda(monkeypatch: pytest.MonkeyPatch, device: Any, available: bool) -> None:
    torch.amp.GradScaler(device)  # torch accepts each form
    _cuda_available(monkeypatch, available)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scaler = mixprec.GradScaler(device)
    assert scaler.is_enabled() is available
    assert [str(w.message) for w in record] == ([] if available else [
        "GradScaler disabled: device 'cuda' is not available on this machine."
    ])
    assert scaler._device == "cuda"


@pytest.mark.parametrize(
    ("bad", "error"),
    [("tpu", ValueError), ("cpu:x", ValueError), ("CPU", ValueError), ("", ValueError), (0, TypeError),
     (None, TypeError), (["cpu"], TypeError)],
    ids=repr,
)
def test_a_bad_device_is_refused_naming_grad_scaler(bad: Any, error: type[Exception]) -> None:
    if isinstance(bad, str):
        with pytest.raises(RuntimeError):
            torch.device(bad)  # not a device torch knows (torch's GradScaler stores it unchecked)
    with pytest.raises(error, match=r"^GradScaler device is invalid") as info:
        mixprec.GradScaler(bad)
    assert f"Received: device={bad!r}" in str(info.value)
    assert "autocast" not in str(info.value)
    with pytest.raises(error, match=r"^GradScaler device is invalid"):
        mixprec.GradScaler(bad, enabled=False)  # the device is checked even when disabled


# ------------------------------------------------------------------ call order
@pytest.mark.parametrize("cls", [mixprec.GradScaler, torch.amp.GradScaler])
def test_closure_raises(cls: Any) -> None:
    scaler = cls("cpu")
    (part,), (opt,) = _setup(scaler)
    _backward(scaler, [part])
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        (["unscale_"], "before scale"),
        (["step"], "before scale"),
        (["update"], "before scale"),
        (["scale", "unscale_", "unscale_"], "already been called"),
        (["scale", "step", "unscale_"], "after step"),
        (["scale", "step", "step"], "already been called"),
        (["scale", "step", "update", "update"], "no inf checks"),
        (["scale_only", "step"], "no inf checks"),
    ],
)
def test_out_of_order_raises_naming_the_order(calls: list[str], match: str) -> None:
    scaler = mixprec.GradScaler("cpu")
    (part,), (opt,) = _setup(scaler)
    with pytest.raises(ScalerStateError, match=match) as info:
        for call in calls:
            if call == "scale":
                _backward(scaler, [part])
            elif call == "scale_only":
                scaler.scale(torch.ones(()))  # no backward: the optimizer has no gradients
            elif call == "update":
                scaler.update()
            else:
                getattr(scaler, call)(opt)
    assert isinstance(info.value, AssertionError) and isinstance(info.value, RuntimeError)
    assert "scale(loss).backward()" in str(info.value) and "update()" in str(info.value)


# ------------------------------------------------------------------ float16 gradients
def test_fp16_grads_refused_with_a_clear_message() -> None:
    scaler = mixprec.GradScaler("cpu")
    (part,), (opt,) = _setup(scaler, dtype=torch.float16)
    _backward(scaler, [part])
    with pytest.raises(ValueError, match="float16 gradients") as info:
        scaler.step(opt)
    assert "allow_fp16_grads=True" in str(info.value)
    theirs = torch.amp.GradScaler("cpu")
    (part,), (opt,) = _setup(theirs, dtype=torch.float16)
    _backward(theirs, [part])
    with pytest.raises(ValueError):
        theirs.step(opt)


def test_fp16_grads_unscaled_when_allowed() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, allow_fp16_grads=True)
    (part,), (opt,) = _setup(scaler, dtype=torch.float16)
    _backward(scaler, [part])
    scaled = part.weight.grad.clone()
    scaler.unscale_(opt)
    assert part.weight.grad.dtype is torch.float16
    assert torch.equal(part.weight.grad, scaled / 4)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped is False


# ------------------------------------------------------------------ scale()
class _Pair(NamedTuple):
    first: Any
    second: Any


def test_scale_nested_outputs_keeps_their_structure() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    a, b, c = torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.tensor(4.0)
    out = scaler.scale([a, (b, {"c": c, "pair": _Pair(a, [c])})])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], dict)
    pair = out[1][1]["pair"]
    assert isinstance(pair, _Pair) and isinstance(pair.second, list)
    assert torch.equal(out[0], a * 8) and torch.equal(out[1][0], b * 8) and torch.equal(out[1][1]["c"], c * 8)
    assert torch.equal(pair.first, a * 8) and torch.equal(pair.second[0], c * 8)


@pytest.mark.parametrize("outputs", [[torch.tensor(1.0), torch.tensor(2.0)], (torch.tensor(1.0), [torch.tensor(3.0)])])
def test_scale_lists_and_tuples_like_torch(outputs: Any) -> None:
    ours = mixprec.GradScaler("cpu", init_scale=3.0).scale(outputs)
    theirs = torch.amp.GradScaler("cpu", init_scale=3.0).scale(outputs)
    assert type(ours) is type(theirs)
    leaves = zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs), strict=True)
    assert all(torch.equal(o, t) for o, t in leaves)


def test_scale_makes_the_scale_lazily_on_the_outputs_device() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=2.0)
    assert scaler._scale is None
    scaler.scale(torch.ones((), device="meta"))
    assert scaler._scale is not None and scaler._scale.device.type == "meta"


@pytest.mark.parametrize("bad", [3.0, None, "loss", [torch.tensor(1.0), 2.0], {"x": object()}])
def test_scale_of_a_non_tensor_raises_value_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="cannot scale this value") as info:
        mixprec.GradScaler("cpu").scale(bad)
    assert "Received: outputs=" in str(info.value)


# ------------------------------------------------------------------ update(new_scale)
def test_update_new_scale_float_and_tensor() -> None:
    scaler = mixprec.GradScaler("cpu")
    (part,), _ = _setup(scaler)
    _backward(scaler, [part])
    scaler.update(128.0)
    assert scaler.get_scale() == 128.0
    new = torch.tensor(256.0)
    scaler.update(new)
    new.fill_(1.0)  # later changes to the tensor do not reach the scaler (torch's documented behaviour)
    assert scaler.get_scale() == 256.0
    assert scaler.history[-1] == ScaleRecord(2, 256.0, False)


@pytest.mark.parametrize(
    "bad",
    [8, "8", torch.tensor([1.0, 2.0]), torch.tensor(2.0, requires_grad=True), torch.tensor(2.0, device="meta")],
    ids=["int", "str", "two_elements", "requires_grad", "other_device"],
)
def test_update_new_scale_bad_value(bad: Any) -> None:
    scaler = mixprec.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=r"update\(new_scale\) is invalid") as info:
        scaler.update(bad)
    assert "Received: new_scale=" in str(info.value)
    assert scaler.get_scale() == 2.0**16


# ------------------------------------------------------------------ getters and setters
@pytest.mark.parametrize(("name", "value"), [("growth_factor", 3.0), ("backoff_factor", 0.25), ("growth_interval", 7)])
def test_getters_and_setters_match_torch(name: str, value: Any) -> None:
    ours, theirs = mixprec.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert getattr(ours, f"get_{name}")() == getattr(theirs, f"get_{name}")()
    for scaler in (ours, theirs):
        getattr(scaler, f"set_{name}")(value)
    assert getattr(ours, f"get_{name}")() == getattr(theirs, f"get_{name}")() == value
    assert ours.state_dict()[name] == value


@pytest.mark.parametrize(
    ("name", "bad", "error"),
    [
        ("growth_factor", 1.0, ValueError),
        ("growth_factor", 0.5, ValueError),
        ("growth_factor", float("nan"), ValueError),
        ("growth_factor", "2", TypeError),
        ("growth_factor", True, TypeError),
        ("backoff_factor", 1.0, ValueError),
        ("backoff_factor", 0.0, ValueError),
        ("backoff_factor", -0.5, ValueError),
        ("growth_interval", 0, ValueError),
        ("growth_interval", -3, ValueError),
        ("growth_interval", 2.5, TypeError),
    ],
)
def test_setters_and_constructor_refuse_bad_values(name: str, bad: Any, error: type[Exception]) -> None:
    scaler = mixprec.GradScaler("cpu")
    before = scaler.state_dict()
    with pytest.raises(error, match=f"GradScaler {name} is invalid") as info:
        getattr(scaler, f"set_{name}")(bad)
    assert f"Received: {name}={bad!r}" in str(info.value)
    assert scaler.state_dict() == before
    with pytest.raises(error, match=f"Received: {name}="):
        mixprec.GradScaler("cpu", **{name: bad})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hysteresis": 0},
        {"min_scale": 0.0},
        {"max_scale": -1.0},
        {"max_scale": float("nan")},
        {"min_scale": 8.0, "max_scale": 4.0},
    ],
)
def test_constructor_refuses_bad_rule_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"Received: {next(iter(kwargs))}="):
        mixprec.GradScaler("cpu", **kwargs)


# ------------------------------------------------------------------ state_dict
_EVERY_FIELD = {
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
    "hysteresis",
    "min_scale",
    "max_scale",
    "_hysteresis_tracker",
}


def test_state_dict_round_trips_every_field() -> None:
    kwargs = {"init_scale": 64.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 5}
    scaler = mixprec.GradScaler("cpu", **kwargs, hysteresis=3, min_scale=2.0, max_scale=1e6)
    parts, opts = _setup(scaler)
    for inf_in in (None, None, 0):  # growth tracker reset by the inf, hysteresis tracker 3 -> 2
        _iteration(scaler, parts, opts, inf_in)
    _iteration(scaler, parts, opts)
    saved = scaler.state_dict()
    assert set(saved) == _EVERY_FIELD
    assert saved == {
        "scale": 64.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 5,
        "_growth_tracker": 1,
        "hysteresis": 3,
        "min_scale": 2.0,
        "max_scale": 1e6,
        "_hysteresis_tracker": 2,
    }
    fresh = mixprec.GradScaler("cpu")
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    # And it behaves alike from here: two infs in a row use up the hysteresis, the scale backs off once.
    for other in (scaler, fresh):
        for inf_in in (0, 0, None):
            _iteration(other, parts, opts, inf_in)
    assert fresh.state_dict() == scaler.state_dict()
    assert fresh.get_scale() == 16.0


def test_state_dict_before_the_first_scale() -> None:
    saved = mixprec.GradScaler("cpu", init_scale=32.0, hysteresis=2).state_dict()
    assert saved["scale"] == 32.0 and saved["_growth_tracker"] == 0 and saved["_hysteresis_tracker"] == 2
    fresh = mixprec.GradScaler("cpu")
    fresh.load_state_dict(saved)
    fresh.scale(torch.ones(()))
    assert fresh.state_dict() == saved


def test_load_state_dict_refuses_an_empty_dict_like_torch() -> None:
    for scaler in (mixprec.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        with pytest.raises(RuntimeError, match="state dict is empty"):
            scaler.load_state_dict({})


def test_loads_a_torch_state_dict_and_continues_like_torch() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=16.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=3)
    parts, opts = _setup(theirs)
    for inf_in in (None, 0, None, None, None, None):
        _iteration(theirs, parts, opts, inf_in)
    ours = mixprec.GradScaler("cpu", hysteresis=2, min_scale=1.0)
    ours.load_state_dict(theirs.state_dict())
    saved = ours.state_dict()
    assert {k: saved[k] for k in theirs.state_dict()} == theirs.state_dict()
    # Keys torch does not save keep this scaler's configuration.
    assert (saved["hysteresis"], saved["min_scale"], saved["_hysteresis_tracker"]) == (2, 1.0, 2)
    ours.load_state_dict({**theirs.state_dict(), "hysteresis": 1, "min_scale": None})
    for inf_in in (0, None, None, None, 0):
        _iteration(ours, parts, opts, inf_in)
        _iteration(theirs, parts, opts, inf_in)
        assert ours.get_scale() == theirs.get_scale()
    # And torch loads mixprec's state_dict (it ignores the extra keys).
    again = torch.amp.GradScaler("cpu")
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == theirs.state_dict()


_AS_TENSOR_OR_NUMPY: dict[str, Callable[[Any], Any]] = {
    "tensor": torch.tensor,  # a 0-dim tensor: float32 for a float, int64 for an int
    "tensor64": lambda v: torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int32),
    "numpy": lambda v: np.float32(v) if isinstance(v, float) else np.int64(v),
    "numpy64": lambda v: np.float64(v) if isinstance(v, float) else np.int32(v),
}


@pytest.mark.parametrize("started", [False, True], ids=["before_scale", "after_scale"])
@pytest.mark.parametrize("form", sorted(_AS_TENSOR_OR_NUMPY))
def test_load_state_dict_takes_0_dim_tensors_and_numpy_scalars_like_torch(form: str, started: bool) -> None:
    plain = {"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 2, "_growth_tracker": 1}
    converted = {key: _AS_TENSOR_OR_NUMPY[form](value) for key, value in plain.items()}
    ours, theirs = mixprec.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    runs = {}
    for scaler in (ours, theirs):
        parts, opts = _setup(scaler)
        if started:
            _iteration(scaler, parts, opts)
        scaler.load_state_dict(dict(converted))
        trace = []
        for inf_in in (None, None, 0, None, None):
            _iteration(scaler, parts, opts, inf_in)
            trace.append((scaler.get_scale(), scaler._get_growth_tracker()))
        runs[scaler] = trace
    assert runs[ours] == runs[theirs]
    assert runs[ours][:3] == [(24.0, 0), (24.0, 1), (6.0, 0)]  # the loaded tracker (1) + 1 reaches the interval
    saved = ours.state_dict()  # plain Python numbers again (torch hands the loaded objects back)
    assert all(type(saved[key]) is type(value) for key, value in plain.items())


def test_load_state_dict_takes_mixprec_keys_as_0_dim_tensors() -> None:
    saved = mixprec.GradScaler("cpu", init_scale=64.0, hysteresis=3, min_scale=2.0, max_scale=1e6).state_dict()
    fresh = mixprec.GradScaler("cpu")
    fresh.load_state_dict({k: v if v is None else torch.tensor(v) for k, v in saved.items()})
    assert fresh.state_dict() == saved


@pytest.mark.parametrize(
    ("key", "bad", "error"),
    [
        ("scale", torch.tensor([8.0]), TypeError),  # torch: fill_ / full refuse a 1-dim tensor too
        ("scale", np.array([8.0]), TypeError),
        ("scale", torch.tensor(-8.0), ValueError),
        ("scale", torch.tensor(True), TypeError),
        ("_growth_tracker", torch.tensor(1.5), TypeError),
        ("growth_interval", np.int64(0), ValueError),
    ],
    ids=repr,
)
def test_load_state_dict_checks_a_tensor_or_numpy_value_as_its_number(key: str, bad: Any, error: type) -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    state = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 0}
    with pytest.raises(error, match=f"GradScaler {key} is invalid"):
        scaler.load_state_dict({**state, key: bad})
    assert scaler.get_scale() == 4.0  # nothing loaded


@pytest.mark.parametrize("make", [lambda: torch.amp.GradScaler("cpu"), lambda: mixprec.GradScaler("cpu")],
                         ids=["torch", "mixprec"])  # fmt: skip
def test_load_state_dict_takes_a_scale_that_backed_off_to_zero_like_torch(make: Any) -> None:
    """A run of non-finite steps backs the scale off past float32's smallest, to 0.0 (a diverged run): the
    state_dict either scaler saves then loads into both, and so does an inf scale (update(new_scale=inf))."""
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make()
    for _ in range(200):
        optimizer.zero_grad()
        scaler.scale((param * float("nan")).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    state = scaler.state_dict()
    assert state["scale"] == 0.0
    for target in (torch.amp.GradScaler("cpu"), mixprec.GradScaler("cpu")):
        target.load_state_dict(state)
        assert target.get_scale() == 0.0
        target.load_state_dict({**state, "scale": float("inf")})
        assert target.get_scale() == float("inf")


# ------------------------------------------------------------------ pickling
def test_pickling_refused_mid_iteration_and_fine_after_update() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, hysteresis=2)
    parts, opts = _setup(scaler)
    _backward(scaler, parts)
    scaler.step(opts[0])
    with pytest.raises(ScalerStateError, match="only be pickled at the beginning of an iteration"):
        pickle.dumps(scaler)
    with pytest.raises(AssertionError):  # what torch raises, for code written against it
        copy.deepcopy(scaler)
    scaler.update()
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == scaler.state_dict() == {**restored.state_dict(), "scale": 16.0}
    assert restored.history == scaler.history
    assert restored._scale is None  # made again lazily, as torch does
    _iteration(restored, parts, opts)
    assert restored.get_scale() == 32.0


def test_pickling_before_the_first_scale() -> None:
    restored = pickle.loads(pickle.dumps(mixprec.GradScaler("cpu", init_scale=4.0)))
    assert restored.get_scale() == 4.0


# ------------------------------------------------------------------ skipped steps and the log
def test_last_step_skipped() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    parts, opts = _setup(scaler, n_optimizers=2)
    assert scaler.last_step_skipped is None
    _iteration(scaler, parts, opts)
    assert scaler.last_step_skipped is False
    _iteration(scaler, parts, opts, inf_in=1)  # one optimizer of two skips
    assert scaler.last_step_skipped is True
    _iteration(scaler, parts, opts)
    assert scaler.last_step_skipped is False
    _backward(scaler, parts)
    scaler.unscale_(opts[0])
    scaler.update()  # no step this iteration
    assert scaler.last_step_skipped is None


def test_last_step_skipped_with_a_fused_optimizer() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0)
    torch.manual_seed(0)
    part = nn.Linear(3, 2)
    opt = torch.optim.Adam(part.parameters(), fused=True)
    for inf_in, skipped in ((None, False), (0, True)):
        opt.zero_grad()
        _backward(scaler, [part], inf_in)
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped is skipped


def test_history_and_scale_events() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    parts, opts = _setup(scaler, n_optimizers=2)
    for inf_in in (None, None, 0, None, 1, 1, None, None):
        _iteration(scaler, parts, opts, inf_in)
    _backward(scaler, parts)
    scaler.update(5.0)
    assert scaler.history == [
        ScaleRecord(1, 4.0, False),
        ScaleRecord(2, 8.0, False),
        ScaleRecord(3, 4.0, True),
        ScaleRecord(4, 4.0, False),
        ScaleRecord(5, 2.0, True),
        ScaleRecord(6, 1.0, True),
        ScaleRecord(7, 1.0, False),
        ScaleRecord(8, 2.0, False),
        ScaleRecord(9, 5.0, False),
    ]
    assert scaler.scale_events() == [
        ScaleRecord(2, 8.0, False),
        ScaleRecord(3, 4.0, True),
        ScaleRecord(5, 2.0, True),
        ScaleRecord(6, 1.0, True),
        ScaleRecord(8, 2.0, False),
        ScaleRecord(9, 5.0, False),
    ]


def test_history_grows_past_its_first_buffer() -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=2.0, growth_interval=50)
    parts, opts = _setup(scaler)
    for _ in range(150):
        _iteration(scaler, parts, opts)
    history = scaler.history
    assert [r.step for r in history] == list(range(1, 151))
    assert [r.scale for r in history if r.step in (49, 50, 100, 150)] == [2.0, 4.0, 8.0, 16.0]
    assert [r.step for r in scaler.scale_events()] == [50, 100, 150]


def test_lr_scheduler_steps_only_when_the_step_ran() -> None:
    scaler = mixprec.GradScaler("cpu")
    (part,), (opt,) = _setup(scaler)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns if scheduler.step() runs before any optimizer.step()
        for inf_in in (0, 0, None, 0, None):
            _iteration(scaler, [part], [opt], inf_in)
            if not scaler.last_step_skipped:
                scheduler.step()
    assert scheduler.last_epoch == 2
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**2


def test_lr_scheduler_after_a_skipped_first_step_warns_in_torch() -> None:
    """The negative control: stepping the scheduler regardless makes torch warn."""
    scaler = mixprec.GradScaler("cpu")
    (part,), (opt,) = _setup(scaler)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    _iteration(scaler, [part], [opt], inf_in=0)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        scheduler.step()


# ------------------------------------------------------------------ optimizers that unscale themselves
class _SelfScaling(torch.optim.SGD):
    """An optimizer declaring _step_supports_amp_scaling; records what the scaler hands it."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[tuple[Any, Any]] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        grad_scale, found_inf = getattr(self, "grad_scale", "unset"), getattr(self, "found_inf", "unset")
        self.seen.append(tuple(v.item() if isinstance(v, torch.Tensor) else v for v in (grad_scale, found_inf)))


@pytest.mark.parametrize("case", ["ready", "unscaled", "user_grad_scale", "inf"])
def test_self_scaling_optimizer_gets_grad_scale_and_found_inf_like_torch(case: str) -> None:
    seen = {}
    for cls in (mixprec.GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu", init_scale=8.0)
        torch.manual_seed(0)
        part = nn.Linear(3, 2)
        opt = _SelfScaling(part.parameters())
        _backward(scaler, [part], inf_in=0 if case == "inf" else None)
        if case == "unscaled":
            scaler.unscale_(opt)
        if case == "user_grad_scale":
            opt.grad_scale = torch.tensor(3.0)
        scaler.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        scaler.update()
        seen[cls] = (opt.seen, scaler.get_scale())
    assert seen[mixprec.GradScaler] == seen[torch.amp.GradScaler]


class _Failing(_SelfScaling):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise RuntimeError("the optimizer failed")


def test_self_scaling_optimizer_attributes_removed_when_its_step_raises() -> None:
    """torch leaves grad_scale / found_inf behind (and multiplies by the stale grad_scale next time)."""
    scaler = mixprec.GradScaler("cpu", init_scale=8.0)
    part = nn.Linear(3, 2)
    opt = _Failing(part.parameters())
    _backward(scaler, [part])
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_fused_step_refuses_grads_made_after_an_empty_unscale() -> None:
    """unscale_() saw no grads; backward() made some; they must not be stepped with unchecked."""
    for cls, error in ((mixprec.GradScaler, ScalerStateError), (torch.amp.GradScaler, AttributeError)):
        scaler = cls("cpu")
        torch.manual_seed(0)
        part = nn.Linear(3, 2)
        opt = torch.optim.Adam(part.parameters(), fused=True)
        scaler.scale(torch.ones(()))
        scaler.unscale_(opt)  # no grads yet: nothing recorded
        _backward(scaler, [part])
        with pytest.raises(error):
            scaler.step(opt)


def test_fused_step_without_grads_is_a_no_op_like_torch() -> None:
    for cls in (mixprec.GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu")
        opt = torch.optim.Adam(nn.Linear(3, 2).parameters(), fused=True)
        scaler.scale(torch.ones(()))
        assert scaler.step(opt) is None
        with pytest.raises(AssertionError, match=r"[Nn]o inf checks"):
            scaler.update()


class _ApexStyleSGD(torch.optim.Optimizer):
    """An optimizer on torch's older ``grad_scaler=`` contract (apex's FusedAdam / FusedSGD, capturable): it asks
    the scaler for the inf checks and the scale, unscales by itself and skips its own update on an inf."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.5})

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> str:  # type: ignore[override]
        found_inf = sum(grad_scaler._check_inf_per_device(self).values())
        inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
        if found_inf.item():
            return "skipped"
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad * inv_scale, alpha=-group["lr"])
        return "stepped"


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_grad_scaler_kwarg_optimizer_steps_and_skips_like_torch(unscale_first: bool) -> None:
    runs, skipped = {}, []
    for cls in (mixprec.GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu", init_scale=8.0, growth_interval=2)
        torch.manual_seed(0)
        part = nn.Linear(3, 2)
        opt = _ApexStyleSGD(part.parameters())
        trace = []
        for inf_in in (None, 0, None, None, 0, None):
            opt.zero_grad()
            _backward(scaler, [part], inf_in)
            if unscale_first:
                scaler.unscale_(opt)  # (the optimizer then divides by the scale again, in torch too)
            with pytest.warns(FutureWarning, match="grad_scaler|keyword argument") as record:
                result = scaler.step(opt)
            assert record[0].filename == __file__, "the warning points at the user's line"
            found = {device: flag.item() for device, flag in scaler._found_inf_per_device(opt).items()}
            scaler.update()
            trace.append((result, found, scaler.get_scale()))
            if cls is mixprec.GradScaler:
                skipped.append(scaler.last_step_skipped)
        runs[cls] = trace, [p.detach().clone() for p in part.parameters()]
    (ours, ours_params), (theirs, theirs_params) = runs.values()
    assert ours == theirs
    assert all(torch.equal(o, t) for o, t in zip(ours_params, theirs_params, strict=True))
    assert [result for result, _, _ in ours] == ["stepped", "skipped", "stepped", "stepped", "skipped", "stepped"]
    assert skipped == [result == "skipped" for result, _, _ in ours]  # mixprec records the skips too


def test_grad_scaler_kwarg_optimizer_keeps_hysteresis_and_bounds() -> None:
    """The inf checks the optimizer asks for are the ones update() reads: the rule is the one any optimizer gets."""
    runs = []
    for make in (_ApexStyleSGD, lambda params: torch.optim.SGD(params, lr=0.5)):
        scaler = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
        torch.manual_seed(0)
        part = nn.Linear(3, 2)
        opt = make(part.parameters())
        trace = []
        for inf_in in (None, 0, None, 0, 0, 0, 0, 0, None, None):
            opt.zero_grad()
            _backward(scaler, [part], inf_in)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
            scaler.update()
            trace.append((scaler.get_scale(), scaler.last_step_skipped))
        runs.append((trace, scaler.history, [p.detach().clone() for p in part.parameters()]))
    (trace, history, params), (plain_trace, plain_history, plain_params) = runs
    assert trace == plain_trace and history == plain_history
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    # Hysteresis 2 keeps the scale at the first inf (torch would halve it); the tracker is refilled only by
    # growth, so the next inf backs off, and the ones after stop at min_scale.
    assert [scale for scale, _ in trace] == [8.0, 8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 4.0]
    assert [s for _, s in trace] == [False, True, False, True, True, True, True, True, False, False]


@pytest.mark.parametrize("cls", [mixprec.GradScaler, torch.amp.GradScaler])
def test_grad_scaler_hooks_before_scale_like_torch(cls: Any) -> None:
    scaler = cls("cpu")
    opt = _ApexStyleSGD(nn.Linear(3, 2).parameters())
    assert scaler._get_scale_async() is None
    assert scaler._found_inf_per_device(opt) == {}
    with pytest.raises(AssertionError, match="_check_inf_per_device"):
        scaler._check_inf_per_device(opt)
    scaler.scale(torch.ones(()))
    assert scaler._get_scale_async() is scaler._scale
    assert scaler._check_inf_per_device(opt) == {}  # no gradients yet: nothing to check


def test_several_optimizers_share_one_scale() -> None:
    ours, theirs = mixprec.GradScaler("cpu", growth_interval=1), torch.amp.GradScaler("cpu", growth_interval=1)
    for scaler in (ours, theirs):
        parts, opts = _setup(scaler, n_optimizers=3)
        for inf_in in (None, 2, None, 0):
            _iteration(scaler, parts, opts, inf_in)
    assert ours.get_scale() == theirs.get_scale() == 2.0**16 * 2 * 0.5 * 2 * 0.5


def test_the_skip_flag_reads_as_a_plain_bool() -> None:
    scaler = mixprec.GradScaler("cpu")
    parts, opts = _setup(scaler)
    _iteration(scaler, parts, opts)
    assert type(scaler.last_step_skipped) is bool
    assert collections.Counter(r.skipped for r in scaler.history) == {False: 1}
