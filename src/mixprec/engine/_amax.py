"""Delayed fp8 scaling: each fp8 call site's amax history, kept per weight, and ``AmaxHistory`` to save it.

A call site is a weight that an fp8 GEMM multiplies (a linear layer's). Its history holds, for the three
tensors the site quantises (row 0 the input, 1 the weight, 2 the incoming gradient), the amax of each of the
last ``recipe.history`` steps. A step ends where the weight changes: its version counter moves (an in-place
update), or any ``torch.optim`` optimizer steps (``optimizer_steps``: FSDP2 writes each step's gathered
weight into the same tensor and keeps its version counter, so the version alone would miss the step)::

    on each call of the site, for each tensor t it quantises:
        if the weight's version, or the process's count of optimizer steps, moved since the site last saw it:
                                                                                  # a new step began
            pending = all_reduce(pending, MAX, group)      if a process group is given
            history = history[1:] + [pending]; pending = 0; filled += 1
        current = amax(t)
        pending[row] = max(pending[row], current)                   if current is finite (an overflow: skipped)
        amax used = max(history[row])  if filled                                  # the delayed scale
                    current                 otherwise (each rank its own)          # the first step: dynamic

The only collective is the roll's, once per site and step, at the site's first call of the step (in forward,
where every rank must call the sites in the same order: each carries its site's place among the model's
parameters, and ranks that meet with different sites raise, ``_agree``): none runs in backward, beside DDP's
and FSDP's own. A call under ``inference_mode`` (an evaluation) takes no site: it scales dynamically, and
neither rolls nor records, so a rank may evaluate alone there (not under a plain ``no_grad``, which training
code holds too: a reentrant checkpoint runs its forward under one, and its recompute must scale as it did).
Within a step the scales do not move, so a checkpoint's recompute (in the same step) quantises exactly as
the forward did: gradients with checkpointing equal those without it. A step is a change of the weight's
``stamp``: its version or the process's optimizer steps. So a weight that nothing changes while no optimizer
steps (a frozen model under evaluation) stays on its first, dynamic scale, while a frozen layer of a model in
training rolls its history with the optimizer's steps like every other. A weight that autograd computes in each
step (a parametrization's) stays on the dynamic scale, with a warning: it is a new tensor at every call, with no
history. Delayed scaling runs
eagerly only: a compiled graph cannot carry the history.
``AmaxHistory(model).state_dict()`` holds plain tensors, by parameter name, that ``torch.load(...,
weights_only=True)`` reads back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from mixprec import _compat, _errors

INPUT, WEIGHT, GRAD = 0, 1, 2

_steps = 0  # torch.optim steps taken in this process since the hook was registered
_hooked = False


def _count(*_: object) -> None:
    global _steps
    _steps += 1


def optimizer_steps() -> int:
    """How many ``torch.optim`` optimizer steps this process has taken (counted from the first fp8 call on: a
    global step post-hook, registered then)."""
    global _hooked
    if not _hooked:
        _compat.register_optimizer_step_post_hook(_count)
        _hooked = True
    return _steps


def stamp(weight: torch.Tensor) -> tuple[int, int]:
    """What changes when a weight may have: its version counter and the process's optimizer steps."""
    return weight._version, optimizer_steps()


@dataclasses.dataclass(eq=False)
class Site:
    """One weight's amax history (see the module)."""

    weight: Any  # a weak reference to the weight
    version: tuple[int, int]  # the weight's ``stamp`` the history is for
    history: torch.Tensor  # float32, 3 x steps: the amaxes of the last steps, oldest first
    pending: torch.Tensor  # float32, 3: this step's largest amaxes
    filled: int = 0  # steps recorded so far (the history holds min(filled, steps) of them)
    group: Any = None  # the process group amaxes agree over, or None
    tag: int = -1  # with a group: the weight's place among its model's parameters, the same on every rank

    def roll(self, version: tuple[int, int]) -> None:
        if version == self.version:
            return
        if self.group is not None:
            self.pending = _agree(self.pending, self.tag, self.group)
        self.history = torch.cat([self.history[:, 1:], self.pending.reshape(3, 1)], dim=1)
        self.pending = torch.zeros_like(self.pending)
        self.filled += 1
        self.version = version

    def amax(self, row: int, current: torch.Tensor) -> torch.Tensor:
        """The amax a tensor of ``row`` is scaled by this step, given its own ``current`` amax (recorded where it
        is finite: an overflow, which the GradScaler skips the step for, leaves no inf or NaN in the history)."""
        current = current.detach().float()
        pending = self.pending[row]
        self.pending[row] = torch.where(current.isfinite(), torch.maximum(pending, current), pending)
        if self.filled:
            steps = min(self.filled, self.history.shape[1])
            return self.history[row, -steps:].amax()
        return current


