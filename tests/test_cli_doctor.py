"""`mixprec doctor`: the planted float16 overflow is found, named, fixed; the reports follow the schema."""

from __future__ import annotations

import json
import os
import sys

import pytest

import mixprec
from _cli import PLANTED, TARGETS, planted_line, run
from mixprec.diagnostics import SCHEMA


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory):
    """One doctor run on the planted overflow (forward + backward), shared by the checks below."""
    out = tmp_path_factory.mktemp("doctor")
    from mixprec.cli import main

    try:
        main(["doctor", f"{PLANTED}:build", "--dtype", "float16", "--out", str(out)])
    except SystemExit as done:  # pragma: no cover - a failure shows in the assertions
        pytest.fail(f"doctor exited with {done.code}")
    return out, json.loads((out / "report.json").read_text())


def test_doctor_prints_first_nonfinite_module_line_and_checked_fix(capsys, tmp_path):
    result = run(capsys, "doctor", f"{PLANTED}:build", "--dtype", "float16", "--out", str(tmp_path))
    assert result.code == 0, result.err
    assert f"in module 'decoder.0' at {os.path.relpath(PLANTED)}:{planted_line()}" in result.out
    assert 'mixprec.set_module_policy(model.decoder[0], "fp32")' in result.out
    assert "fixes it: no inf/NaN left" in result.out


def test_report_json_first_nonfinite(planted_report):
    _, report = planted_report
    assert report["schema"] == SCHEMA
    assert report["first_nonfinite"] == {
        "op": "torch.Tensor.mul",
        "module": "decoder.0",
        "source": f"{PLANTED}:{planted_line()}",
        "index": 2,
    }
    assert report["dtype"] == "float16" and report["backward"] is True
    assert report["nonfinite"]["float32"] == 0 and report["nonfinite"]["autocast"] > 0


def test_report_json_suggestion_is_checked(planted_report):
    _, report = planted_report
    assert report["suggestion"] == {
        "code": 'mixprec.set_module_policy(model.decoder[0], "fp32")',
        "module": "decoder.0",
        "fixes": True,
        "nonfinite_after": 0,
    }


def test_report_json_rows(planted_report):
    _, report = planted_report
    ops = report["ops"]
    assert [o["index"] for o in ops] == list(range(len(ops)))
    matmul = next(o for o in ops if o["op"] == "torch.matmul")
    assert matmul["module"] == "decoder.0" and matmul["source"] == f"{PLANTED}:{planted_line() + 1}"
    assert matmul["input_dtypes"] == ["float16", "float16"] and matmul["casts"] == 1  # the weight's cast
    linear = ops[0]
    assert linear["op"] == "torch.nn.functional.linear" and linear["module"] == "encoder.0"
    assert 0 < linear["max_rel_error"] < 1e-2 and linear["overflow_fraction"] == 0.0
    planted = ops[2]
    assert planted["overflow_fraction"] > 0.1 and planted["produced_nonfinite"]
    grads = [o for o in ops if o["phase"] == "backward"]
    assert {o["op"] for o in grads} == {f"grad of {n}" for n, _ in _model().named_parameters()}
    assert report["worst"][0] == 2


def test_report_html_is_self_contained(planted_report):
    out, _ = planted_report
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert "decoder.0" in page and "set_module_policy(model.decoder[0]" in page


def _model():
    sys.path.insert(0, str(TARGETS))
    try:
        import planted_overflow

        return planted_overflow.build()[0]
    finally:
        sys.path.pop(0)


def test_a_target_path_with_brackets_is_printed_as_it_is(capsys, tmp_path):
    """Rich read the table's cells as markup: a file ``model[v2].py`` showed as ``model.py``."""
    target = tmp_path / "model[v2].py"
    target.write_text(PLANTED.read_text())
    result = run(capsys, "doctor", f"{target}:build", "--dtype", "float16", "--out", str(tmp_path / "out"))
    assert result.code == 0 and "model[v2].py:" in result.out


