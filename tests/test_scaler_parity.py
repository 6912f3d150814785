"""mixprec.GradScaler against torch.amp.GradScaler on long randomized training runs.

Two identical models train side by side: one under ``mixprec.autocast`` +
``mixprec.GradScaler``, the other under ``torch.autocast`` +
``torch.amp.GradScaler``, both float16 on the CPU. Each iteration follows
torch's AMP examples: gradient accumulation over two micro-batches, a gradient
penalty through ``torch.autograd.grad`` of scaled outputs, ``unscale_`` +
``clip_grad_norm_`` (on random iterations), two optimizers on two sub-models
sharing one loss. Infs and NaNs are planted at random iterations (in one
sub-model's gradients, or by overflowing the float16 forward), and mid-run each
scaler is saved with ``state_dict`` and loaded into a fresh one.

After every iteration the two runs must agree exactly: the scale, which
optimizer skipped its step, and every parameter bit for bit.

mixprec runs with ``compute="native"`` here, so that the comparison with native
autocast holds bit for bit on any machine, whatever ``compute="auto"`` picks on it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

MICRO_BATCHES = 2
BATCH = 4


@dataclasses.dataclass(frozen=True)
class Run:
    """One randomized run; each field is a knob of the training loop."""

    steps: int = 300
    scaler_kwargs: tuple[tuple[str, Any], ...] = (("growth_interval", 8),)
    fused_adam: bool = False
    sparse: str | None = None  # "sparse_adam" or "sgd": sub-model a is an nn.Embedding(sparse=True)
    penalty: bool = True
    plant_rate: float = 0.08
    reload_at: tuple[int, ...] = (97, 211)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one iteration does: its inputs and where (if anywhere) it plants an inf or NaN."""

    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    unscale: bool
    plant: str | None  # "a:inf", "b:nan", ... or "overflow"
    reload: bool


def _plans(run: Run, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    plans = []
    for step in range(run.steps):
        if run.sparse:
            inputs = tuple(torch.randint(0, 40, (BATCH, 6), generator=gen) for _ in range(MICRO_BATCHES))
        else:
            inputs = tuple(torch.randn(BATCH, 16, generator=gen) for _ in range(MICRO_BATCHES))
        targets = tuple(torch.randn(BATCH, 8, generator=gen) for _ in range(MICRO_BATCHES))
        plant = None
        if rng.random() < run.plant_rate:
            kinds = [f"{part}:{value}" for part in "ab" for value in ("inf", "-inf", "nan")]
            plant = rng.choice(kinds if run.sparse else [*kinds, "overflow"])
        plans.append(Plan(inputs, targets, rng.random() < 0.5, plant, step in run.reload_at))
    return plans


class _Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        if sparse:
            self.a: nn.Module = nn.Embedding(40, 16, sparse=True)
        else:
            self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.b = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))
        self.sparse = sparse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.sparse:
            h = h.sum(dim=1)
        return self.b(h)  # type: ignore[no-any-return]


