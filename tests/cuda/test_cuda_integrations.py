"""What else must work on the GPU: a custom policy, ``install()``, checkpointing, torch.compile with inductor,
Lightning and the Hugging Face Trainer, each against native ``torch.autocast("cuda")`` where it has an answer."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import mixprec

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _default(device: str) -> mixprec.Policy:
    return mixprec.policies.CUDA if device == "cuda" else mixprec.policies.CPU


def _linear_fp32(device: str) -> mixprec.Policy:
    return _default(device).with_ops(fp32=["linear"])


def _region(device: str, **kwargs):
    """``mixprec.autocast`` on the device (``compute="native"`` on a CPU, where "auto" may emulate)."""
    return mixprec.autocast(device, **({} if device == "cuda" else {"compute": "native"}), **kwargs)


def _net(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)


def test_a_custom_policy_runs_its_categories(device):
    net, x = _net(device), torch.randn(4, 32, device=device)
    with _region(device, dtype=F16, policy=_linear_fp32(device)):
        out = net(x)
        mm = torch.mm(x, x.t())
    assert (out.dtype, mm.dtype) == (F32, F16)
    with _region(device, dtype=F16):
        assert net(x).dtype is F16


def test_install_reaches_a_plain_torch_autocast_and_remove_restores_it(device):
    net, x = _net(device), torch.randn(4, 32, device=device)
    with torch.autocast(device, dtype=F16):
        before = net(x)
    handle = mixprec.install(_linear_fp32(device))
    try:
        with torch.autocast(device, dtype=F16):
            assert net(x).dtype is F32
    finally:
        handle.remove()
    with torch.autocast(device, dtype=F16):
        after = net(x)
    assert after.dtype is F16 and torch.equal(before, after)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_a_recurrent_layer_under_mixprecs_kernels_equals_native_in_bfloat16(device, kind, deterministic):
    """torch's cuDNN RNN kernel runs in float16 whatever the region's dtype (AutocastRNN.cpp); mixprec's kernel,
    which serves every op under a module policy, must too: the output's dtype and bits, and every gradient."""
    torch.manual_seed(0)
    layer = getattr(torch.nn, kind)(16, 32, num_layers=2).to(device)
    x = torch.randn(5, 3, 16, device=device, requires_grad=True)

    def run(region):
        layer.zero_grad()
        x.grad = None
        with region:
            out, _ = layer(x)
        out.float().sum().backward()
        return [out, x.grad, *(p.grad for p in layer.parameters())]

    native = run(torch.autocast(device, dtype=BF16))
    handle = mixprec.set_module_policy(layer, _default(device))
    try:
        ours = run(_region(device, dtype=BF16))
    finally:
        handle.remove()
    if device == "cuda":
        assert native[0].dtype is F16  # (what torch does: the reason for the CUDA policy's fp16 category)
    assert [t.dtype for t in ours] == [t.dtype for t in native]
    assert all(torch.equal(a, b) for a, b in zip(ours, native, strict=True))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_under_a_custom_policy_gives_the_gradients_without_it(device, reentrant, deterministic):
    def grads(use_checkpoint: bool) -> list[torch.Tensor]:
        net = _net(device)
        x = torch.randn(4, 32, device=device).requires_grad_(True)
        policy = _linear_fp32(device).with_ops(lower_precision_fp=["gelu"])  # (the recompute must follow it)
        with _region(device, dtype=F16, policy=policy):
            out = checkpoint.checkpoint(net, x, use_reentrant=reentrant) if use_checkpoint else net(x)
        out.float().sum().backward()
        return [p.grad for p in net.parameters()] + [x.grad]

    torch.manual_seed(1)
    plain = grads(False)
    torch.manual_seed(1)
    checkpointed = grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor", fullgraph=True)


def test_compiled_function_follows_the_policy_around_it_a_b_a(device):
    """The policy switch A -> B -> A around one compiled function: each call runs its region's policy."""
    net, x = _net(device), torch.randn(4, 32, device=device)
    compiled = _compile(lambda t: net(t))
    seen = []
    for policy in (_linear_fp32(device), None, _linear_fp32(device), None):
        with _region(device, dtype=F16, policy=policy):
            seen.append(compiled(x).dtype)
    assert seen == [F32, F16, F32, F16]


def test_a_region_inside_the_compiled_function_gives_the_eager_result(device):
    net, x = _net(device), torch.randn(4, 32, device=device)
    policy = _linear_fp32(device)  # (made outside the compiled function, as mixprec asks)

    def step(t):
        with _region(device, dtype=F16, policy=policy):
            return net(t), torch.mm(t, t.t())

    eager = step(x)
    compiled = _compile(step)(x)
    assert [o.dtype for o in compiled] == [o.dtype for o in eager] == [F32, F16]
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_a_region_around_a_compiled_encoder_gives_the_eager_result(device):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(device)
    x = torch.randn(2, 16, 64, device=device)
    compiled = _compile(encoder)
    with _region(device, dtype=BF16):
        eager = encoder(x)
        out = compiled(x)
    assert out.dtype is eager.dtype
    torch.testing.assert_close(out.float(), eager.float(), rtol=3e-2, atol=3e-2)


# --- frameworks -----------------------------------------------------------------------------------------------


def _lightning_run(device: str, precision: str | None, plugin=None) -> tuple[list[torch.dtype], list[float]]:
    import lightning as L

    seen, losses = [], []

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            seen.append(out.dtype)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(8, 8)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **({"plugins": [plugin]} if plugin is not None else {"precision": precision}),
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    return seen, losses


def _mixed(device: str) -> tuple[str, torch.dtype]:
    """Lightning's float16 mixed precision on the GPU; its bfloat16 one on a CPU (no float16 AMP there)."""
    return ("16-mixed", F16) if device == "cuda" else ("bf16-mixed", BF16)


def test_lightning_mixed_precision_follows_the_installed_policy(device):
    precision, low = _mixed(device)
    native_seen, _ = _lightning_run(device, precision)
    handle = mixprec.install(_linear_fp32(device))
    try:
        installed_seen, _ = _lightning_run(device, precision)
    finally:
        handle.remove()
    assert set(native_seen) == {low} and set(installed_seen) == {F32}


def test_lightning_plugin_on_the_accelerator_takes_its_device(device):
    from mixprec.integrations.lightning import MixprecPrecision

    low = F16 if device == "cuda" else BF16
    plugin = MixprecPrecision(dtype=low)
    assert plugin.device is None
    seen, losses = _lightning_run(device, None, plugin)
    assert plugin.device == device and set(seen) == {low}
    assert all(torch.isfinite(torch.tensor(losses)))
    if device == "cuda":
        assert isinstance(plugin.scaler, mixprec.GradScaler) and plugin.scaler._device == "cuda"


def _hf_run(tmp_path, device: str, install: bool) -> float:
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)
    model = GPT2ForSequenceClassification(config)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 100, (16,), generator=gen), "labels": i % 2} for i in range(32)]
    precision = {"fp16": True} if device == "cuda" else {"bf16": True, "use_cpu": True}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=0, **precision,
    )  # fmt: skip
    handle = mixprec.install(_default(device)) if install else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Trainer(model=model, args=args, train_dataset=data).train().training_loss
    finally:
        if handle is not None:
            handle.remove()


def test_hf_trainer_mixed_precision_under_install_equals_native(tmp_path, device, deterministic, monkeypatch):
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(True)
    native = _hf_run(tmp_path, device, install=False)
    AcceleratorState._reset_state(True)
    installed = _hf_run(tmp_path, device, install=True)
    AcceleratorState._reset_state(True)
    assert installed == native
