"""`mixprec demo`: a few real training steps write the PNG and the table; runs are reproducible."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cli import run
from _counting import CountCasts
from mixprec.cli import _demo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_writes_png_and_table(capsys, tmp_path):
    result = run(capsys, "demo", "--steps", "3", "--out", str(tmp_path))
    assert result.code == 0, result.err
    assert (tmp_path / "demo.png").read_bytes()[:8] == PNG_MAGIC
    for label in ("float32", "bf16 autocast", "fp16 autocast + GradScaler", "casts/step", "peak memory", "test acc"):
        assert label in result.out


def test_same_seed_same_run():
    data = _demo.load_digits("cpu")
    first, second = (_demo.train(_demo.SETUPS[1], 2, "cpu", data) for _ in range(2))
    assert first.losses == second.losses and first.accuracy == second.accuracy


def test_casts_per_step_equals_native_autocast_casts():
    data = _demo.load_digits("cpu")
    result = _demo.train(_demo.SETUPS[1], 1, "cpu", data)
    torch.manual_seed(_demo.SEED)
    model, (x, y) = _demo.make_model(), (data[0][: _demo.BATCH], data[1][: _demo.BATCH])
    with CountCasts() as native, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(model(x), y)
    assert result.casts_per_step == native.casts == 10  # 8 weights and biases, the input, the logits to fp32


def test_float32_run_has_no_casts_and_scaler_skips_nothing_in_fp32():
    data = _demo.load_digits("cpu")
    result = _demo.train(_demo.SETUPS[0], 1, "cpu", data)
    assert result.casts_per_step == 0 and result.skipped == [] and result.peak_bytes > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_table_says_emulated_where_the_cpu_has_no_units(fake_cpu_flags, dtype):
    fake_cpu_flags()
    assert _demo.compute_note("cpu", dtype) == "emulated"
    assert _demo.compute_note("cpu", None) == "-"


@pytest.mark.parametrize(("dtype", "flag"), [(torch.bfloat16, "avx512_bf16"), (torch.float16, "amx_fp16")])
def test_table_says_native_and_names_the_flag(fake_cpu_flags, dtype, flag):
    fake_cpu_flags(flag)
    data = _demo.load_digits("cpu")
    setup = next(s for s in _demo.SETUPS if s.dtype is dtype)
    results = [_demo.train(_demo.SETUPS[0], 1, "cpu", data), _demo.train(setup, 1, "cpu", data)]
    caption = str(_demo._table(results, "cpu").caption)
    assert _demo.compute_note("cpu", dtype) == "native"
    assert f"cpu {str(dtype).removeprefix('torch.')}: native ({flag}" in caption


def test_python_dash_m_runs_the_command():
    src = Path(__file__).parents[1] / "src"
    done = subprocess.run([sys.executable, "-m", "mixprec", "--help"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and "demo" in done.stdout and "doctor" in done.stdout


def test_import_mixprec_loads_no_cli_dependency():
    src = Path(__file__).parents[1] / "src"
    heavy = "('typer', 'rich', 'matplotlib', 'sklearn')"
    code = f"import sys, mixprec; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_on_a_gpu_the_demo_trains_a_model_where_lower_precision_pays():
    """The CNN is launch-bound on a GPU; there the demo trains a wide MLP on a large batch (the CPU keeps the CNN)."""
    gpu, cpu = _demo.make_model("cuda"), _demo.make_model("cpu")
    widths = [m.out_features for m in gpu if isinstance(m, torch.nn.Linear)]
    assert widths == [_demo.GPU_WIDTH] * 3 + [10] and _demo.batch_size("cuda") == _demo.GPU_BATCH == 4096
    assert any(isinstance(m, torch.nn.Conv2d) for m in cpu) and _demo.batch_size("cpu") == _demo.BATCH
    assert gpu(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert _demo._where("cpu") == f"{torch.get_num_threads()} threads"
