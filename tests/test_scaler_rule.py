"""The loss-scale update rule: hysteresis, min_scale and max_scale against a plain-Python model.

The model below is the pseudocode of ``mixprec/scaler/_rule.py``'s docstring,
with float32 rounding made explicit. Hypothesis draws the parameters and the
found_inf sequences; every step of the trajectory (scale and both trackers)
must match, through ``ScaleRule.apply`` and through a whole GradScaler. With
hysteresis 1 and no bounds, the rule's own tensor path must also match torch's
fused kernel ``torch._amp_update_scale_`` bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.scaler._rule import ScaleRule


def f32(x: float) -> float:
    """Round a Python float (double) to the nearest float32, as a C cast does."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:  # rounds past FLT_MAX
        return math.copysign(math.inf, x)


@dataclasses.dataclass
class Model:
    """The rule of _rule.py's docstring, in plain Python."""

    rule: ScaleRule
    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int | None = None

    def __post_init__(self) -> None:
        if self.hysteresis_tracker is None:
            self.hysteresis_tracker = self.rule.hysteresis

    def update(self, found_inf: bool) -> None:
        rule = self.rule
        assert self.hysteresis_tracker is not None
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                backed_off = f32(self.scale * rule.backoff_factor)
                if rule.min_scale is not None:  # bounded, and never up (a scale already below the bound stays)
                    backed_off = min(f32(max(backed_off, rule.min_scale)), self.scale)
                self.scale = backed_off
        else:
            self.growth_tracker += 1
            if self.growth_tracker == rule.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = rule.hysteresis
                grown = f32(self.scale * rule.growth_factor)
                if math.isfinite(grown):  # bounded, and never down (a scale already above the bound stays)
                    self.scale = grown if rule.max_scale is None else max(f32(min(grown, rule.max_scale)), self.scale)

    def state(self) -> tuple[float, int, int | None]:
        return (self.scale, self.growth_tracker, self.hysteresis_tracker)


def _tensors(scale: float, growth_tracker: int, hysteresis_tracker: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(scale, dtype=torch.float32),
        torch.tensor(growth_tracker, dtype=torch.int32),
        torch.tensor(hysteresis_tracker, dtype=torch.int32),
    )


# ------------------------------------------------------------------ strategies
_scales = st.floats(1e-30, 3e38).map(f32)
_growth = st.one_of(st.sampled_from([2.0, 3.0, 1.5, 10.0]), st.floats(1.0, 1e3, exclude_min=True))
_backoff = st.one_of(st.sampled_from([0.5, 0.3, 0.25]), st.floats(1e-3, 1.0, exclude_min=True, exclude_max=True))


@st.composite
def _rules(draw: st.DrawFn) -> ScaleRule:
    min_scale = draw(st.one_of(st.none(), _scales))
    max_scale = draw(st.one_of(st.none(), _scales))
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        min_scale, max_scale = max_scale, min_scale
    return ScaleRule(
        growth_factor=draw(_growth),
        backoff_factor=draw(_backoff),
        growth_interval=draw(st.integers(1, 5)),
        hysteresis=draw(st.integers(1, 4)),
        min_scale=min_scale,
        max_scale=max_scale,
    )


_found_infs = st.lists(st.booleans(), min_size=1, max_size=60)


# ------------------------------------------------------------------ the rule against the model
@settings(max_examples=300, deadline=None)
@given(rule=_rules(), init=_scales, found_infs=_found_infs, data=st.data())
def test_rule_follows_the_model_step_by_step(
    rule: ScaleRule, init: float, found_infs: list[bool], data: st.DataObject
) -> None:
    # Start anywhere a run (or a loaded state_dict) can be: trackers within their ranges.
    growth_tracker = data.draw(st.integers(0, rule.growth_interval - 1), label="growth_tracker")
    hysteresis_tracker = data.draw(st.integers(0, rule.hysteresis), label="hysteresis_tracker")
    model = Model(rule, init, growth_tracker, hysteresis_tracker)
    scale, growth, hysteresis = _tensors(init, growth_tracker, hysteresis_tracker)
    for step, found in enumerate(found_infs):
        rule.apply(scale, growth, hysteresis, torch.tensor(float(found)))
        model.update(found)
        got = (scale.item(), growth.item(), hysteresis.item())
        if rule.is_torch_rule:  # torch's kernel keeps no hysteresis tracker: it stays where it was
            got = (*got[:2], model.hysteresis_tracker)
        assert got == model.state(), f"step {step}, found_inf={found}"


@settings(max_examples=200, deadline=None)
@given(
    growth_factor=_growth,
    backoff_factor=_backoff,
    growth_interval=st.integers(1, 4),
    init=_scales,
    found_infs=_found_infs,
    bound=st.sampled_from([("min_scale", 0.0), ("max_scale", math.inf), ("both", None)]),
)
def test_tensor_path_matches_torch_kernel_bit_for_bit(
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    init: float,
    found_infs: list[bool],
    bound: tuple[str, float | None],
) -> None:
    """A bound that never binds (min 0, max inf) forces mixprec's own tensor path; it must equal torch's kernel."""
    name, _ = bound
    rule = ScaleRule(
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis=1,
        min_scale=0.0 if name in ("min_scale", "both") else None,
        max_scale=math.inf if name in ("max_scale", "both") else None,
    )
    assert not rule.is_torch_rule
    ours = _tensors(init, 0, 1)
    theirs_scale, theirs_growth = torch.tensor(init, dtype=torch.float32), torch.tensor(0, dtype=torch.int32)
    for found in found_infs:
        found_inf = torch.tensor(float(found))
        rule.apply(*ours, found_inf)
        torch._amp_update_scale_(theirs_scale, theirs_growth, found_inf, growth_factor, backoff_factor, growth_interval)
        assert torch.equal(ours[0], theirs_scale) and ours[0].dtype == theirs_scale.dtype
        assert torch.equal(ours[1], theirs_growth) and ours[1].dtype == theirs_growth.dtype
        if found:
            assert ours[2].item() == 0  # hysteresis 1 is used up by every inf


