"""Which layers run in fp8: ``choose_fp8_layers`` builds the common choice from a model (``_call_sites`` lists
what each matmul-family call of a model then does, by module path, before any training).

Algorithm of ``choose_fp8_layers(model, policy)`` (``policy`` runs the matmul family in ``fp8``)::

    layers = the model's linear layers (nn.Linear, Conv1D-style modules with a 2-D weight, and
             nn.MultiheadAttention, whose own forward runs its projections), in order
    for each layer, the first rule that applies keeps it out of fp8, with its reason:
        under a module policy the user set (on it or a parent)    -> left to that policy
        matched by a ``keep`` pattern                              -> kept
        its weight is an nn.Embedding's (tied)                    -> kept
        a mixture-of-experts router (named router, gate, ...)     -> kept
        the first or the last layer                                -> kept
        in or out features not a multiple of 16                    -> kept
        in or out features below ``min_features``                  -> kept (fp8 is slower than bf16 there)
    a kept layer gets set_module_policy(layer, fallback): ``policy`` with its fp8 ops in lower_precision_fp
    every ``keep`` pattern must match a module: one that matches none is an error

The region runs ``policy``; the module policies keep the chosen layers in the region's dtype. Nothing else
changes: ``remove()`` takes the module policies off again.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import typing
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mixprec import _errors, _module
from mixprec._untouched import untouched
from mixprec.engine import _fp8
from mixprec.policies import Category, Policy

#: A layer's last name component that marks a mixture-of-experts router (its logits choose the experts:
#: fp8's error there changes which expert a token goes to). ``gate_proj`` (a SwiGLU MLP's) is not one.
ROUTER_NAMES = frozenset({"router", "gate", "gating", "switch", "wg"})
#: The smallest in and out features of a layer the helper puts in fp8 by default. Below it fp8's quantisation
#: costs more than its GEMM saves: on an H100 the GPT-2 small MLP (768 -> 3072) ran at 0.66x bf16 compiled,
#: the Llama-3-8B one (4096 -> 14336) at 1.33x; torchao's own rule keeps out layers of up to 4096 x 1024.
MIN_FEATURES = 2048


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer's fp8 decision: ``fp8`` True runs it in the policy's fp8 format, else ``reason`` says why not."""

    path: str
    kind: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str


