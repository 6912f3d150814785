"""Casting eligible tensors, and the cast caches.

Eligibility (the AMP references' rule): a tensor is cast only if it is floating
point, lives on the autocast device, and is not float64.

A ``lower_precision_fp`` cast of a weight (a float32 leaf that requires grad,
not a view) goes through a cache, as native autocast's does. Which cache depends
on where the kernel runs (``cache_for_call``):

* Inside a mixprec region, for an op the region's policy or compute changes,
  mixprec's own (per thread, cleared when the thread's
  outermost region exits), with three corrections to torch's rule: it is skipped
  while grad mode is off, so a copy made under ``no_grad`` (which has no autograd
  history) never reaches a later differentiable call; an entry records the
  weight's version counter, so an in-place update of the weight forces a fresh
  cast; and entries are keyed by weight and dtype.
* Anywhere else (an op the region runs as native autocast does, which a mixprec
  kernel serves only because another region registered one: so it casts as it
  would without that kernel; a plain ``torch.autocast`` region, a checkpoint's
  recompute, ``mixprec.install``), a mirror of torch's own cache, with torch's rules:
  process-wide, keyed by the weight alone, used under ``no_grad`` too (the copy
  is made with grad on, as torch's carries autograd history there), and cleared
  whenever torch clears its own: ``torch.clear_autocast_cache``, which
  ``torch.autocast`` calls as its outermost region exits, is wrapped while
  mixprec has kernels (``follow_torch``). So a plain ``torch.autocast`` region
  casts a weight as often as native does, whatever mixprec did before. An op
  a policy changes or emulates that runs outside any mixprec level (in a
  checkpoint's recompute, under ``install``) keeps its casts there too, but
  keyed by weight and dtype (``cast_exact``), where an op run as native never
  finds them: so a recompute meets the casts its forward met.

Under ``inference_mode`` neither is used, as torch uses none there (its fix for
pytorch#158232): a cast made there is an inference tensor, which no later
differentiable call may use.

Both caches live in the C++ extension once it is built (``use_extension``), so
the C++ kernels keep a weight's cast without entering Python, and the Python
kernels reach the same entries (``ExtensionCache``); without the extension they
are kept here (``OwnCache``, ``MirrorCache``), with the same rules.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from mixprec import _compat
from mixprec.engine import _fp8, _plan, _state

_Tensor = torch.Tensor
_float32 = torch.float32
_float64 = torch.float64
_UNSET: Any = object()  # cast_call: the cache not looked up yet
is_eligible = _plan.eligible_tensor  # whether autocast may cast a tensor in a region on a device type


class OwnCache(dict[tuple[int, torch.dtype], tuple["weakref.ref[torch.Tensor]", int, torch.Tensor]]):
    """A thread's own cache kept in Python (without the C++ extension): ``(id(weight), dtype)`` -> (a weak
    reference to the weight, its version, its cast)."""

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(weight), dtype)
        hit = self.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        out = to(weight, dtype)
        self[key] = (weakref.ref(weight), weight._version, out)
        return out

    def entries(self) -> list[Entry]:
        return [(ref(), dtype, version, cast) for (_, dtype), (ref, version, cast) in self.items()]


class MirrorCache(dict[tuple[int, "torch.dtype | None"], tuple["weakref.ref[torch.Tensor]", torch.Tensor]]):
    """The mirror of torch's cache kept in Python (without the C++ extension): ``(id(weight), None)`` -> (a
    weak reference to the weight, its cast), and ``(id(weight), dtype)`` for ``cast_exact``'s entries."""

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """torch's rule: the weight's cast, whatever dtype it was cast to."""
        return self._cast(weight, dtype, None)

    def cast_exact(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's cast to ``dtype`` (kept apart from ``cast``'s)."""
        return self._cast(weight, dtype, dtype)

    def _cast(self, weight: torch.Tensor, dtype: torch.dtype, keyed: torch.dtype | None) -> torch.Tensor:
        key = (id(weight), keyed)
        found = self.get(key)
        if found is not None and found[0]() is weight:
            return found[1]
        if torch.is_grad_enabled():
            out = to(weight, dtype)
        else:
            with torch.enable_grad():
                out = to(weight, dtype)
        self[key] = (weakref.ref(weight), out)
        return out

    def entries(self) -> list[Entry]:
        return [(ref(), keyed, None, cast) for (_, keyed), (ref, cast) in self.items()]


class ExtensionCache:
    """One of the C++ extension's caches (``_fastpath.cpp``), which both kinds of kernel use once it is built:
    ``cast``, ``entries``, ``clear`` and ``len`` as the Python caches'. The own cache is the calling thread's."""

    def __init__(self, module: Any, which: str) -> None:
        self.cast = getattr(module, f"cast_{which}")
        self.cast_exact = module.cast_exact if which == "mirror" else self.cast  # (the mirror's)
        self.entries = getattr(module, f"{which}_entries")
        self.clear = getattr(module, f"{which}_clear")
        self._size = getattr(module, f"{which}_size")

    def __len__(self) -> int:
        return int(self._size())


#: A cache entry as ``entries()`` lists it: (the weight, or None once it is gone; the dtype it was cast to, or
#: None in the mirror but for its exact entries; the weight's version then, or None in the mirror; the cast).
Entry = tuple["torch.Tensor | None", "torch.dtype | None", "int | None", torch.Tensor]


class Exact:
    """The mirror's entries keyed by weight and dtype, as a cache to cast through (``cast_exact``)."""

    def __init__(self, mirror: MirrorCache | ExtensionCache) -> None:
        self.cast = mirror.cast_exact


