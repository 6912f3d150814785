"""``mixprec demo --device cuda``: on a GPU lower precision makes the demo's training faster, and the table
speaks of the GPU."""

from __future__ import annotations

import pytest
import torch

from mixprec.cli import _demo


def test_lower_precision_pays_in_the_demo(device):
    data = _demo.load_digits(device)
    results = _demo.train_all(_demo.SETUPS, 30, device, data)
    caption = str(_demo._table(results, device).caption)
    assert all(r.accuracy > 0.8 for r in results), [r.accuracy for r in results]
    if device != "cuda":
        pytest.skip("the speed-up is a GPU's (this run checks the test on a CPU)")
    fp32, bf16, fp16 = (r.seconds_per_step for r in results)
    assert bf16 < fp32 and fp16 < fp32, (fp32, bf16, fp16)
    assert "tensor cores" in caption and "threads" not in caption
    assert torch.cuda.get_device_name() in str(_demo._table(results, device).title)