def test_forward_only_target(capsys, tmp_path):
    result = run(capsys, "doctor", f"{PLANTED}:build_forward_only", "--dtype", "float16", "--out", str(tmp_path))
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["backward"] is False and all(o["phase"] == "forward" for o in report["ops"])
    assert report["first_nonfinite"]["module"] == "decoder.0"


def test_healthy_target_has_no_first_nonfinite(capsys, tmp_path):
    result = run(capsys, "doctor", f"{PLANTED}:healthy", "--out", str(tmp_path))
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dtype"] == "bfloat16"  # the device's default
    assert report["first_nonfinite"] is None and report["suggestion"] is None
    assert "No inf/NaN under autocast" in result.out


def test_package_module_target(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TARGETS))
    result = run(capsys, "doctor", "planted_overflow:build", "--dtype", "float16", "--out", str(tmp_path))
    assert result.code == 0, result.err
    assert json.loads((tmp_path / "report.json").read_text())["first_nonfinite"]["module"] == "decoder.0"


def test_policy_file_that_keeps_the_planted_ops_in_float32(capsys, tmp_path):
    policy = mixprec.policies.CPU.with_ops(fp32=["linear", "matmul"])
    path = tmp_path / "safe.toml"
    path.write_text(policy.to_toml())
    result = run(capsys, "doctor", f"{PLANTED}:build", "--dtype", "float16", "--policy", str(path), "--out",
                 str(tmp_path))  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["policy"] == policy.name and report["first_nonfinite"] is None


_SCRIPT = """\
import argparse
import sys

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
ARGS = parser.parse_args()  # at module level, as training scripts do
SEEN = list(sys.argv)


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8)), (torch.randn(4, 8),)


def quits():
    sys.exit(3)
"""


def test_a_target_sees_itself_run_as_python_would_run_it(capsys, tmp_path, monkeypatch):
    """A TARGET file's module-level argparse reads ``[the file]`` (not mixprec's command line), a
    ``package.module:callable`` is found in the working directory as ``python -m`` finds it, and a factory's
    ``sys.exit`` is a one-line error with mixprec's bad-input code, not a silent exit."""
    (tmp_path / "train_script.py").write_text(_SCRIPT)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    argv = list(__import__("sys").argv)
    by_file = run(capsys, "doctor", f"{tmp_path / 'train_script.py'}:build", "--out", str(out))
    assert by_file.code == 0, by_file.err
    by_module = run(capsys, "doctor", "train_script:build", "--out", str(out))
    assert by_module.code == 0, by_module.err
    assert __import__("train_script").SEEN == ["train_script"]
    quitting = run(capsys, "doctor", f"{tmp_path / 'train_script.py'}:quits", "--out", str(out))
    assert quitting.code == 2 and "called sys.exit(3)" in quitting.err and "\n" not in quitting.err.strip()
    assert list(__import__("sys").argv) == argv  # (put back)
    __import__("sys").modules.pop("train_script", None)


_OVERFLOWING_FP8 = """\
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(32, 32) for _ in range(3))
        with torch.no_grad():
            self.b.weight.mul_(30000.0)  # b's float16 output overflows: c's fp8 input amax is inf

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(16, 32) * 10,), lambda out: out.float().pow(2).mean()
"""


def test_an_fp8_call_site_with_an_inf_amax_writes_a_valid_report(capsys, tmp_path):
    (tmp_path / "overflowing_fp8.py").write_text(_OVERFLOWING_FP8)
    (tmp_path / "fp8.toml").write_text(mixprec.policies.FP8.to_toml())
    result = run(capsys, "doctor", f"{tmp_path / 'overflowing_fp8.py'}:build", "--dtype", "float16", "--policy",
                 str(tmp_path / "fp8.toml"), "--out", str(tmp_path / "out"))  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads((tmp_path / "out" / "report.json").read_text())  # (strict JSON: no bare inf or NaN)
    assert report["first_nonfinite"]["module"] == "b"
    amaxes = [row["fp8_amax"] for row in report["ops"] if row["fp8_format"] is not None]
    assert "inf" in amaxes, amaxes
    assert (tmp_path / "out" / "report.html").is_file()