Cache = OwnCache | MirrorCache | ExtensionCache | Exact

#: The mirror of torch's cache (process-wide); the C++ extension's once it is built (``use_extension``).
_torch_cache: MirrorCache | ExtensionCache = MirrorCache()
_exact = Exact(_torch_cache)
_own: ExtensionCache | None = None  # the C++ extension's own caches (per thread), once it is built
_extension: Any = None
_torch_clear = torch._C.clear_autocast_cache  # torch's own
_follow_lock = threading.Lock()


def use_extension(module: Any) -> None:
    """Keep the casts in the C++ extension's caches from now on, for both kinds of kernel (``_fastpath``
    calls this once it is built, before any C++ kernel exists). What the Python caches held is dropped."""
    global _torch_cache, _own, _extension, _exact
    _torch_cache.clear()
    if _state._state.cache is not None:
        _state._state.cache.clear()
    _torch_cache, _own, _extension = ExtensionCache(module, "mirror"), ExtensionCache(module, "own"), module
    _exact = Exact(_torch_cache)
    module.set_in_level(bool(_state._state.frames))


def levels_changed(state: _state.ThreadState) -> None:
    """``state``'s thread opened or closed a level: with none left its own cache goes; the C++ kernels are told
    which cache is the thread's now."""
    if not state.frames:
        if state.cache:
            state.cache.clear()
        if _own is not None:
            _own.clear()
        _fp8.clear_weight_cache()  # (fp8's weight quantisations live as long as the casts: a region)
    if _extension is not None:
        _extension.set_in_level(bool(state.frames))


def clear_autocast_cache() -> None:
    """``torch.clear_autocast_cache``, which also clears mixprec's mirror of torch's cache (see the module)."""
    _torch_clear()
    if _torch_cache:
        _torch_cache.clear()
    _fp8.clear_weight_cache()


clear_autocast_cache.__wrapped__ = _torch_clear  # type: ignore[attr-defined]


def follow_torch(on: bool) -> None:
    """Put ``clear_autocast_cache`` in ``torch.clear_autocast_cache``'s place (on), or torch's own back (off)."""
    with _follow_lock:
        if on and torch.clear_autocast_cache is _torch_clear:
            torch.clear_autocast_cache = clear_autocast_cache
        elif not on and torch.clear_autocast_cache is clear_autocast_cache:
            torch.clear_autocast_cache = _torch_clear
            _torch_cache.clear()