def _linear_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a linear layer: ``nn.Linear``, or a Conv1D-style module (Hugging
    Face's GPT-2) whose 2-D weight is ``in x out`` and whose forward is an addmm."""
    if isinstance(module, torch.nn.MultiheadAttention):  # its forward runs its in and out projections' GEMMs
        return module.embed_dim, module.embed_dim  # itself: the attention is the layer a module policy can keep out
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _attention_projection(path: str, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether ``path`` is an ``nn.MultiheadAttention``'s ``out_proj``, whose forward never runs (the attention's
    own does its GEMM, and is the layer)."""
    parent, _, name = path.rpartition(".")
    return name == "out_proj" and isinstance(modules.get(parent), torch.nn.MultiheadAttention)


def _under_policy(path: str, modules: dict[str, torch.nn.Module]) -> str | None:
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        owner = ".".join(parts[:depth])
        forward = modules[owner].__dict__.get("forward")
        if isinstance(forward, _module.PolicyForward) and forward.policies:
            names = ", ".join(p if isinstance(p, str) else p.name for _, p in forward.policies)
            return f"under the module policy set on {owner or 'the model'} ({names})"
    return None


def _matches(pattern: str, path: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or any(
        fnmatch.fnmatchcase(".".join(path.split(".")[:depth]), pattern) for depth in range(1, path.count(".") + 1)
    )


def _check_keep(keep: object, paths: list[str]) -> tuple[str, ...]:
    if isinstance(keep, str):
        keep = (keep,)
    if not isinstance(keep, Iterable) or not all(isinstance(p, str) and p for p in keep):
        raise TypeError(
            _errors.message("choose_fp8_layers: keep is invalid", "it names the layers to keep out of fp8",
                            received={"keep": keep}, expected="module paths or fnmatch patterns, e.g. ['lm_head']")
        )  # fmt: skip
    patterns = tuple(keep)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
            close = difflib.get_close_matches(pattern, paths, n=3)
            raise ValueError(
                _errors.message(
                    f"choose_fp8_layers: keep pattern {pattern!r} matches no module",
                    "a filter that matches nothing would silently put the layer it meant in fp8",
                    received={"keep": pattern},
                    expected=close or "a path from model.named_modules(), or an fnmatch pattern of them",
                )
            )
    return patterns


def fallback_of(policy: Policy) -> Policy:
    """``policy`` with its fp8 ops in ``lower_precision_fp``: what a layer kept out of fp8 runs."""
    return policy.with_ops(lower_precision_fp=policy.ops(Category.FP8.value))


#: The attribute a layer the helper keeps out holds its ``LayerChoice`` in, for ``call_sites``'s reasons: in the
#: module's ``__dict__`` beside the ``forward`` its policy wraps, so copies (``copy.deepcopy``, pickling) keep it
#: as they keep the policy.
KEPT = "_mixprec_fp8_kept"


def kept_choice(module: torch.nn.Module) -> LayerChoice | None:
    """The choice that kept ``module`` out of fp8, where the helper did (and its policy is still on)."""
    return module.__dict__.get(KEPT)


@dataclasses.dataclass(eq=False)
class Fp8Layers:
    """What ``choose_fp8_layers`` returns: its ``choices`` (one per linear layer), and ``remove()``, which takes
    the module policies it set off again (also on leaving a ``with`` block). ``str()`` is a table."""

    policy: Policy
    fallback: Policy
    choices: tuple[LayerChoice, ...]
    _handles: list[tuple[torch.nn.Module, _module.ModulePolicyHandle]]

    @property
    def fp8(self) -> tuple[str, ...]:
        """The paths of the layers that run in fp8."""
        return tuple(c.path for c in self.choices if c.fp8)

    @property
    def kept(self) -> tuple[str, ...]:
        """The paths of the layers kept out of fp8."""
        return tuple(c.path for c in self.choices if not c.fp8)

    def remove(self) -> None:
        """Take the module policies off; calling it again does nothing."""
        for module, handle in self._handles:
            handle.remove()
            module.__dict__.pop(KEPT, None)
        self._handles.clear()

    def __enter__(self) -> Fp8Layers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __str__(self) -> str:
        rows = [(c.path, c.kind, f"{c.in_features} -> {c.out_features}", self.policy.fp8_recipe.forward
                 if c.fp8 else "region dtype", c.reason) for c in self.choices]  # fmt: skip
        return _table(("layer", "kind", "features", "runs in", "why"), rows)


def choose_fp8_layers(
    model: torch.nn.Module,
    policy: Policy | None = None,
    *,
    keep: Iterable[str] | str = (),
    keep_first_and_last: bool = True,
    min_features: int = MIN_FEATURES,
    example: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> Fp8Layers:
    """Keep the layers where fp8 hurts or loses out of it: set a module policy on each of them.

    fp8 runs every linear layer of ``model`` except the first and last, those whose weight is an embedding's,
    mixture-of-experts routers, layers whose features are not multiples of 16 or below ``min_features``, and
    those ``keep`` names; those run in the region's dtype (``policy`` with its fp8 ops in
    ``lower_precision_fp``). Run the model under ``mixprec.autocast(..., policy=policy)``.

    Args:
        model: The model whose linear layers (``nn.Linear``, Conv1D-style) are chosen.
        policy: The policy the region runs, with ops in ``fp8``; default ``mixprec.policies.FP8``.
        keep: Module paths or fnmatch patterns (``"lm_head"``, ``"*.attn.*"``) of layers, or of modules whose
            layers, to keep out as well. A pattern that matches no module is an error.
        keep_first_and_last: Keep the first and the last linear layer out (the commonest choice). Without
            ``example``, the first and last registered; with it, in the order the model calls them, every layer
            that reads the first one's input (a decoder's q, k and v projections) and the last one's.
        min_features: Keep layers whose in or out features are below this out (fp8 loses there).
        example: Positional inputs of one call of ``model``, run once without gradients to find the order of
            its layers (nothing it changes is kept: buffers, generators, gradients are put back).
        example_kwargs: Keyword inputs of that call.

    Returns:
        An :class:`Fp8Layers` handle: its ``choices`` say what each layer runs in and why; ``remove()``
        takes the module policies off.

    Examples:
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))
        >>> layers = mixprec.choose_fp8_layers(model)
        >>> layers.fp8, layers.kept
        (('1',), ('0', '2'))
        >>> layers.remove()
    """
    _module._check_module("choose_fp8_layers", model)
    policy = _fp8_policy(policy)
    if type(keep_first_and_last) is not bool:
        raise TypeError(
            _errors.message("choose_fp8_layers: keep_first_and_last is invalid", "it is a flag",
                            received={"keep_first_and_last": keep_first_and_last}, expected="True or False")
        )  # fmt: skip
    if type(min_features) is not int or min_features < 0:
        raise ValueError(
            _errors.message("choose_fp8_layers: min_features is invalid", "it is the smallest layer size in fp8",
                            received={"min_features": min_features}, expected="an int >= 0")
        )  # fmt: skip
    _errors.check_type("example", example, tuple, optional=True, what="choose_fp8_layers")
    _errors.check_type("example_kwargs", example_kwargs, dict, optional=True, what="choose_fp8_layers")
    modules = dict(model.named_modules(remove_duplicate=False))
    patterns = _check_keep(keep, list(modules))
    layers = [(path, m, shape) for path, m in modules.items()
              if (shape := _linear_shape(m)) is not None and not _attention_projection(path, modules)]
    embedded = {id(m.weight) for m in modules.values() if isinstance(m, torch.nn.Embedding)}
    ends: set[str] = set()
    if layers and keep_first_and_last:
        if example is None and example_kwargs is None:  # the first and last registered (a shared module: by its
            firsts: dict[int, str] = {}  # first path)
            for path, layer, _ in layers:
                firsts.setdefault(id(layer), path)
            unique = list(firsts.values())
            ends = {unique[0], unique[-1]}
        else:
            ends = _ends_in_call_order(model, layers, example or (), example_kwargs or {})
    # One decision per module, under each of its paths: the first reason one of its paths gives to keep it out.
    reasons: dict[int, str | None] = {}
    for path, layer, (fan_in, fan_out) in layers:
        if reasons.get(id(layer)) is None:
            reasons[id(layer)] = _reason(path, layer, fan_in, fan_out, modules, patterns, embedded, ends, min_features)
    fallback = fallback_of(policy)
    choices, handles = [], []
    for path, layer, (fan_in, fan_out) in layers:
        reason = reasons[id(layer)]
        choice = LayerChoice(path, type(layer).__name__, fan_in, fan_out, reason is None, reason or "fp8")
        choices.append(choice)
        if reason is not None and not reason.startswith("under the module policy") and kept_choice(layer) is None:
            handles.append((layer, _module.set_module_policy(layer, fallback)))
            layer.__dict__[KEPT] = choice
    return Fp8Layers(policy, fallback, tuple(choices), handles)


def _ends_in_call_order(
    model: torch.nn.Module, layers: list[tuple[str, torch.nn.Module, Any]], args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> set[str]:
    """The paths of the first and last layers as ``model(*args, **kwargs)`` calls them: every layer that reads
    the tensor the first call read, and every one that reads the tensor the last call read (a layer shared
    under several paths counts under each)."""
    paths: dict[int, list[str]] = {}
    for path, layer, _ in layers:
        paths.setdefault(id(layer), []).append(path)
    calls: list[tuple[int, tuple[Any, ...]]] = []
    alive: list[Any] = []  # each input kept to the end of the run: no later tensor takes its memory (and key)

    def seen(layer: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
        x = inputs[0] if inputs else None
        alive.append(x)
        # (the data the layer reads, then: a residual stream updated in place, ``h += block(h)``, is other data
        # at each block, the same memory at a new version)
        key = (id(x),) if not isinstance(x, torch.Tensor) else (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype,
                                                                  x._version)  # fmt: skip
        calls.append((id(layer), key))

    hooks = [layer.register_forward_pre_hook(seen) for layer in {id(m): m for _, m, _ in layers}.values()]
    try:
        with untouched(model), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    if not calls:
        return set()
    first, last = calls[0][1], calls[-1][1]
    return {path for layer, key in calls if key in (first, last) for path in paths[layer]}


def _reason(
    path: str,
    layer: torch.nn.Module,
    fan_in: int,
    fan_out: int,
    modules: dict[str, torch.nn.Module],
    patterns: tuple[str, ...],
    embedded: set[int],
    ends: set[str],
    min_features: int,
) -> str | None:
    """Why ``layer`` stays out of fp8, or None: it runs in fp8."""
    owned = _under_policy(path, modules)
    if owned is not None:
        return owned
    matched = next((p for p in patterns if _matches(p, path)), None)
    if matched is not None:
        return f"kept by keep={matched!r}"
    if id(getattr(layer, "weight", None)) in embedded:
        return "its weight is an embedding's (tied)"
    if path.rpartition(".")[2].lower() in ROUTER_NAMES or "router" in type(layer).__name__.lower():
        return "a mixture-of-experts router: its logits choose the experts"
    if path in ends:
        return "the first or last linear layer"
    if fan_in % _fp8.ALIGNMENT or fan_out % _fp8.ALIGNMENT:
        return f"features {fan_in} -> {fan_out} are not multiples of {_fp8.ALIGNMENT}"
    if min(fan_in, fan_out) < min_features:
        return f"features {fan_in} -> {fan_out} below min_features={min_features}: fp8 is slower than bf16 there"
    return None


def _fp8_policy(policy: object) -> Policy:
    if policy is None:
        import mixprec.policies

        policy = mixprec.policies.FP8
    _errors.check_type("policy", policy, Policy, what="choose_fp8_layers")
    policy = typing.cast(Policy, policy)
    if not policy.ops(Category.FP8.value):
        raise ValueError(
            _errors.message(
                f"Policy {policy.name!r} runs no op in fp8",
                "the layers are chosen for a policy whose matmul family is in the fp8 category",
                received={"policy": policy.name},
                fix="Pass mixprec.policies.FP8, or policy.with_ops(fp8=['linear', 'mm', 'addmm', 'matmul']).",
            )
        )
    return policy


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    rows = [header, *rows]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines: Iterator[str] = ("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    return "\n".join(lines)
