"""Frameworks that open torch.autocast themselves follow mixprec once it is installed, with no code change.

Each test trains a tiny model for a few steps with the real framework: Hugging Face ``Trainer``,
Accelerate's ``Accelerator`` and Lightning's ``Trainer``. Step-time goals live in a benchmark,
not here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec

BF16, F32 = torch.bfloat16, torch.float32
LINEAR_FP32 = mixprec.policies.CPU.with_ops(fp32=["linear"])

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """TrainingArguments(bf16=True) sets ACCELERATE_MIXED_PRECISION, and Accelerate keeps process-wide state."""
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


# --- Hugging Face Trainer -----------------------------------------------------------------------------------


def _hf_run(tmp_path, policy, *, install=True, gradient_checkpointing=False):
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)
    model = GPT2ForSequenceClassification(config)
    seen = []
    model.score.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 100, (16,), generator=gen), "labels": i % 2} for i in range(32)]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, max_steps=3, per_device_train_batch_size=8,
        report_to=[], save_strategy="no", gradient_checkpointing=gradient_checkpointing, disable_tqdm=True, seed=0,
    )  # fmt: skip
    handle = mixprec.install(policy) if install else None
    try:
        result = Trainer(model=model, args=args, train_dataset=data).train()
    finally:
        if handle is not None:
            handle.remove()
    return result.training_loss, seen


def test_hf_trainer_follows_the_installed_policy(tmp_path):
    native_loss, native_seen = _hf_run(tmp_path, None, install=False)
    loss, seen = _hf_run(tmp_path, LINEAR_FP32)
    assert native_seen == [BF16] * 3 and seen == [F32] * 3  # the classifier head, seen by a forward hook
    assert abs(loss - native_loss) <= 0.01 * abs(native_loss)


def test_hf_trainer_with_the_default_policy_is_native_bit_for_bit(tmp_path):
    assert _hf_run(tmp_path, None) == _hf_run(tmp_path, None, install=False)


def test_hf_trainer_gradient_checkpointing_gives_the_run_without_it(tmp_path):
    assert _hf_run(tmp_path, LINEAR_FP32, gradient_checkpointing=True) == _hf_run(tmp_path, LINEAR_FP32)


# --- Accelerate ---------------------------------------------------------------------------------------------


def test_accelerate_autocast_follows_the_installed_policy():
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    seen = []  # the first Linear's output (accelerate converts the model's outputs to float32)
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(8, 8), torch.randint(0, 2, (8,))
    for installed in (False, True):
        handle = mixprec.install(LINEAR_FP32) if installed else None
        try:
            with accelerator.autocast():
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        finally:
            if handle is not None:
                handle.remove()
    assert seen == [BF16, F32]


def test_accelerate_loop_with_checkpointing_gives_the_gradients_without_it():
    from accelerate import Accelerator
    from torch.utils.checkpoint import checkpoint

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
        model = accelerator.prepare(model)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        with mixprec.install(LINEAR_FP32), accelerator.autocast():
            out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
            loss = out.float().square().mean()
        accelerator.backward(loss)
        grads.append([out.detach(), *(p.grad for p in model.parameters())])
    for a, b in zip(*grads, strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)


# --- Lightning ----------------------------------------------------------------------------------------------


def _lightning_run(policy, *, install=True):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.seen: list[torch.dtype] = []
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.seen.append(out.dtype)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = Tiny()
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = L.Trainer(
        accelerator="cpu", precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    handle = mixprec.install(policy) if install else None
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    finally:
        if handle is not None:
            handle.remove()
    return module.seen, module.losses


def test_lightning_follows_the_installed_policy_and_is_native_after_remove():
    native_seen, native_losses = _lightning_run(None, install=False)
    seen, losses = _lightning_run(LINEAR_FP32)
    after_seen, after_losses = _lightning_run(None, install=False)
    assert native_seen == [BF16] * 3 and seen == [F32] * 3
    assert (after_seen, after_losses) == (native_seen, native_losses)
    assert abs(losses[-1] - native_losses[-1]) <= 0.01 * abs(native_losses[-1]) + 1e-3


def _lightning_plugin_run(plugin):
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
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))  # one batch, seen at every step
    trainer = L.Trainer(
        accelerator="cpu", plugins=[plugin], max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
    return seen, losses


def test_lightning_plugin_runs_its_policy():
    from mixprec.integrations.lightning import MixprecPrecision

    seen, losses = _lightning_plugin_run(MixprecPrecision(policy=LINEAR_FP32))
    assert seen == [F32] * 8 and all(map(lambda v: v == v, losses))
    seen, _ = _lightning_plugin_run(MixprecPrecision(compute="native"))
    assert seen == [BF16] * 8


def test_lightning_plugin_trains_float16_with_mixprec_grad_scaler():
    from mixprec.integrations.lightning import MixprecPrecision

    plugin = MixprecPrecision(dtype=torch.float16, compute="emulated")
    assert isinstance(plugin.scaler, mixprec.GradScaler)
    seen, losses = _lightning_plugin_run(plugin)
    assert seen == [torch.float16] * 8
    assert losses[-1] < losses[0]
    assert plugin.scaler.get_scale() > 0 and plugin.state_dict()["scale"] == plugin.scaler.get_scale()


def test_lightning_plugin_takes_the_trainers_device():
    """device=None (the default) becomes the device type Lightning moved the model to, and a float16 plugin's
    own scaler is made for it; a device given stays."""
    from mixprec.integrations.lightning import MixprecPrecision

    plugin = MixprecPrecision(dtype=torch.float16)
    assert plugin.device is None
    _lightning_plugin_run(plugin)
    assert plugin.device == "cpu" and isinstance(plugin.scaler, mixprec.GradScaler)
    assert plugin.scaler._device == "cpu"

    class OnGpu(torch.nn.Module):  # what connect sees of a LightningModule on accelerator="gpu"
        device = torch.device("cuda", 0)

    plugin = MixprecPrecision(dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mixprec.MixprecWarning)  # (no CUDA here: the region and scaler say so)
        plugin.connect(OnGpu(), [], [])
    assert plugin.device == "cuda" and plugin.scaler._device == "cuda"
    given = MixprecPrecision(device="cpu")
    given.connect(OnGpu(), [], [])
    assert given.device == "cpu"


def test_lightning_plugin_refuses_a_region_before_it_has_a_device():
    from mixprec.integrations.lightning import MixprecPrecision

    with pytest.raises(RuntimeError, match=r"MixprecPrecision: no device yet.*Pass the plugin to a Trainer"):
        MixprecPrecision().autocast_context_manager()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": torch.int8}, ValueError, r"MixprecPrecision: dtype is invalid.*Expected one of: bfloat16, float16"),
        ({"policy": "CPU"}, TypeError, r"autocast argument 'policy' has the wrong type"),
        ({"compute": "fast"}, ValueError, r"autocast argument 'compute' is invalid"),
    ],
)
def test_lightning_plugin_bad_arguments(kwargs, error, match):
    from mixprec.integrations.lightning import MixprecPrecision

    with pytest.raises(error, match=match):
        MixprecPrecision(**kwargs)


def test_import_mixprec_imports_no_framework():
    import subprocess
    import sys

    code = "import sys, mixprec; print(sorted({'lightning', 'accelerate'} & set(sys.modules)))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"
