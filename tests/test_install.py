"""mixprec.install: every torch.autocast region in the process follows mixprec, until remove()."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mixprec

BF16, F32 = torch.bfloat16, torch.float32
LINEAR_FP32 = mixprec.policies.CPU.with_ops(fp32=["linear"])
A, W = torch.randn(4, 8), torch.randn(6, 8)


def _linear_dtype(region):
    with region():
        return torch.nn.functional.linear(A, W).dtype


def test_torch_autocast_regions_follow_the_installed_policy_until_removed():
    with torch.autocast("cpu"):
        native = torch.nn.functional.linear(A, W)
    handle = mixprec.install(LINEAR_FP32)
    try:
        assert _linear_dtype(lambda: torch.autocast("cpu")) is F32
        assert mixprec.get_policy("cpu") is LINEAR_FP32 and handle.active
    finally:
        handle.remove()
    with torch.autocast("cpu"):
        again = torch.nn.functional.linear(A, W)
    assert again.dtype is BF16 and torch.equal(again, native)
    assert mixprec.get_policy("cpu") is mixprec.policies.CPU and not handle.active


def test_installed_in_one_thread_applies_in_every_thread():
    seen = []
    with mixprec.install(LINEAR_FP32):
        thread = threading.Thread(target=lambda: seen.append(_linear_dtype(lambda: torch.autocast("cpu"))))
        thread.start()
        thread.join()
    assert seen == [F32]


def test_installing_again_replaces_and_the_old_handle_does_nothing():
    first = mixprec.install(LINEAR_FP32)
    second = mixprec.install(mixprec.policies.CPU.with_ops(fp32=["mm"]))
    first.remove()  # replaced already: nothing to remove
    assert second.active and not first.active
    with torch.autocast("cpu"):
        assert torch.mm(A, W.t()).dtype is F32 and torch.nn.functional.linear(A, W).dtype is BF16
    second.remove()
    second.remove()


def test_a_mixprec_region_keeps_its_own_policy_and_none_means_the_installed_one():
    with mixprec.install(LINEAR_FP32):
        assert _linear_dtype(lambda: mixprec.autocast("cpu", policy=mixprec.policies.CPU)) is BF16
        assert _linear_dtype(lambda: mixprec.autocast("cpu")) is F32


def test_installed_emulated_compute_is_what_a_mixprec_region_computes():
    with mixprec.autocast("cpu", compute="emulated"):
        expected = torch.nn.functional.linear(A, W)
    with mixprec.install(compute="emulated"), torch.autocast("cpu"):
        got = torch.nn.functional.linear(A, W)
    assert got.dtype is BF16 and torch.equal(got, expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "CPU"}, TypeError, r"autocast argument 'policy' has the wrong type.*Received: policy='CPU'"),
        ({"compute": "fast"}, ValueError, r"autocast argument 'compute' is invalid.*Expected one of: auto"),
        ({"compute": 1}, TypeError, r"autocast argument 'compute' has the wrong type"),
    ],
)
def test_bad_arguments_get_autocasts_errors_and_install_nothing(kwargs, error, match):
    with pytest.raises(error, match=match):
        mixprec.install(**kwargs)
    assert mixprec.engine._installation.current is None


def test_compiled_code_recompiles_when_an_installation_comes_and_goes():
    compiled = torch.compile(lambda a, w: torch.nn.functional.linear(a, w), fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu"):
        assert compiled(A, W).dtype is BF16
    with mixprec.install(LINEAR_FP32), torch.autocast("cpu"):
        assert compiled(A, W).dtype is F32
    with torch.autocast("cpu"):
        assert compiled(A, W).dtype is BF16


def test_checkpoint_recompute_under_an_installation_gives_the_uncheckpointed_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    with mixprec.install(LINEAR_FP32):
        for use in (False, True):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu"):
                out = checkpoint(model, x, use_reentrant=False) if use else model(x)
            out.float().sum().backward()
            grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert grads[0][0].dtype is F32


def test_a_native_forward_recomputes_natively_even_after_an_install():
    with mixprec.autocast("cpu", policy=LINEAR_FP32):
        pass  # linear now goes through mixprec's kernel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for use in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu"):
            out = checkpoint(model, x, use_reentrant=False) if use else model(x)
        with mixprec.install(LINEAR_FP32):  # installed only for the backward, and the recompute in it
            out.float().sum().backward()
        grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert grads[0][0].dtype is BF16


class _Opening(torch.nn.Module):
    """A module whose forward opens ``torch.autocast`` itself (as ``accelerate``'s prepared forward does), with an
    inner module that may hold a checkpoint."""

    def __init__(self, checkpointed: str | None = None) -> None:
        super().__init__()
        self.first, self.act, self.second = torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.act(self.first(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu"):
            if self.checkpointed is None:
                return self.body(x)
            return checkpoint(self.body, x, use_reentrant=self.checkpointed == "reentrant")


def test_a_module_policy_reaches_a_torch_autocast_region_its_module_opens_under_install():
    """A module entered with autocast off, whose forward opens ``torch.autocast`` (a prepared model's): under
    ``install`` the module's policy is the region's, as it is for a ``mixprec.autocast`` opened there; without
    ``install`` the region is torch's own."""
    x = torch.randn(4, 8)
    block = _Opening()
    with mixprec.set_module_policy(block, LINEAR_FP32):
        assert block(x).dtype is BF16  # nothing installed: torch.autocast is native
        with mixprec.install():
            assert block(x).dtype is F32
            inner = mixprec.set_module_policy(block.second, mixprec.policies.CPU)  # the innermost policy wins
            assert block(x).dtype is BF16
            inner.remove()
        assert block(x).dtype is BF16
    with mixprec.install():
        assert block(x).dtype is BF16  # no module policy: the installed (default) one


@pytest.mark.parametrize("checkpointed", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("where", ["inside the module", "around the module"])
def test_a_module_policy_under_install_recomputes_as_its_forward_ran(checkpointed, where):
    """The module's policy in the checkpoint's recompute, whether the module holds the checkpoint (no hook runs
    in the recompute: the forward left the setting) or the checkpoint holds the module (its hook runs again, and
    the code around it recomputes under the setting around it): gradients equal those without checkpointing."""
    torch.manual_seed(0)
    block = _Opening()
    outer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def run(use: bool) -> list[torch.Tensor]:
        block.checkpointed = checkpointed if use and where == "inside the module" else None
        for p in (*block.parameters(), *outer.parameters()):
            p.grad = None
        x.grad = None

        def step(t: torch.Tensor) -> torch.Tensor:
            inside = block(t)  # (first: the module's setting must not become the checkpoint's record)
            with torch.autocast("cpu"):
                around = outer(t)  # the installed (default) policy: bfloat16
            return inside.float() + around.float()

        if use and where == "around the module":
            out = checkpoint(step, x, use_reentrant=checkpointed == "reentrant")
        else:
            out = step(x)
        out.sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in (*block.parameters(), *outer.parameters()))]

    with mixprec.install(), mixprec.set_module_policy(block, mixprec.policies.CPU.with_ops(fp32=["linear", "gelu"])):
        plain, checkpointed_run = run(False), run(True)
    for a, b in zip(plain, checkpointed_run, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert block.first.weight.grad is not None


def test_an_installation_keeps_a_bounded_number_of_module_policy_settings():
    # A module policy of new content at every step (left installed for the run) added a setting per policy.
    from mixprec.engine import _installation

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    ops = ["softmax", "relu", "gelu", "tanh", "sigmoid", "exp", "log", "sum", "mean", "cumsum"]
    with mixprec.install():
        for i in range(_installation._MODULE_SETTINGS + 20):  # (each a policy of other content)
            policy = mixprec.policies.CPU.with_ops(fp32=[op for bit, op in enumerate(ops) if i >> bit & 1])
            with mixprec.set_module_policy(layer, policy), torch.autocast("cpu"):
                assert layer(x).dtype is torch.bfloat16
        assert len(_installation.current._module_settings) == _installation._MODULE_SETTINGS


def test_an_installation_in_force_through_a_reset_keeps_its_kernels():
    """``mixprec.engine.reset()`` took every kernel away, an installation's too, which nothing registered again:
    its handle said active while torch.autocast regions ran torch's table (linear in bfloat16)."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    handle = mixprec.install(mixprec.policies.CPU.with_ops(fp32=["linear"]))
    try:
        mixprec.engine.reset()
        with torch.autocast("cpu"):
            assert torch.nn.functional.linear(x, w).dtype is F32 and handle.active
    finally:
        handle.remove()
    with torch.autocast("cpu"):
        assert torch.nn.functional.linear(x, w).dtype is BF16