def _agree(pending: torch.Tensor, tag: int, group: Any) -> torch.Tensor:
    """``pending``'s maximum over the ranks of ``group``, which must all be rolling the site ``tag``: one
    collective, of one size, whatever the site (a rank that ran other layers meets it with another site, and
    every rank raises, where their amaxes would pair up silently)."""
    reduced = torch.cat([pending, torch.tensor([tag, -tag], dtype=pending.dtype, device=pending.device)])
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, group=group)
    if reduced[3] != -reduced[4]:
        raise RuntimeError(
            _errors.message(
                "fp8 delayed scaling: the ranks reduced the amax histories of different call sites",
                "each step's first call of a site agrees its amaxes over the process group, so every rank must run "
                "the same fp8 layers in the same order (a branch taken by some ranks only, DDP's "
                "find_unused_parameters, or a forward on some ranks only breaks that: evaluate those under "
                "torch.inference_mode(), which scales dynamically and runs no collective)",
                received={"sites": (int(-reduced[4]), int(reduced[3]))},
                fix="Make AmaxHistory without process_group (each rank its own histories), keep such layers out of "
                "fp8 (set_module_policy), or use scaling='tensorwise' for them.",
            )
        )
    return reduced[:3].clone()


#: Every site: ``id(weight)`` -> its Site (dropped when the weight is freed).
_sites: dict[int, Site] = {}
#: Process groups given by ``AmaxHistory``: ``id(weight)`` -> (group, the weight's site tag), for sites made
#: later (``_group``: dropped when the weight is freed).
_groups: dict[int, tuple[Any, int]] = {}


def _group(weight: torch.Tensor, group: Any, tag: int) -> None:
    """``weight``'s sites agree over ``group`` as site ``tag``: kept by the weight's id until the weight is freed
    (an id a later tensor reuses must not hand it a group, whose collectives the other ranks would never join)."""
    key = id(weight)
    if key not in _groups:
        weakref.finalize(weight, _groups.pop, key, None)
    _groups[key] = (group, tag)


def site(weight: torch.Tensor, steps: int) -> Site | None:
    """The weight's site (made on first use), rolled to the weight's current version; None for a weight computed
    by the step's autograd graph (``computed``), which is scaled dynamically. Never asked under inference_mode
    (a history made or rolled there would be an inference tensor): a call there scales dynamically (``_fp8``)."""
    if _compat.tracing():
        raise NotImplementedError(
            _errors.message(
                "fp8 with delayed scaling cannot run under torch.compile",
                "its amax history is state a compiled graph cannot carry from step to step",
                received={"scaling": "delayed"},
                fix="Use policy.with_fp8_recipe(scaling='tensorwise') (dynamic: fused by the compiler), or run "
                "delayed scaling eagerly.",
            )
        )
    found = _sites.get(id(weight))
    if found is None or found.weight() is not weight:
        if weight.grad_fn is not None:
            computed()
            return None
        found = _make(weight, steps, stamp(weight))
    elif found.history.shape[1] != steps:
        raise ValueError(
            _errors.message(
                "An fp8 call site's amax history has another length",
                "one weight keeps one history, and the recipe's history says how many steps it holds",
                received={"history": steps},
                expected=f"{int(found.history.shape[1])} steps",
                fix="Use one fp8 recipe for a weight, or call mixprec.engine.reset() to start the histories again.",
            )
        )
    found.roll(stamp(weight))
    return found