def cache_for_call(torch_rules: bool = False) -> Cache | None:
    """The cache a ``lower_precision_fp`` kernel casts weights through now, or None (see the module);
    ``torch_rules``: the kernel runs its op as native autocast does, so only torch's cache (its mirror) serves."""
    if not torch.is_autocast_cache_enabled() or _compat.tracing():  # a graph casts each once anyway
        return None
    if torch.is_inference_mode_enabled():  # an inference tensor can never serve a later differentiable call
        return None
    if torch_rules:
        return _torch_cache
    if _state._state.frames:
        return thread_cache() if torch.is_grad_enabled() else None
    return _exact


def thread_cache() -> Cache:
    """This thread's own cast cache (cleared when its outermost level closes): the C++ extension's, or one kept
    in the thread's mixprec state without it."""
    if _own is not None:
        return _own
    state = _state._state
    if state.cache is None:
        state.cache = OwnCache()
    cache: OwnCache = state.cache
    return cache


# ``t.bfloat16()`` is ``t.to(torch.bfloat16)`` (the same ``_to_copy``, the same autograd node)
# without ``Tensor.to``'s overload resolution: about 1 us less per cast.
_CAST = {torch.bfloat16: _Tensor.bfloat16, torch.float16: _Tensor.half, torch.float32: _Tensor.float}


