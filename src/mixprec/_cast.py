"""Casting eligible tensors, and the cast cache.

Eligibility (the AMP references' rule): a tensor is cast only if it is floating
point, lives on the autocast device, and is not float64.

The cache reuses the low-precision copy of a weight within one outermost
autocast region, as native autocast does, with three corrections:

* it is bypassed while grad mode is off, so a copy made under ``no_grad``
  (which has no autograd history) never reaches a later differentiable call;
* an entry records the weight's version counter: an in-place update of the
  weight forces a fresh cast;
* an entry holds the weight only through a weak reference, and the whole cache
  is dropped when the outermost region exits.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mixprec import _state

_Tensor = torch.Tensor
_float32 = torch.float32
_float64 = torch.float64

CacheEntry = tuple["weakref.ref[torch.Tensor]", int, torch.Tensor]
Cache = dict[tuple[int, torch.dtype], CacheEntry]


def thread_cache() -> Cache:
    """This thread's cast cache (cleared when its outermost region exits; kept in the thread's mixprec state)."""
    cache: Cache = _state._state.cache
    return cache


def is_eligible(t: torch.Tensor, device_type: str) -> bool:
    """Whether autocast may cast ``t`` on ``device_type``."""
    if not t.is_floating_point() or t.dtype is _float64:
        return False
    return t.is_cpu if device_type == "cpu" else t.device.type == device_type


# ``t.bfloat16()`` is ``t.to(torch.bfloat16)`` (the same ``_to_copy``, the same autograd node)
# without ``Tensor.to``'s overload resolution: about 1 us less per cast.
_CAST = {torch.bfloat16: _Tensor.bfloat16, torch.float16: _Tensor.half, torch.float32: _Tensor.float}


def to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, by the cheapest call that makes it."""
    method = _CAST.get(dtype)
    return t.to(dtype) if method is None else method(t)


def cast_tensor(t: torch.Tensor, dtype: torch.dtype, device_type: str, cache: Cache | None) -> torch.Tensor:
    """Cast one tensor if eligible; weights (fp32 leaves requiring grad) go through the cache."""
    source = t.dtype
    if source is dtype or source is _float64 or not t.is_floating_point():
        return t
    if not (t.is_cpu if device_type == "cpu" else t.device.type == device_type):
        return t
    if cache is not None and source is _float32 and t.requires_grad and t.is_leaf and not t._is_view():
        key = (id(t), dtype)
        hit = cache.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        out = to(t, dtype)
        cache[key] = (weakref.ref(t), t._version, out)
        return out
    return to(t, dtype)


def cast_value(value: Any, dtype: torch.dtype, device_type: str, cache: Cache | None) -> Any:
    """Cast a tensor argument, or the tensors of a list/tuple argument (a TensorList)."""
    if isinstance(value, _Tensor):
        return cast_tensor(value, dtype, device_type, cache)
    if type(value) in (list, tuple) and any(isinstance(v, _Tensor) for v in value):
        return type(value)([cast_tensor(v, dtype, device_type, cache) if isinstance(v, _Tensor) else v for v in value])
    return value


def cast_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device_type: str, cache: Cache | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast every eligible tensor among a call's arguments."""
    new_args = tuple([cast_value(a, dtype, device_type, cache) for a in args])
    if kwargs:
        kwargs = {k: cast_value(v, dtype, device_type, cache) for k, v in kwargs.items()}
    return new_args, kwargs


def iter_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The tensors among a call's arguments, including those inside list/tuple arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor):
            yield value
        elif type(value) in (list, tuple):
            for v in value:
                if isinstance(v, _Tensor):
                    yield v