def computed() -> None:
    """Warn that a call site's weight is made anew in each step, so it has no history to scale by."""
    _errors.warn(
        _errors.message(
            "fp8 delayed scaling fell back to dynamic scaling at a call site",
            "its weight is computed by autograd in each step (a parametrization such as weight_norm, or an "
            "activation as a matmul's second operand), so no amax history "
            "can follow it from step to step; that site scales by each tensor's own amax",
            fix="To silence this, give those layers a policy with scaling='tensorwise' (set_module_policy), or "
            "keep them out of fp8.",
        ),
        past_torch=True,
    )


def _make(weight: torch.Tensor, steps: int, version: tuple[int, int]) -> Site:
    key = id(weight)

    def forget(_: object) -> None:
        _sites.pop(key, None)
        _groups.pop(key, None)

    history = torch.zeros(3, steps, dtype=torch.float32, device=weight.device)
    made = Site(weakref.ref(weight, forget), version, history, torch.zeros(3, device=weight.device))
    made.group, made.tag = _groups.get(key, (None, -1))
    _sites[key] = made
    if _histories:
        _adopt(weight, made)
    return made


#: Every live ``AmaxHistory``: a site made for a weight FSDP2 gathers (not the parameter the model registers,
#: which ``AmaxHistory`` was given) finds its group and any history loaded before the gather there.
_histories: weakref.WeakSet[AmaxHistory] = weakref.WeakSet()