class _Side:
    """One of the two runs: its model, optimizers, scaler and autocast."""

    def __init__(self, run: Run, scaler_cls: Callable[..., Any], autocast: Callable[[], Any]) -> None:
        torch.manual_seed(0)
        self.run = run
        self.model = _Net(sparse=run.sparse is not None)
        self.groups = [list(self.model.a.parameters()), list(self.model.b.parameters())]
        if run.sparse == "sparse_adam":
            opt_a: torch.optim.Optimizer = torch.optim.SparseAdam(self.groups[0], lr=1e-2)
        elif run.sparse == "sgd":
            opt_a = torch.optim.SGD(self.groups[0], lr=1e-2)
        else:
            opt_a = torch.optim.SGD(self.groups[0], lr=1e-2, momentum=0.9)
        opt_b = torch.optim.Adam(self.groups[1], lr=1e-3, fused=run.fused_adam or None)
        self.optimizers = [opt_a, opt_b]
        self.scaler_cls = scaler_cls
        self.scaler = scaler_cls("cpu", **dict(run.scaler_kwargs))
        self.autocast = autocast
        self.stepped: list[list[bool]] = [[], []]  # per optimizer: the pre-hook's "skipped" flags this iteration
        for log, opt in zip(self.stepped, self.optimizers, strict=True):
            opt.register_step_pre_hook(_skip_logger(log))

    def _loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = F.mse_loss(self.model(x).float(), target) / MICRO_BATCHES
        if not self.run.penalty:
            return loss
        # torch's AMP example "Gradient penalty": autograd.grad of the scaled loss, unscaled by hand.
        params = [p for group in self.groups for p in group]
        scaled_grads = torch.autograd.grad(self.scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / self.scaler.get_scale()
        with self.autocast():
            grad_norm = torch.stack([(g * inv_scale).pow(2).sum() for g in scaled_grads]).sum().sqrt()
            return loss + 1e-3 * grad_norm

    def iteration(self, plan: Plan) -> list[bool]:
        """One training iteration; returns per optimizer whether its step was skipped."""
        if plan.reload:
            saved = self.scaler.state_dict()
            self.scaler = self.scaler_cls("cpu")  # default factors: load_state_dict must restore them
            self.scaler.load_state_dict(saved)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for i, (x, target) in enumerate(zip(plan.inputs, plan.targets, strict=True)):
            if plan.plant == "overflow" and i == 1:
                x = x * 1e6  # the float16 matmul overflows to inf
            self.scaler.scale(self._loss(x, target)).backward()
        if plan.plant and plan.plant != "overflow":
            _plant(self.groups["ab".index(plan.plant[0])], float(plan.plant[2:]))
        if plan.unscale:
            for opt, group in zip(self.optimizers, self.groups, strict=True):
                self.scaler.unscale_(opt)
                if not self.run.sparse or group is self.groups[1]:  # clip_grad_norm_ refuses sparse grads
                    torch.nn.utils.clip_grad_norm_(group, max_norm=1.0)
        for log in self.stepped:
            log.clear()
        for opt in self.optimizers:
            self.scaler.step(opt)
        self.scaler.update()
        return [not log or log[0] for log in self.stepped]


def _skip_logger(log: list[bool]) -> Callable[..., None]:
    """A step pre-hook: a fused optimizer runs with found_inf (it skips inside); others run only when not skipped."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        found_inf = getattr(optimizer, "found_inf", None)
        log.append(found_inf is not None and bool(found_inf > 0))

    return hook


def _plant(params: list[nn.Parameter], value: float) -> None:
    grad = next(p.grad for p in params if p.grad is not None)
    target = grad._values() if grad.is_sparse else grad
    target.view(-1)[0] = value


def _mixprec_side(run: Run) -> _Side:
    return _Side(run, mixprec.GradScaler, lambda: mixprec.autocast("cpu", dtype=torch.float16, compute="native"))


def _torch_side(run: Run) -> _Side:
    return _Side(run, torch.amp.GradScaler, lambda: torch.autocast("cpu", dtype=torch.float16))


def _check_lockstep(run: Run, seed: int) -> list[tuple[float, list[bool]]]:
    """Run both sides in lockstep, asserting agreement after each iteration; return the trajectory."""
    ours, theirs = _mixprec_side(run), _torch_side(run)
    trajectory: list[tuple[float, list[bool]]] = []
    segment: list[tuple[float, list[bool]]] = []
    for step, plan in enumerate(_plans(run, seed)):
        if plan.reload:
            _check_history(ours.scaler, segment)
            segment = []
        skipped_ours, skipped_theirs = ours.iteration(plan), theirs.iteration(plan)
        scale_ours, scale_theirs = ours.scaler.get_scale(), theirs.scaler.get_scale()
        where = f"step {step} ({plan})"
        assert skipped_ours == skipped_theirs, where
        assert scale_ours == scale_theirs, where
        assert ours.scaler.last_step_skipped is any(skipped_ours), where
        for (name, p_ours), p_theirs in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
            assert torch.equal(p_ours, p_theirs), f"{where}: parameter {name} differs"
        trajectory.append((scale_ours, skipped_ours))
        segment.append((scale_ours, skipped_ours))
    _check_history(ours.scaler, segment)
    return trajectory


def _check_history(scaler: mixprec.GradScaler, segment: list[tuple[float, list[bool]]]) -> None:
    """The scaler's own log matches what the loop saw since the scaler was made."""
    history = scaler.history
    assert [(r.step, r.scale, r.skipped) for r in history] == [
        (i + 1, scale, any(skipped)) for i, (scale, skipped) in enumerate(segment)
    ]


def _assert_eventful(trajectory: list[tuple[float, list[bool]]]) -> None:
    """The run really exercised the scaler: growth, backoff, partial and full skips."""
    scales = [scale for scale, _ in trajectory]
    grew = any(b > a for a, b in itertools.pairwise(scales))
    backed_off = any(b < a for a, b in itertools.pairwise(scales))
    assert grew and backed_off, scales
    assert any(skipped == [True, False] or skipped == [False, True] for _, skipped in trajectory)
    assert any(skipped == [False, False] for _, skipped in trajectory)


def test_long_run_matches_torch() -> None:
    trajectory = _check_lockstep(Run(), seed=1)
    _assert_eventful(trajectory)


def test_non_default_factors_match_torch() -> None:
    run = Run(steps=200, scaler_kwargs=(("growth_factor", 3.0), ("backoff_factor", 0.3), ("growth_interval", 2)))
    trajectory = _check_lockstep(run, seed=2)
    _assert_eventful(trajectory)
    # 3.0 and 0.3 leave powers of two: the float32 rounding of scale * factor is exercised.
    assert any(torch.tensor(scale).frexp().mantissa.item() != 0.5 for scale, _ in trajectory)


def test_fused_adam_matches_torch() -> None:
    run = Run(steps=200, fused_adam=True)
    assert torch.optim.Adam([nn.Parameter(torch.ones(1))], fused=True)._step_supports_amp_scaling
    _assert_eventful(_check_lockstep(run, seed=3))


@pytest.mark.parametrize("optimizer", ["sparse_adam", "sgd"])
def test_sparse_gradients_match_torch(optimizer: str) -> None:
    run = Run(steps=150, sparse=optimizer, penalty=False, reload_at=(71,))
    _assert_eventful(_check_lockstep(run, seed=4))