def to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, by the cheapest call that makes it."""
    method = _CAST.get(dtype)
    return t.to(dtype) if method is None else method(t)


def is_weight_when_run(t: torch.Tensor) -> bool:
    """``is_weight`` as a rewritten graph's code asks it of the tensor it gets (``graph._casts``): under dynamo,
    which cannot trace ``Tensor._is_view``, a float32 leaf that requires grad (it cannot tell the one leaf view
    that requires grad: ``w.detach().requires_grad_()``)."""
    if _compat.tracing():
        return t.dtype is _float32 and t.requires_grad and t.is_leaf
    return is_weight(t)


def is_weight(t: torch.Tensor) -> bool:
    """Whether autocast keeps ``t``'s casts for reuse (torch's cache rule): a float32 leaf that requires grad and
    is not a view. (``cast_call`` writes it out, the hot path; the graph pass asks it of a node's value.)"""
    return t.dtype is _float32 and t.requires_grad and t.is_leaf and not t._is_view()


def cast_tensor(t: torch.Tensor, dtype: torch.dtype, device_type: str, cache: Cache | None) -> torch.Tensor:
    """Cast one tensor if eligible; weights (``is_weight``) go through the cache."""
    if t.dtype is dtype or not is_eligible(t, device_type):
        return t
    if cache is not None and is_weight(t):
        return cache.cast(t, dtype)
    method = _CAST.get(dtype)  # (``to``, written out: the path of most casts)
    return t.to(dtype) if method is None else method(t)


def cast_weight(weight: torch.Tensor, dtype: torch.dtype, torch_rules: bool = False) -> torch.Tensor:
    """A weight's cast as ``cast_call`` makes it for a cached target: through ``cache_for_call()``'s cache, or
    plainly without one. The C++ kernels (``_fastpath.cpp``'s ``cast_cached``) make the same choice over the
    same caches for a call in forward; ``tests/test_fastpath.py`` holds them to this."""
    cache = cache_for_call(torch_rules)
    return to(weight, dtype) if cache is None else cache.cast(weight, dtype)


def cast_value(value: Any, dtype: torch.dtype, device_type: str, cache: Cache | None) -> Any:
    """Cast a tensor argument, or the tensors of a list/tuple argument (a TensorList)."""
    if isinstance(value, _Tensor):
        return cast_tensor(value, dtype, device_type, cache)
    if type(value) in (list, tuple) and any(isinstance(v, _Tensor) for v in value):
        return type(value)([cast_tensor(v, dtype, device_type, cache) if isinstance(v, _Tensor) else v for v in value])
    return value


_SEQUENCES = (list, tuple)


#: Whether a call's arguments are cast last to first, as torch's kernels cast them (``_compat``).
_reversed = _compat.native_casts_reversed


def cast_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    device_type: str,
    cached: bool,
    torch_rules: bool = False,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast every eligible tensor among a call's arguments; weights through ``cache_for_call(torch_rules)``'s
    cache if ``cached`` (the target format keeps weights' casts).

    The kernels' hot path: ``cast_tensor`` written out for a call's positional tensors, and the cache looked up
    only when a weight is met. Eligibility is ``_plan.eligible_tensor``'s, written out (a test holds them equal).

    The casts are made in torch's kernels' order (``_compat.native_casts_reversed``: the schema's last argument
    first, where torch's compiler evaluates so; a list's tensors first to last), so autograd sums a tensor's
    gradients in native's order.
    """
    cache: Any = _UNSET if cached else None
    cpu = device_type == "cpu"
    method = _CAST.get(dtype)
    backwards = _reversed()
    if kwargs and backwards:  # (keyword-only arguments come last in a schema: first, last to first)
        cache = cache_for_call(torch_rules) if cache is _UNSET else cache
        kwargs = {k: cast_value(kwargs[k], dtype, device_type, cache) for k in reversed(kwargs)}
        kwargs = dict(reversed(kwargs.items()))
    out = []
    for a in reversed(args) if backwards else args:
        if isinstance(a, _Tensor):
            source = a.dtype
            if (
                source is not dtype
                and source.is_floating_point
                and source is not _float64
                and (a.is_cpu if cpu else a.device.type == device_type)
            ):
                if cache is not None and source is _float32 and a.requires_grad and a.is_leaf and not a._is_view():
                    # (``is_weight``, written out)
                    if cache is _UNSET:
                        cache = cache_for_call(torch_rules)
                    if cache is not None:  # a weight, and a cache to keep its cast in
                        out.append(cache.cast(a, dtype))
                        continue
                a = a.to(dtype) if method is None else method(a)
        elif type(a) in _SEQUENCES:
            if cache is _UNSET:
                cache = cache_for_call(torch_rules)
            a = cast_value(a, dtype, device_type, cache)
        out.append(a)
    if backwards:
        out.reverse()
    elif kwargs:
        if cache is _UNSET:
            cache = cache_for_call(torch_rules)
        kwargs = {k: cast_value(v, dtype, device_type, cache) for k, v in kwargs.items()}
    return tuple(out), kwargs


def iter_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The tensors among a call's arguments, including those inside list/tuple arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            yield value
        elif type(value) in (list, tuple):
            for v in value:
                if isinstance(v, _Tensor):
                    yield v


def cast_tree(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    """Cast the eligible tensors in a function's argument to ``dtype``, as torch's ``custom_fwd(cast_inputs=)``
    does, without touching anything else.

    Tensors are cast where they are the argument or sit (at any depth) in a list, tuple or mapping (their
    subclasses too: an ``OrderedDict``, a Hugging Face ``ModelOutput``, a namedtuple). Such a container is
    rebuilt only if something inside it was cast, as its own type where it can be (a copy with the cast
    values, where torch's gives a plain dict), so an argument with nothing to cast is passed on as the same
    object (an in-place append to a list argument stays visible to the caller). Every other object (a cache
    object, a generator, a string) is passed on untouched, where torch's would turn an iterable into a generator.
    """
    if isinstance(value, _Tensor):
        return value.to(dtype) if value.dtype is not dtype and is_eligible(value, device_type) else value
    kind = type(value)
    if kind is dict or (kind is not list and kind is not tuple and isinstance(value, Mapping)):
        cast = {k: cast_tree(v, device_type, dtype) for k, v in value.items()}
        if all(cast[k] is v for k, v in value.items()):
            return value
        if kind is dict or not isinstance(value, MutableMapping):
            return cast  # (a read-only mapping: a dict, as torch's)
        rebuilt = copy.copy(value)
        for k, v in cast.items():
            rebuilt[k] = v
        return rebuilt
    if isinstance(value, (list, tuple)):
        items = [cast_tree(v, device_type, dtype) for v in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if kind is list or kind is tuple:
            return kind(items)
        if hasattr(value, "_fields"):
            return kind(*items)  # a namedtuple
        if isinstance(value, list):
            copied = copy.copy(value)
            copied[:] = items
            return copied
        return kind(items)
    return value
