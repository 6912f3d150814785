"""Hugging Face Trainer with mixprec: keep ``bf16=True``, call ``mixprec.install()`` before ``train()``.

Trains a 2-layer GPT-2 classifier (built from a config, nothing downloaded) on a
small synthetic task made here: is the first token in the upper half of the
vocabulary? It does so in float32, then in bfloat16 under ``mixprec.install()``, and prints
the median step time against float32 and the final training loss. On a CPU without
bfloat16 units, ``compute="auto"`` emulates bfloat16 with float32 kernels, where
torch's own bfloat16 kernels are slow fallbacks (``--native`` adds that run).

    pip install -e ".[examples]"   # Transformers and Accelerate
    python examples/hf_trainer.py [--steps 30] [--native] [--policy-linear-fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from accelerate.state import AcceleratorState
from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

import mixprec

VOCAB, SEQ = 1000, 32


def make_data(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    return [{"input_ids": row, "labels": int(row[0] >= VOCAB // 2)} for row in ids]


def make_model(seed: int = 0) -> GPT2ForSequenceClassification:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4, pad_token_id=0)
    return GPT2ForSequenceClassification(config)


class StepTimer(TrainerCallback):  # type: ignore[misc]
    """Wall time of each optimizer step (forward, backward, step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def train(bf16: bool, steps: int, policy: mixprec.Policy | None = None, install: bool = True) -> tuple[float, float]:
    """One run: (median step seconds after the first two, final training loss)."""
    timer = StepTimer()
    # TrainingArguments(bf16=True) sets ACCELERATE_MIXED_PRECISION for the process, and Accelerate keeps one
    # process-wide state: start each run from scratch, or a float32 run after a bf16 one runs in bf16.
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if bf16 else "no"
    AcceleratorState._reset_state(True)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=bf16, max_steps=steps, per_device_train_batch_size=16,
        learning_rate=1e-3, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, logging_steps=steps,
    )  # fmt: skip
    handle = mixprec.install(policy) if bf16 and install else None
    try:
        trainer = Trainer(model=make_model(), args=args, train_dataset=make_data(), callbacks=[timer])
        trainer.train()
    finally:
        if handle is not None:
            handle.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return statistics.median(timer.times[2:] or timer.times), losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--native", action="store_true", help="also run torch's bf16 autocast (slow off bf16 units)")
    parser.add_argument("--policy-linear-fp32", action="store_true", help="install a policy keeping Linear in float32")
    args = parser.parse_args()
    policy = mixprec.policies.CPU.with_ops(fp32=["linear"]) if args.policy_linear_fp32 else None
    print(mixprec.kernel_support("cpu", torch.bfloat16))
    fp32_time, fp32_loss = train(False, args.steps)
    runs = {"float32": (fp32_time, fp32_loss), "bf16, mixprec.install()": train(True, args.steps, policy)}
    if args.native:
        runs["bf16, torch's autocast"] = train(True, args.steps, install=False)
    for name, (seconds, loss) in runs.items():
        print(f"{name:26} step {seconds * 1e3:8.1f} ms  ({seconds / fp32_time:5.2f}x float32)  final loss {loss:.4f}")


if __name__ == "__main__":
    main()