def _adopt(weight: torch.Tensor, made: Site) -> None:
    for owner in list(_histories):
        for registered, unsharded in _compat.fsdp2_unsharded(owner.model).items():
            if unsharded is weight:
                if owner.group is not None:
                    made.group, made.tag = _groups.get(registered, (owner.group, -1))
                    _group(weight, made.group, made.tag)
                loaded = owner._loaded.pop(registered, None)
                if loaded is not None:
                    made.history, made.pending, made.filled = loaded
                    made.version = (-1, -1)  # (the next call rolls the loaded pending amaxes in)
                return


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Every history as it was before the block, after it: a call made only to look (``explain``) records no
    amax, rolls no history and leaves no site."""
    before = {k: (site, site.version, site.history, site.pending.clone(), site.filled) for k, site in _sites.items()}
    try:
        yield
    finally:
        for key in [key for key, site in _sites.items() if before.get(key, (None,))[0] is not site]:
            del _sites[key]
        for key, (site, version, history, pending, filled) in before.items():
            site.version, site.history, site.pending, site.filled = version, history, pending, filled
            _sites.setdefault(key, site)


def clear() -> None:
    """Drop every history (``mixprec.engine.reset``)."""
    _sites.clear()
    _groups.clear()


class AmaxHistory:
    """The amax histories of a model's fp8 call sites under a delayed recipe: saved and loaded by parameter
    name, and made to agree across ranks.

    Args:
        model: The model whose weights' histories this covers.
        process_group: Where given (a ``torch.distributed`` group, or ``"default"`` for the default one), each
            step's amaxes are reduced to their maximum over its ranks, so every rank scales alike.

    ``state_dict()`` maps ``"<parameter>.amax_history"`` (float32, 3 x steps: input, weight, gradient rows),
    ``".amax_pending"`` (3) and ``".amax_steps"`` (int64) to plain tensors; ``load_state_dict`` puts them back
    (every name must be one of the model's parameters).

    Examples:
        >>> model = torch.nn.Linear(16, 16)
        >>> policy = mixprec.policies.FP8.with_fp8_recipe(scaling="delayed", history=4)
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     _ = model(torch.randn(16, 16))
        >>> sorted(mixprec.AmaxHistory(model).state_dict())
        ['weight.amax_history', 'weight.amax_pending', 'weight.amax_steps']
    """

    def __init__(self, model: torch.nn.Module, process_group: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                _errors.message("AmaxHistory: model has the wrong type", "its parameters name the histories",
                                received={"model": model}, expected="a torch.nn.Module")
            )  # fmt: skip
        if process_group is not None:
            if process_group != "default" and not isinstance(process_group, torch.distributed.ProcessGroup):
                raise TypeError(
                    _errors.message("AmaxHistory: process_group is invalid", "the ranks' amaxes agree over it",
                                    received={"process_group": process_group},
                                    expected="a torch.distributed.ProcessGroup, 'default' or None")
                )  # fmt: skip
            if not torch.distributed.is_initialized():
                raise RuntimeError(
                    _errors.message("AmaxHistory: no process group is initialised",
                                    "amaxes agree over the ranks of an initialised group",
                                    received={"process_group": process_group},
                                    fix="Call torch.distributed.init_process_group first.")
                )  # fmt: skip
            group = None if process_group == "default" else process_group
            group = torch.distributed.group.WORLD if group is None else group
            unsharded = _compat.fsdp2_unsharded(model)
            named = dict(model.named_parameters())
            for tag, name in enumerate(sorted(named)):  # (the same place on every rank: the model's names)
                param = named[name]
                for weight in (param, unsharded.get(id(param))):  # (FSDP2 computes with the one it gathers)
                    if weight is not None:
                        _group(weight, group, tag)
                        if id(weight) in _sites:
                            _sites[id(weight)].group, _sites[id(weight)].tag = group, tag
        self.model = model
        self.group: Any = None if process_group is None else group
        #: ``id(parameter)`` -> a loaded (history, pending, steps) for an FSDP2 parameter not gathered yet.
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        _histories.add(self)

    def _named(self) -> dict[str, tuple[torch.Tensor, Site | None, bool]]:
        """Each parameter by name: the tensor its site is keyed by (FSDP2's gathered one), that site or None, and
        whether that tensor is still to come (an FSDP2 parameter not gathered yet: the parameter stands in)."""
        named: dict[str, tuple[torch.Tensor, Site | None, bool]] = {}
        unsharded = _compat.fsdp2_unsharded(self.model)
        for name, param in self.model.named_parameters():
            gathered = unsharded.get(id(param))
            weight = param if gathered is None else gathered
            found = _sites.get(id(weight))
            alive = found if found is not None and found.weight() is weight else None
            named[name] = (weight, alive, id(param) in unsharded and gathered is None)
        return named

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The histories of the model's call sites that have run, as plain tensors by parameter name."""
        out = {}
        for name, (_, found, _) in self._named().items():
            if found is not None:
                out[f"{name}.amax_history"] = found.history.detach().clone()
                out[f"{name}.amax_pending"] = found.pending.detach().clone()
                out[f"{name}.amax_steps"] = torch.tensor(found.filled, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Put saved histories back: the model's weights scale as they did when saved."""
        if not isinstance(state, dict):
            raise TypeError(
                _errors.message("AmaxHistory.load_state_dict: state is invalid", "it is what state_dict returned",
                                received={"state": state}, expected="a dict of tensors")
            )  # fmt: skip
        named = self._named()
        names = {key.rpartition(".")[0] for key in state}
        for name in sorted(names):
            parts = [f"{name}.{part}" for part in ("amax_history", "amax_pending", "amax_steps")]
            if name not in named or not all(isinstance(state.get(p), torch.Tensor) for p in parts):
                raise ValueError(
                    _errors.message(
                        f"AmaxHistory.load_state_dict: no history for {name!r} can be loaded",
                        "each entry names a parameter of the model and holds its history, pending amaxes and steps",
                        received={"name": name},
                        expected=sorted(named) if name not in named else parts,
                    )
                )
            history, pending, steps = (state[p] for p in parts)
            if history.dim() != 2 or history.shape[0] != 3 or pending.shape != (3,) or steps.dim() != 0:
                raise ValueError(
                    _errors.message(
                        f"AmaxHistory.load_state_dict: the history of {name!r} has the wrong shape",
                        "a history is 3 x steps, its pending amaxes 3 values and its steps one",
                        received={"shapes": (tuple(history.shape), tuple(pending.shape), tuple(steps.shape))},
                        expected="(3, steps), (3,), ()",
                    )
                )
            weight, _, to_come = named[name]
            loaded = (history.detach().float().to(weight.device).clone(),
                      pending.detach().float().to(weight.device).clone(), int(steps))  # fmt: skip
            if to_come:  # (FSDP2's gathered weight does not exist yet: its site takes this when it is made)
                self._loaded[id(weight)] = loaded
                continue
            made = _make(weight, history.shape[1], (-1, -1))  # (the next call rolls the saved pending amaxes in)
            made.history, made.pending, made.filled = loaded
