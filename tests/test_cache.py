"""The cast cache: reuse within a region, cleared at the outermost exit, never
used under no_grad, invalidated by in-place updates, never keeping weights alive past their region.

Regions run with ``compute="native"``: the casts counted are those native autocast makes.
The cache is that of mixprec's kernels: under the default policy torch's own
kernels and cache run, so each test here gives ``aten::mm`` a mixprec kernel
(as a policy that changes it would) and drops it afterwards.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

import mixprec
from _counting import CountCasts
from mixprec import engine
from mixprec.engine import _cast, _fastpath, _kernels, _tables


@pytest.fixture(autouse=True)
def _mm_through_mixprec():
    _kernels.register("AutocastCPU", "cpu", {torch.ops.aten.mm.default})
    yield
    engine.reset()


def casts_of(fn, *, cache_enabled=True):
    with CountCasts() as counter, mixprec.autocast("cpu", cache_enabled=cache_enabled, compute="native"):
        fn()
    return counter.casts


def native_casts_of(fn):
    engine.reset()  # torch's own kernels and cache
    try:
        with CountCasts() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            fn()
    finally:
        _kernels.register("AutocastCPU", "cpu", {torch.ops.aten.mm.default})
    return counter.casts


W = torch.nn.Parameter(torch.randn(4, 4))
X = torch.randn(4, 4)


def three_uses():
    for _ in range(3):
        torch.mm(X, W)


def test_weight_cast_once_per_region_like_native():
    # X (no grad) is cast at every use, W once: 3 + 1.
    assert casts_of(three_uses) == 4
    assert native_casts_of(three_uses) == 4


def test_cache_disabled_casts_every_time():
    assert casts_of(three_uses, cache_enabled=False) == 6


def test_cached_cast_reused_by_identity():
    with mixprec.autocast("cpu", compute="native"):
        first = torch.mm(X, W)
        second = torch.mm(X, W)
    assert torch.equal(first, second)
    assert first.grad_fn.next_functions[1][0] is second.grad_fn.next_functions[1][0]


def test_cache_cleared_when_outermost_region_exits():
    def run():
        with mixprec.autocast("cpu", compute="native"):
            torch.mm(X, W)

    with CountCasts() as counter:
        run()
        run()
    assert counter.casts == 4
    assert len(_cast.thread_cache()) == 0


def test_cache_lives_across_nested_regions():
    with CountCasts() as counter, mixprec.autocast("cpu", compute="native"):
        torch.mm(X, W)
        with mixprec.autocast("cpu", enabled=False, compute="native"):
            pass
        with mixprec.autocast("cpu", compute="native"):
            torch.mm(X, W)
    assert counter.casts == 3


def test_no_cache_under_no_grad():
    # A cast made under no_grad has no autograd history; reusing it later with
    # grad enabled would silently cut the weight out of the graph.
    with mixprec.autocast("cpu", compute="native"):
        with torch.no_grad():
            torch.mm(X, W)
        out = torch.mm(X, W)
    out.float().sum().backward()
    assert W.grad is not None and torch.count_nonzero(W.grad) > 0
    W.grad = None


def test_in_place_update_forces_new_cast():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with mixprec.autocast("cpu", compute="native"):
        before = torch.mm(X, w)
        with torch.no_grad():
            w.mul_(2)
        after = torch.mm(X, w)
    expected = torch.mm(X.bfloat16(), w.detach().bfloat16())
    assert torch.equal(after, expected)
    assert not torch.equal(before, after)


def test_only_leaf_fp32_tensors_that_require_grad_are_cached():
    not_leaf = W * 1
    with CountCasts() as counter, mixprec.autocast("cpu", compute="native"):
        torch.mm(not_leaf, not_leaf)
        torch.mm(not_leaf, not_leaf)
    assert counter.casts == 4
    assert len(_cast.thread_cache()) == 0


def test_cache_keeps_no_weight_alive_after_region():
    layer = torch.nn.Linear(4, 4)
    ref = weakref.ref(layer.weight)
    with mixprec.autocast("cpu", compute="native"):
        layer(X).float().sum().backward()
    del layer
    gc.collect()
    assert ref() is None


def test_a_weight_dropped_in_its_region_lives_until_the_exit_as_natively():
    """The cache's key refers to a weight weakly; its cached copy's autograd graph holds the weight, as torch's
    cache does. So a weight dropped inside a region lives until the region exits, then is freed: natively and
    with mixprec alike."""

    def drop_inside(region):
        with region:
            layer = torch.nn.Linear(4, 4)
            out = torch.mm(X, layer.weight)
            entries = _cast.thread_cache().entries()
            keyed_weakly = [entry[0] is layer.weight for entry in entries]
            weight = weakref.ref(layer.weight)
            del layer, out, entries
            gc.collect()
            alive_inside = weight() is not None
        gc.collect()
        return keyed_weakly, alive_inside, weight() is not None

    keyed_weakly, *mixprec_lifetime = drop_inside(mixprec.autocast("cpu", compute="native"))
    assert keyed_weakly == [True]  # one entry, for the weight (held weakly: the lifetimes below)
    engine.reset()  # torch's own kernels and cache
    _, *native_lifetime = drop_inside(torch.autocast("cpu", dtype=torch.bfloat16))
    assert mixprec_lifetime == native_lifetime == [True, False]


def test_fp16_then_bf16_in_nested_regions_do_not_share_entries():
    with mixprec.autocast("cpu", dtype=torch.bfloat16, compute="native"):
        assert torch.mm(X, W).dtype is torch.bfloat16
        with mixprec.autocast("cpu", dtype=torch.float16, compute="native"):
            assert torch.mm(X, W).dtype is torch.float16
        assert torch.mm(X, W).dtype is torch.bfloat16


def test_the_rule_with_every_native_op_as_a_kernel():
    """Both caches through the kernels a policy gives every op (C++ where the extension is built): the own
    cache in a mixprec region (kept per weight and dtype, skipped under no_grad, renewed by an in-place update,
    cleared at the exit) and the mirror of torch's in a plain ``torch.autocast`` (used under no_grad too, with
    a cast that keeps the weight's gradient)."""
    engine.reset()
    _kernels.register("AutocastCPU", "cpu", frozenset(_tables.native("cpu")))
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def own() -> dict[tuple[int, torch.dtype | None, int | None], torch.Tensor]:
        return {(id(w), dtype, version): cast for w, dtype, version, cast in _cast.thread_cache().entries()}

    with mixprec.autocast("cpu", compute="native"):
        layer(x)
        first = own()
        assert sorted(first, key=str) == sorted(
            [(id(p), torch.bfloat16, p._version) for p in (layer.weight, layer.bias)], key=str
        )
        layer(x)
        with torch.no_grad():
            layer(x)
        assert own().keys() == first.keys() and all(own()[k] is cast for k, cast in first.items())
        assert len(_cast._torch_cache) == 0
        with torch.no_grad():
            layer.weight.mul_(2)
        layer(x)
        renewed = own()
        key = (id(layer.weight), torch.bfloat16, layer.weight._version)
        assert key in renewed and torch.equal(renewed[key], layer.weight.detach().bfloat16())
    assert len(_cast.thread_cache()) == 0

    with torch.autocast("cpu"):
        with torch.no_grad():
            layer(x)
        mirror = _cast._torch_cache.entries()
        assert {(id(w), dtype, version) for w, dtype, version, _ in mirror} == {
            (id(layer.weight), None, None),
            (id(layer.bias), None, None),
        }
        assert all(cast.grad_fn is not None for *_, cast in mirror)  # made with grad on, as torch's
        layer(x).float().sum().backward()
        assert len(_cast.thread_cache()) == 0
    assert len(_cast._torch_cache) == 0
    assert layer.weight.grad is not None and torch.count_nonzero(layer.weight.grad) > 0


