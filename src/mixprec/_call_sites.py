"""What each matmul-family call of a model does, by module path, before any training: ``explain(model,
example=...)``'s table (``call_sites``).

The model runs once under the region it will train in, with a ``TorchFunctionMode`` recording each ``linear``,
``mm``, ``matmul`` and ``addmm`` call (and the projections ``F.multi_head_attention_forward`` makes inside,
which a mode sees only as the composite): the module path running it, its GEMM's shape, the format the policy
in force gives it, and why (an fp8 call's recipe, ``fp8.fit``'s refusal, a module policy, or the reason
``choose_fp8_layers`` kept its layer out: ``_fp8_layers.kept_choice``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from mixprec import _autocast
from mixprec._fp8_layers import _table, kept_choice
from mixprec._untouched import untouched
from mixprec.engine import _devices, _fp8, _tables
from mixprec.policies import Category, Policy


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One matmul-family call of a model's run: where (``module`` path), the ``op``, its GEMM ``shape`` (``m x k
    x n``, or the operands' shapes), the format it runs in, and why."""

    module: str
    op: str
    shape: str
    runs_in: str
    reason: str


@dataclasses.dataclass(frozen=True)
class CallSites:
    """The call sites ``explain(model, example=...)`` found, in call order (iterable, indexable); ``str()`` is a
    table."""

    sites: tuple[CallSite, ...]

    def __iter__(self) -> Iterator[CallSite]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def __getitem__(self, index: int) -> CallSite:
        return self.sites[index]

    def __str__(self) -> str:
        return _table(("module", "op", "shape", "runs in", "why"),
                      [(s.module or "(model)", s.op, s.shape, s.runs_in, s.reason) for s in self])  # fmt: skip


_FAMILY = {"linear": "linear", "mm": "mm", "matmul": "matmul", "__matmul__": "matmul", "addmm": "addmm"}


class _Sites(torch.overrides.TorchFunctionMode):
    """Records each matmul-family torch call: the module running it and what the policy in force does."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.stack: list[str] = []
        self.modules: list[torch.nn.Module] = []  # the modules running, outermost first (``stack``'s paths)
        self.sites: list[CallSite] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FAMILY:
            site = self._site(_FAMILY[name], args, kwargs)
            out = func(*args, **kwargs)
            self.sites.append(_ran(site, out))
            return out
        if func is torch.nn.functional.multi_head_attention_forward:
            for call in _projections(args, kwargs):
                site = self._site("linear", call, {})
                self.sites.append(site if _in_fp8(site) else _ran(site, torch.nn.functional.linear(*call)))
        return func(*args, **kwargs)

    def _site(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallSite:
        op = getattr(torch.ops.aten, name).default
        module = self.stack[-1] if self.stack else ""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shape = " x ".join(str(list(t.shape)) for t in tensors)
        device = self.device_type
        if not torch.is_autocast_enabled(device):
            return CallSite(module, name, shape, _dtype(tensors), "autocast is off here")
        policy, dtype = _autocast.get_policy(device), torch.get_autocast_dtype(device)
        entry = _tables.entry_name(policy, op)
        category = policy.table.get(entry) if entry is not None else None
        category = category if category is not None else policy.table.get(name)
        kept = next((c for c in map(kept_choice, reversed(self.modules)) if c is not None), None)
        if category is Category.FP8:
            found = _fp8.fit(op, tuple(args), kwargs, device)
            if not isinstance(found, str):
                x, weight = found.x, found.weight
                gemm = f"{x.numel() // weight.shape[1]} x {weight.shape[1]} x {weight.shape[0]}"
                return CallSite(module, name, gemm, policy.fp8_recipe.forward, f"fp8 ({policy.fp8_recipe.scaling})")
            return CallSite(module, name, shape, _devices.dtype_name(dtype), f"fp8 cannot run it: {found}")
        if category is None:
            return CallSite(module, name, shape, _dtype(tensors), f"policy {policy.name} does not list it")
        why = kept.reason if kept is not None else f"policy {policy.name}: {category.value}"
        runs = _devices.dtype_name(dtype) if category.target == "region" else str(category.target or _dtype(tensors))
        return CallSite(module, name, shape, runs, why)


def _in_fp8(site: CallSite) -> bool:
    return site.reason.startswith("fp8 (")


def _ran(site: CallSite, out: Any) -> CallSite:
    """``site`` with the dtype its call ran in, read off its output (float64 stays float64, ``promote`` takes
    the widest input), except for a GEMM fp8 runs, whose format is its recipe's."""
    if _in_fp8(site) or not isinstance(out, torch.Tensor):
        return site
    return dataclasses.replace(site, runs_in=_devices.dtype_name(out.dtype))


