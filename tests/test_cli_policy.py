"""`mixprec policy show|diff|explain`: listings come from the tables."""

from __future__ import annotations

import pytest

import mixprec
from _cli import run


@pytest.mark.parametrize("device,policy", [("cpu", "CPU"), ("cuda", "CUDA"), ("xpu", "XPU"), ("CPU_DOCUMENTED",
                         "CPU_DOCUMENTED")], ids=["cpu", "cuda", "xpu", "cpu-documented"])  # fmt: skip
def test_show_lists_every_op_by_category(capsys, device, policy):
    result = run(capsys, "policy", "show", device)
    assert result.code == 0, result.err
    table = getattr(mixprec.policies, policy)
    flat = " ".join(result.out.split())
    for category in mixprec.Category:
        ops = table.ops(category.value)
        if ops:
            assert f"{category.value} │ {len(ops)} │" in flat
            assert all(op in result.out for op in ops)


def test_diff_names(capsys):
    result = run(capsys, "policy", "diff", "CPU", "CUDA")
    assert result.code == 0, result.err
    changed = mixprec.policies.CPU.diff(mixprec.policies.CUDA)
    assert f"{len(changed)} ops differ: CPU vs CUDA" in result.out
    assert "_addmm_activation" in result.out


def test_diff_toml_file(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(mixprec.policies.CPU.with_ops(fp32=["mm"]).to_toml())
    result = run(capsys, "policy", "diff", "cpu", str(path))
    assert result.code == 0, result.err
    assert "1 ops differ" in result.out and "lower_precision_fp" in result.out and "fp32" in result.out


def test_diff_same(capsys):
    result = run(capsys, "policy", "diff", "CPU", "cpu")
    assert result.code == 0 and "same category" in result.out


@pytest.mark.parametrize("op,category", [("mm", "lower_precision_fp"), ("cdist", "fp32")], ids=["mm", "cdist"])
def test_explain_matches_the_library(capsys, op, category):
    result = run(capsys, "policy", "explain", op, "--dtype", "float16")
    assert result.code == 0, result.err
    expected = mixprec.explain(op, "cpu", mixprec.policies.CPU, dtype=__import__("torch").float16)
    assert category in result.out and " ".join(str(expected).split()) in " ".join(result.out.split())


def test_policy_file_with_custom_ops_needs_their_module(capsys, tmp_path):
    """A policy file naming a custom op is read once `--import` ran the code that registers the op."""
    ops = tmp_path / "cli_rotary_ops.py"
    ops.write_text(
        "import torch\n\n"
        "@torch.library.custom_op('mixprec_cli_test::rotary', mutates_args=())\n"
        "def rotary(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x.clone()\n"
    )
    policy = tmp_path / "custom.toml"
    policy.write_text('name = "custom"\nbase = "CPU"\n\n[ops]\nfp32 = ["mixprec_cli_test::rotary"]\n')
    refused = run(capsys, "policy", "diff", "CPU", str(policy))
    assert refused.code == 2
    assert "No 'mixprec_cli_test::' op is registered in this process" in refused.err
    assert "--import MODULE" in refused.err and "Did you mean" not in refused.err
    result = run(capsys, "policy", "diff", "CPU", str(policy), "--import", str(ops))
    assert result.code == 0, result.err
    assert "1 ops differ" in result.out and "mixprec_cli_test::rotary" in result.out
    missing = run(capsys, "policy", "show", str(policy), "--import", "no_such_module_here")
    assert missing.code == 2 and "--import 'no_such_module_here'" in missing.err