def test_the_python_caches_without_the_extension():
    """Without the C++ extension (``MIXPREC_CPP=0``) the caches are kept in Python: this file's tests hold
    them to the same rule, in a process of their own."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not without_the_extension"],
        env={**os.environ, "MIXPREC_CPP": "0"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout


@pytest.mark.parametrize("kernels", ["c++ where they take the call", "python"])
@pytest.mark.parametrize("region", ["torch.autocast", "mixprec.autocast"])
def test_inference_mode_casts_are_never_kept_as_natively(region, kernels):
    """torch keeps no cast made under inference_mode (since its fix for pytorch#158232; torch 2.10 still kept
    them, and its backward below fails): one made there is an inference tensor, which a later differentiable
    call in the same region must not get. With every native op as a mixprec kernel, the results equal native's
    for the inference calls and the differentiable one each run in a region of its own."""
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def inference(make_region):  # type: ignore[no-untyped-def]
        with make_region(), torch.inference_mode():
            return layer(x)

    def differentiable(make_region):  # type: ignore[no-untyped-def]
        layer.zero_grad(set_to_none=True)
        with make_region():
            out = layer(x)
        out.float().sum().backward()
        return out.detach(), layer.weight.grad, layer.bias.grad

    def together(make_region):  # type: ignore[no-untyped-def]
        layer.zero_grad(set_to_none=True)
        with make_region():
            with torch.inference_mode():
                first = layer(x)
            out = layer(x)
            with torch.inference_mode():
                again = layer(x)
        out.float().sum().backward()
        return first, again, out.detach(), layer.weight.grad, layer.bias.grad

    engine.reset()
    plain = lambda: torch.autocast("cpu")  # noqa: E731
    native = (inference(plain), inference(plain), *differentiable(plain))
    _kernels.register("AutocastCPU", "cpu", frozenset(_tables.native("cpu")))
    regions = {"torch.autocast": plain, "mixprec.autocast": lambda: mixprec.autocast("cpu", compute="native")}
    if kernels == "python":
        with _fastpath.suspended():
            got = together(regions[region])
    else:
        got = together(regions[region])
    assert len(_cast.thread_cache()) == 0 and len(_cast._torch_cache) == 0
    for a, b in zip(got, native, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
