"""The cast cache: reuse within a region, cleared at the outermost exit, never
used under no_grad, invalidated by in-place updates, never keeping weights alive past their region.

Regions run with ``compute="native"``: the casts counted are those native autocast makes.
The cache is that of mixprec's kernels for the ops a policy changes: most tests here run ``torch.mv``,
which CPU autocast leaves alone, under a policy that makes it ``lower_precision_fp`` (``OWN``). An op a
region runs as native autocast does (every op under the default policy) casts as torch's cache does
whatever kernels earlier regions registered: the tests after ``test_the_rule_...``.
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
def _pristine():
    yield
    engine.reset()


#: ``mv`` cast to the region's dtype: a category the policy changes, so mixprec's kernel and own cache serve it.
OWN = mixprec.policies.CPU.with_ops(lower_precision_fp=["mv"])


def region(dtype=torch.bfloat16, **kwargs):  # type: ignore[no-untyped-def]
    return mixprec.autocast("cpu", dtype=dtype, compute="native", policy=OWN, **kwargs)


def casts_of(fn, *, cache_enabled=True):
    with CountCasts() as counter, region(cache_enabled=cache_enabled):
        fn()
    return counter.casts


def native_casts_of(fn):
    engine.reset()  # torch's own kernels and cache
    with CountCasts() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        fn()
    return counter.casts


W = torch.nn.Parameter(torch.randn(4, 4))
X = torch.randn(4, 4)
V = torch.randn(4)


def three_uses():
    for _ in range(3):
        torch.mv(W, V)


def test_weight_cast_once_per_region_like_native():
    # V (no grad) is cast at every use, W once: 3 + 1; as torch's cache casts mm's X and W.
    assert casts_of(three_uses) == 4
    assert native_casts_of(lambda: [torch.mm(X, W) for _ in range(3)]) == 4


def test_cache_disabled_casts_every_time():
    assert casts_of(three_uses, cache_enabled=False) == 6


def test_cached_cast_reused_by_identity():
    with region():
        first = torch.mv(W, V)
        second = torch.mv(W, V)
    assert torch.equal(first, second)
    assert first.grad_fn.next_functions[1][0] is second.grad_fn.next_functions[1][0]


def test_cache_cleared_when_outermost_region_exits():
    def run():
        with region():
            torch.mv(W, V)

    with CountCasts() as counter:
        run()
        run()
    assert counter.casts == 4
    assert len(_cast.thread_cache()) == 0


def test_cache_lives_across_nested_regions():
    with CountCasts() as counter, region():
        torch.mv(W, V)
        with region(enabled=False):
            pass
        with region():
            torch.mv(W, V)
    assert counter.casts == 3


def test_no_cache_under_no_grad():
    # A cast made under no_grad has no autograd history; reusing it later with
    # grad enabled would silently cut the weight out of the graph.
    with region():
        with torch.no_grad():
            torch.mv(W, V)
        out = torch.mv(W, V)
    out.float().sum().backward()
    assert W.grad is not None and torch.count_nonzero(W.grad) > 0
    W.grad = None


def test_in_place_update_forces_new_cast():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with region():
        before = torch.mv(w, V)
        with torch.no_grad():
            w.mul_(2)
        after = torch.mv(w, V)
    expected = torch.mv(w.detach().bfloat16(), V.bfloat16())
    assert torch.equal(after, expected)
    assert not torch.equal(before, after)


def test_only_leaf_fp32_tensors_that_require_grad_are_cached():
    not_leaf = W * 1
    with CountCasts() as counter, region():
        torch.mv(not_leaf, V)
        torch.mv(not_leaf, V)
    assert counter.casts == 4
    assert len(_cast.thread_cache()) == 0


def test_cache_keeps_no_weight_alive_after_region():
    layer = torch.nn.Linear(4, 4)
    ref = weakref.ref(layer.weight)
    with region():
        layer(X).float().sum().backward()
    del layer
    gc.collect()
    assert ref() is None


def test_a_weight_dropped_in_its_region_lives_until_the_exit_as_natively():
    """The cache's key refers to a weight weakly; its cached copy's autograd graph holds the weight, as torch's
    cache does. So a weight dropped inside a region lives until the region exits, then is freed: natively and
    with mixprec alike."""

    def drop_inside(region, use):  # type: ignore[no-untyped-def]
        with region:
            layer = torch.nn.Linear(4, 4)
            out = use(layer.weight)
            entries = _cast.thread_cache().entries()
            keyed_weakly = [entry[0] is layer.weight for entry in entries]
            weight = weakref.ref(layer.weight)
            del layer, out, entries
            gc.collect()
            alive_inside = weight() is not None
        gc.collect()
        return keyed_weakly, alive_inside, weight() is not None

    keyed_weakly, *mixprec_lifetime = drop_inside(region(), lambda w: torch.mv(w, V))
    assert keyed_weakly == [True]  # one entry, for the weight (held weakly: the lifetimes below)
    engine.reset()  # torch's own kernels and cache
    _, *native_lifetime = drop_inside(torch.autocast("cpu", dtype=torch.bfloat16), lambda w: torch.mm(X, w))
    assert mixprec_lifetime == native_lifetime == [True, False]


def test_fp16_then_bf16_in_nested_regions_do_not_share_entries():
    with region(torch.bfloat16):
        assert torch.mv(W, V).dtype is torch.bfloat16
        with region(torch.float16):
            assert torch.mv(W, V).dtype is torch.float16
        assert torch.mv(W, V).dtype is torch.bfloat16


def test_the_rule_with_every_native_op_as_a_kernel():
    """Both caches through the kernels a policy gives every op (C++ where the extension is built): the own
    cache for an op the region's policy changes (``mv`` under ``OWN``: kept per weight and dtype, skipped under
    no_grad, renewed by an in-place update, cleared at the exit), and the mirror of torch's for every op a
    region runs as native (``linear`` in that same region, every op in a default-policy ``mixprec.autocast``
    and in a plain ``torch.autocast``: used under no_grad too, with a cast that keeps the weight's gradient)."""
    engine.reset()
    _kernels.register("AutocastCPU", "cpu", frozenset(_tables.native("cpu")))
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    w = torch.nn.Parameter(torch.randn(4, 4))

    def own() -> dict[tuple[int, torch.dtype | None, int | None], torch.Tensor]:
        return {(id(t), dtype, version): cast for t, dtype, version, cast in _cast.thread_cache().entries()}

    def mirror() -> set[tuple[int, torch.dtype | None, int | None]]:
        return {(id(t), dtype, version) for t, dtype, version, _ in _cast._torch_cache.entries()}

    with region():
        torch.mv(w, V)
        first = own()
        assert first.keys() == {(id(w), torch.bfloat16, w._version)}
        layer(x)  # linear runs as native under OWN: through the mirror
        assert mirror() == {(id(layer.weight), None, None), (id(layer.bias), None, None)}
        torch.mv(w, V)
        with torch.no_grad():
            torch.mv(w, V)
        assert own().keys() == first.keys() and all(own()[k] is cast for k, cast in first.items())
        with torch.no_grad():
            w.mul_(2)
        torch.mv(w, V)
        renewed = own()
        key = (id(w), torch.bfloat16, w._version)
        assert key in renewed and torch.equal(renewed[key], w.detach().bfloat16())
    assert len(_cast.thread_cache()) == 0 and len(_cast._torch_cache) == 0

    for made in (lambda: mixprec.autocast("cpu", compute="native"), lambda: torch.autocast("cpu")):
        with made():
            with torch.no_grad():
                layer(x)
            assert mirror() == {(id(layer.weight), None, None), (id(layer.bias), None, None)}
            assert all(cast.grad_fn is not None for *_, cast in _cast._torch_cache.entries())  # grad on, as torch
            layer(x).float().sum().backward()
            assert len(_cast.thread_cache()) == 0
        assert len(_cast._torch_cache) == 0
        assert layer.weight.grad is not None and torch.count_nonzero(layer.weight.grad) > 0
        layer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("registered", ["none", "by an emulated region", "every native op"])
def test_a_region_run_as_native_casts_as_torch_whatever_kernels_earlier_regions_registered(registered):
    """A default-policy region with native compute is torch's autocast: the same values and the same errors
    whether or not an earlier region (emulated compute, another policy) left mixprec kernels at the key. Its
    weights' casts follow torch's cache: an in-place update inside the region keeps the stale cast, and a
    nested float16 region meets the bfloat16 cast (torch's mm refuses the mix)."""

    def run(make):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
        with make(torch.bfloat16):
            before = layer(x)
            with torch.no_grad():
                layer.weight.add_(1.0)
            after = layer(x)
        try:
            with make(torch.bfloat16):
                layer(x)
                with make(torch.float16):
                    layer(x)
            nested = "ran"
        except RuntimeError as error:
            nested = type(error).__name__
        return before, after, nested

    engine.reset()
    native = run(lambda dtype: torch.autocast("cpu", dtype=dtype))
    if registered == "by an emulated region":
        with mixprec.autocast("cpu", compute="emulated"):
            torch.nn.Linear(8, 8)(torch.randn(2, 8))
        assert _kernels.registered("cpu")
    elif registered == "every native op":
        _kernels.register("AutocastCPU", "cpu", frozenset(_tables.native("cpu")))
    ours = run(lambda dtype: mixprec.autocast("cpu", dtype=dtype, compute="native"))
    assert torch.equal(native[0], native[1]) and native[2] == "RuntimeError"  # torch's stale cast, its error
    assert torch.equal(ours[0], native[0]) and torch.equal(ours[1], native[1]) and ours[2] == native[2]


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
