"""mixprec's kernels at the Autocast keys: which get registered, when, and what they leave alone."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import mixprec
from mixprec import _compat, engine
from mixprec.engine import _kernels, _state, _tables

CPU = mixprec.policies.CPU
MM = torch.ops.aten.mm.default


@pytest.fixture(autouse=True)
def _fresh_kernels():
    engine.reset()
    yield
    engine.reset()


def test_the_default_policy_with_native_compute_registers_nothing():
    with mixprec.autocast("cpu", compute="native"), mixprec.autocast("cpu", dtype=torch.float16, compute="native"):
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert _kernels.registered("cpu") == frozenset()


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu"])
def test_each_devices_default_policy_needs_no_kernel(device):
    # What lets a region of the default policy with native compute skip mixprec's state (autocast.__enter__).
    setting = _state.make_setting(device, _tables.default_policy(device), False, frozenset())
    assert _kernels.needed(setting) == frozenset()
    assert not _tables.effective(_tables.default_policy(device), device)[1]


def test_an_edited_policy_registers_its_changes_only_once_and_silently():
    policy = CPU.with_ops(fp32=["mm"]).without_ops("cat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "overriding a previously registered kernel" must not reach users
        for _ in range(3):
            with mixprec.autocast("cpu", policy=policy, compute="native"):
                pass
    # every functional overload of mm (mm.default, mm.dtype), and those of cat torch autocasts (a release
    # that has cat.names does not register it)
    native = _tables.native_registrations("AutocastCPU")
    cat = {op for op in _tables.overloads("cat") if _tables.qualified(op) in native}
    # and, as mm's category now differs from linear's, the kernels of the ops torch.func breaks into one
    # another (which refuse under a transform): those torch autocasts on CPU
    group = {op for op in _tables.native("cpu") if op.overloadpacket.__name__ in _tables.TRANSFORM_GROUP}
    assert _kernels.registered("cpu") == {*_tables.overloads("mm"), *cat, *group}
    assert MM in _kernels.registered("cpu") and torch.ops.aten.mm.out not in _kernels.registered("cpu")


def test_another_devices_policy_registers_where_it_differs_from_this_device():
    with mixprec.autocast("cpu", policy=mixprec.policies.CUDA, compute="native"):
        pass
    registered = {_tables.qualified(op) for op in _kernels.registered("cpu")}
    assert {"aten::softmax.int", "aten::exp", "aten::layer_norm"} <= registered  # CUDA's, not CPU's
    assert "aten::mm" not in registered  # as on both
    # torch 2.10 to 2.12 autocast softmax.Dimname on CUDA, later releases do not: CUDA's kernels decide
    cuda_has_dimname = "aten::softmax.Dimname" in _tables.native_registrations("AutocastCUDA")
    assert ("aten::softmax.Dimname" in registered) == cuda_has_dimname


def test_emulated_compute_registers_every_lower_precision_op():
    with mixprec.autocast("cpu", compute="emulated"):
        pass
    lower = {op for op, c in _tables.native("cpu").items() if c is mixprec.Category.LOWER_PRECISION_FP}
    assert _kernels.registered("cpu") == lower


def test_a_plain_torch_autocast_region_through_mixprec_kernels_is_native():
    a = torch.randn(4, 4)
    with torch.autocast("cpu"):
        native = torch.mm(a, a)
    with mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["mm"]), compute="native"):
        assert torch.mm(a, a).dtype is torch.float32
    with torch.autocast("cpu"):  # mm now goes through mixprec's kernel, with no mixprec setting
        through_kernel = torch.mm(a, a)
    assert MM in _kernels.registered("cpu")
    assert through_kernel.dtype is torch.bfloat16 and torch.equal(through_kernel, native)


def _cast_order(run, *, hooks=False):
    """mm's argument positions in the order their casts were made (autograd's sequence numbers)."""
    a, b = (torch.randn(4, 4, requires_grad=True) * 1 for _ in range(2))  # (not leaves: no cast kept)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else contextlib.nullcontext():
        out = run(a, b)
    casts = [fn for fn, _ in out.grad_fn.next_functions]
    return sorted(range(2), key=lambda i: casts[i]._sequence_nr())


def test_native_casts_reversed_is_the_order_torchs_kernels_cast_in():
    with torch.autocast("cpu"):
        order = _cast_order(torch.mm)
    assert order == ([1, 0] if _compat.native_casts_reversed() else [0, 1])


@pytest.mark.parametrize("path", ["cpp", "python"], ids=["cpp-kernel", "python-kernel"])
def test_an_ops_casts_are_made_in_native_order_and_their_gradients_summed_as_native(path):
    # h's gradient sums sigmoid's and mm's two casts' in float32: autograd runs the later-made cast first, so
    # the casts' order shows in the last bit (a saved-tensor hook sends the call to the Python kernel)
    x, gen = torch.randn(8, 8), torch.Generator().manual_seed(1)
    grads = [torch.randn(8, 8, generator=gen).bfloat16(), torch.randn(8, 8, generator=gen)]

    def x_grad(region):
        leaf = x.clone().requires_grad_()
        with region, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if path == "python" \
                else contextlib.nullcontext():  # fmt: skip
            h = leaf.sin()
            outs = torch.mm(h, h), h.sigmoid()
        torch.autograd.backward(outs, grads)
        return leaf.grad

    native = x_grad(torch.autocast("cpu"))
    with torch.autocast("cpu"):
        native_order = _cast_order(torch.mm)
    with mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["mm"]), compute="native"):
        pass  # mm gets a mixprec kernel
    assert MM in _kernels.registered("cpu")
    with torch.autocast("cpu"):
        assert _cast_order(torch.mm, hooks=path == "python") == native_order
    assert torch.equal(x_grad(torch.autocast("cpu")), native)
    assert torch.equal(x_grad(mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["cat"]), compute="native")), native)


def test_reset_gives_torch_its_own_kernels_back():
    with mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["mm"]), compute="native"):
        pass
    engine.reset()
    assert _kernels.registered("cpu") == frozenset()
    assert "aten::mm" in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
    with torch.autocast("cpu"):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.bfloat16


def test_a_removed_composite_falls_through_and_its_inner_ops_are_cast():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    policy = mixprec.policies.CUDA.without_ops("einsum")
    with mixprec.autocast("cpu", policy=policy, compute="native"):
        out = torch.einsum("bij,bjk->bik", a, b)  # decomposes to bmm, lower_precision_fp in CUDA's table
    assert out.dtype is torch.bfloat16


def test_a_device_without_a_python_autocast_key_takes_only_its_default():
    assert _tables.autocast_key("xla") is None
    with pytest.raises(RuntimeError, match=r"Cannot apply this policy on 'xla'.*compute='native'"):
        mixprec.autocast("xla", policy=mixprec.policies.CPU).__enter__()
    assert not torch.is_autocast_enabled("xla")


def test_plain_torch_regions_through_mixprec_kernels_never_reuse_a_stale_cast():
    # A fused optimizer updates weights in place without moving their version counters; a cast cached
    # past the torch.autocast region that made it would then be stale.
    with mixprec.autocast("cpu", policy=CPU.with_ops(fp32=["mm"]), compute="native"):
        pass  # mm now goes through mixprec's kernel
    w = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.AdamW([w], lr=0.5, fused=True)
    x = torch.randn(4, 4)
    for _ in range(2):
        with torch.autocast("cpu"):
            out = torch.mm(x, w)
        assert torch.equal(out, torch.mm(x.bfloat16(), w.detach().bfloat16()))
        out.float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_python_number_where_a_tensor_goes_passes_through_a_kernel_without_a_rule():
    # Torch unboxes the wrapped number of `x + 1` into a Python int before a Python kernel sees it, and
    # redispatching that to add.Tensor fails; once some policy gave add a kernel, every region without a
    # rule for it (the default one, a plain torch.autocast) must still run it as torch does.
    x, h = torch.randn(3), torch.randn(3).bfloat16()
    i = torch.arange(3)
    expected = [x + 1, h + 1, i + 1.5, x * 2, x - 2.5]
    with mixprec.autocast("cpu", policy=CPU.with_ops(promote=["add", "mul", "sub"]), compute="native"):
        assert (h + x).dtype is torch.float32  # the policy's rule
    for region in (torch.autocast("cpu"), mixprec.autocast("cpu", compute="native")):
        with region:
            got = [x + 1, h + 1, i + 1.5, x * 2, x - 2.5]
        for g, e in zip(got, expected, strict=True):
            assert g.dtype is e.dtype and torch.equal(g, e)


def test_torchscript_only_overloads_get_no_kernel():
    # aten::add(Scalar a, Scalar b) -> Scalar (the packet's "default") is unknown to the dispatcher.
    with mixprec.autocast("cpu", policy=CPU.with_ops(promote=["add"]), compute="native"):
        pass
    assert torch.ops.aten.add.Tensor in _kernels.registered("cpu")
    assert torch.ops.aten.add.default not in _kernels.registered("cpu")
