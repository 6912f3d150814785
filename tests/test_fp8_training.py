"""fp8 in training as users run it: a GPT-2 trained 150 steps, the GradScaler under a float16 region, and the
frameworks that open ``torch.autocast`` themselves (Hugging Face ``Trainer``, Lightning) under
``mixprec.install(policies.FP8)``, with no code change.

Each test counts the fp8 GEMMs that ran (``engine._fp8.scaled_mm``), so a run that silently fell back to the
region's dtype fails.
"""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.engine import _fp8

FP8 = mixprec.policies.FP8

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture
def gemms(monkeypatch):
    """The number of fp8 GEMMs run so far (forward and backward)."""
    count = [0]
    real = _fp8.scaled_mm

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_fp8, "scaled_mm", counted)
    mixprec.engine.reset()
    yield count
    mixprec.engine.reset()


def _gpt2_losses(policy: mixprec.Policy | None, steps: int, device: str = "cpu") -> list[float]:
    """A 2-layer GPT-2 (width 64) trained ``steps`` steps with AdamW on a fixed synthetic corpus: token runs
    that a language model learns (each next token is the previous plus a per-sequence stride, mod 96)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config).train().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 96, (8, 1), generator=gen)
        stride = torch.randint(1, 4, (8, 1), generator=gen)
        ids = ((start + stride * torch.arange(32)) % 96).to(device)
        with mixprec.autocast(device, dtype=torch.bfloat16, policy=policy):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_gpt2_trained_150_steps_in_fp8_ends_within_3_percent_of_bf16(gemms):
    pytest.importorskip("transformers")
    bf16 = _gpt2_losses(mixprec.policies.CUDA, 150)
    assert gemms[0] == 0
    fp8 = _gpt2_losses(FP8, 150)
    # every decoder Conv1D (4 per layer) and the tied head: 3 GEMMs each (forward, both gradients) per step
    assert gemms[0] == 150 * 3 * (4 * 2 + 1)
    end_bf16, end_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10  # (the last ten steps' mean: less noise)
    assert end_bf16 < 0.5 * bf16[0]  # it learned
    assert abs(end_fp8 - end_bf16) <= 0.03 * end_bf16, (end_fp8, end_bf16)


def test_the_grad_scaler_trains_fp8_under_a_float16_region_and_skips_an_inf_step(gemms):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**12)
    x, y = torch.randn(32, 64), torch.randn(32, 32)
    losses, skipped = [], []
    for step in range(6):
        with mixprec.autocast("cpu", dtype=torch.float16, policy=FP8):
            out = net(x)
            assert out.dtype is torch.float16
            loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if step == 2:
            net[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in net.parameters()]
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True)))
        losses.append(loss.item())
    assert gemms[0] == 6 * 5  # per step 2 forward and 3 backward GEMMs (the data input asks for no grad_x)
    assert skipped == [False, False, True, False, False, False]
    assert scaler.get_scale() < 2.0**12 and losses[-1] < losses[0]


def test_hf_trainer_trains_in_fp8_under_install_with_no_code_change(tmp_path, gemms, monkeypatch):
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    def run(policy):
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
        AcceleratorState._reset_state(True)
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)
        model = GPT2ForSequenceClassification(config)
        gen = torch.Generator().manual_seed(0)
        data = [{"input_ids": torch.randint(1, 100, (16,), generator=gen), "labels": i % 2} for i in range(32)]
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=True, max_steps=3,
                                 per_device_train_batch_size=8, report_to=[], save_strategy="no", disable_tqdm=True,
                                 seed=0)  # fmt: skip
        with mixprec.install(policy):
            return Trainer(model=model, args=args, train_dataset=data).train().training_loss

    bf16 = run(mixprec.policies.CUDA)
    assert gemms[0] == 0
    fp8 = run(FP8)
    AcceleratorState._reset_state(True)
    assert gemms[0] == 3 * 3 * 4 * 2  # 3 steps x 3 GEMMs x 4 Conv1D per layer x 2 layers (the head is 32 -> 2)
    assert abs(fp8 - bf16) <= 0.05 * abs(bf16)


def test_lightning_trains_in_fp8_under_install_with_no_code_change(gemms):
    L = pytest.importorskip("lightning")

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
            self.seen: list[torch.dtype] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.seen.append(out.dtype)
            return torch.nn.functional.mse_loss(out.float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = Tiny()
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 16))
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with mixprec.install(FP8):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    assert module.seen == [torch.bfloat16] * 3
    assert gemms[0] == 3 * 5  # per step 2 forward and 3 backward GEMMs (the data input asks for no grad_x)