def test_torch_rule_runs_torch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = torch._amp_update_scale_
    monkeypatch.setattr(torch, "_amp_update_scale_", lambda *args: calls.append(args) or kernel(*args))
    ScaleRule(2.0, 0.5, 3).apply(*_tensors(8.0, 0, 1), torch.tensor(1.0))
    ScaleRule(2.0, 0.5, 3, hysteresis=2).apply(*_tensors(8.0, 0, 2), torch.tensor(1.0))
    assert len(calls) == 1


# ------------------------------------------------------------------ Megatron examples, by hand
@pytest.mark.parametrize(
    ("kwargs", "found_infs", "scales"),
    [
        # hysteresis 2: the first inf is tolerated, the second backs off; a growth refills the tracker.
        (
            {"hysteresis": 2, "growth_interval": 2},
            [1, 1, 1, 0, 0, 1, 1],
            [16.0, 8.0, 4.0, 4.0, 8.0, 8.0, 4.0],
        ),
        # Finite steps alone do not refill the hysteresis tracker (Megatron): only a growth does.
        ({"hysteresis": 2, "growth_interval": 3}, [1, 0, 0, 1], [16.0, 16.0, 16.0, 8.0]),
        # min_scale: backoff stops at the bound.
        ({"min_scale": 5.0, "growth_interval": 100}, [1, 1, 1, 1], [8.0, 5.0, 5.0, 5.0]),
        # max_scale: growth stops at the bound.
        ({"max_scale": 40.0, "growth_interval": 1}, [0, 0, 0, 1], [32.0, 40.0, 40.0, 20.0]),
    ],
)
def test_megatron_examples(kwargs: dict, found_infs: list[int], scales: list[float]) -> None:
    scaler = mixprec.GradScaler("cpu", init_scale=16.0, **kwargs)
    assert [_scaler_step(scaler, bool(f)) for f in found_infs] == scales


# ------------------------------------------------------------------ a whole GradScaler against the model
_PART = nn.Linear(2, 1)
_OPT = torch.optim.SGD(_PART.parameters(), lr=0.0)


def _scaler_step(scaler: mixprec.GradScaler, found_inf: bool) -> float:
    _OPT.zero_grad()
    scaler.scale(_PART(torch.ones(1, 2)).sum()).backward()
    if found_inf:
        _PART.weight.grad.view(-1)[0] = float("nan")
    scaler.step(_OPT)
    scaler.update()
    assert scaler.last_step_skipped is found_inf
    return scaler.get_scale()


@settings(max_examples=60, deadline=None)
@given(rule=_rules(), init=st.floats(1.0, 1e6).map(f32), found_infs=st.lists(st.booleans(), min_size=1, max_size=25))
def test_grad_scaler_follows_the_model(rule: ScaleRule, init: float, found_infs: list[bool]) -> None:
    init = min(max(init, rule.min_scale or 0.0), rule.max_scale or math.inf)  # (a start outside them is refused)
    scaler = mixprec.GradScaler(
        "cpu",
        init_scale=init,
        growth_factor=rule.growth_factor,
        backoff_factor=rule.backoff_factor,
        growth_interval=rule.growth_interval,
        hysteresis=rule.hysteresis,
        min_scale=rule.min_scale,
        max_scale=rule.max_scale,
    )
    model = Model(rule, init)
    for step, found in enumerate(found_infs):
        _scaler_step(scaler, found)
        model.update(found)
        state = scaler.state_dict()
        got = (state["scale"], state["_growth_tracker"], state["_hysteresis_tracker"])
        if rule.is_torch_rule:  # torch's kernel keeps no hysteresis tracker
            got = (*got[:2], model.hysteresis_tracker)
        assert got == model.state(), step
    assert [r.scale for r in scaler.history][-1] == model.scale


def test_a_bound_stops_a_move_but_never_reverses_it():
    """An overflow never raises the scale and a growth step never lowers it, even from a scale set past a bound
    (``update(new_scale)``, a loaded state); a starting scale outside the bounds is refused."""
    import mixprec

    with pytest.raises(ValueError, match=r"init_scale.*min_scale, max_scale\] = \[256.0, None\]"):
        mixprec.GradScaler("cpu", init_scale=1.0, min_scale=256.0)
    with pytest.raises(ValueError, match="out of bounds"):
        mixprec.GradScaler("cpu", init_scale=2.0**20, max_scale=4096.0)
    rule = ScaleRule(2.0, 0.5, 1, min_scale=256.0, max_scale=4096.0)
    for start, found, expected in [(8.0, True, 8.0), (512.0, True, 256.0), (2.0**20, False, 2.0**20),
                                   (2048.0, False, 4096.0), (8.0, False, 16.0), (2.0**20, True, 2.0**19)]:  # fmt: skip
        scale, growth, hysteresis = _tensors(start, 0, 1)
        rule.apply(scale, growth, hysteresis, torch.tensor(float(found)))
        assert scale.item() == expected, (start, found)


def test_update_takes_a_one_element_tensor_of_any_shape():
    import mixprec

    scaler = mixprec.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.update(torch.tensor([8.0]))
    assert scaler.get_scale() == 8.0
    scaler.update(torch.tensor([[16.0]]))
    assert scaler.get_scale() == 16.0