def _projections(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The ``linear`` calls ``F.multi_head_attention_forward(*args, **kwargs)`` makes inside (a mode sees only the
    composite): its in-projections, as torch makes them (self-attention: one packed linear of the query; a key
    that is the value: one of the query and one of the key, by the packed weight's two parts; else, and for
    unbatched inputs, which torch unsqueezes one by one, three), then its out-projection (of a tensor shaped as
    the query)."""
    bound = inspect.signature(torch.nn.functional.multi_head_attention_forward).bind(*args, **kwargs).arguments
    query, key, value = bound["query"], bound["key"], bound["value"]
    if bound.get("use_separate_proj_weight"):
        biases = (None,) * 3 if bound.get("in_proj_bias") is None else bound["in_proj_bias"].chunk(3)
        calls: list[tuple[Any, ...]] = [(query, bound["q_proj_weight"], biases[0]),
                                        (key, bound["k_proj_weight"], biases[1]),
                                        (value, bound["v_proj_weight"], biases[2])]  # fmt: skip
    else:
        weight, bias = bound["in_proj_weight"], bound.get("in_proj_bias")
        width = query.shape[-1]
        batched = query.dim() == 3  # (an unbatched call gets a batch dimension of its own for each: three linears)
        if batched and key is value and query is key:
            calls = [(query, weight, bias)]
        elif batched and key is value:
            halves = (None, None) if bias is None else bias.split([width, 2 * width])
            weights = weight.split([width, 2 * width])
            calls = [(query, weights[0], halves[0]), (key, weights[1], halves[1])]
        else:
            thirds = (None,) * 3 if bias is None else bias.chunk(3)
            calls = [(t, w, b) for t, w, b in zip((query, key, value), weight.chunk(3), thirds, strict=True)]
    return [*calls, (query, bound["out_proj_weight"], bound.get("out_proj_bias"))]


def _dtype(tensors: list[torch.Tensor]) -> str:
    return _devices.dtype_name(tensors[0].dtype) if tensors else "-"


def call_sites(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    policy: Policy,
    dtype: torch.dtype,
) -> CallSites:
    """Run ``model(*args, **kwargs)`` once, without gradients, under ``mixprec.autocast(device_type, dtype,
    policy)`` and list its matmul-family calls (``explain(model, example=...)``). Looking changes nothing: the
    model's buffers (BatchNorm's statistics), the random number generators and fp8's amax histories are put back
    as they were, so training after ``explain`` is training without it."""
    paths = {id(m): p for p, m in model.named_modules()}
    mode = _Sites(device_type)

    def enter(module: torch.nn.Module, *_: Any) -> None:
        mode.stack.append(paths.get(id(module), "?"))
        mode.modules.append(module)

    def leave(module: torch.nn.Module, *_: Any) -> None:
        mode.stack.pop()
        mode.modules.pop()

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter),
                                                   m.register_forward_hook(leave, always_call=True))]  # fmt: skip
    try:
        with untouched(model), _autocast.autocast(device_type, dtype=dtype, policy=policy), torch.no_grad(), mode:
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return CallSites(tuple(mode.sites))
