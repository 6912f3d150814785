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


@pytest.mark.parametrize("name", ["finetune [fast]", "[/]", "[bold]x"])
def test_a_policy_name_is_printed_as_it_is_not_as_markup(capsys, tmp_path, name):
    """Rich read a user's strings as markup: ``finetune [fast]`` printed as ``finetune``, ``[/]`` crashed."""
    path = tmp_path / "named.toml"
    path.write_text(mixprec.Policy.from_dict({"name": name, "base": "CPU", "ops": {"fp32": ["softmax"]}}).to_toml())
    for argv in (["policy", "show", str(path)], ["policy", "diff", str(path), "CPU"]):
        result = run(capsys, *argv)
        assert result.code == 0 and name in result.out, result.err


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


def test_show_and_diff_include_the_fp8_recipe(capsys, tmp_path):
    """A policy's fp8 recipe is policy data too: ``show`` prints it and ``diff`` compares it (two policies
    with the same ops, one delayed, used to read "the same"); columns are named by the arguments where the
    policies share a name (``with_ops`` keeps the base's)."""
    path = tmp_path / "fp8_delayed.toml"
    path.write_text(mixprec.policies.FP8.with_fp8_recipe(scaling="delayed", history=4).to_toml())
    shown = run(capsys, "policy", "show", str(path))
    assert shown.code == 0 and "fp8 recipe: scaling='delayed'" in shown.out and "history=4" in shown.out
    compared = run(capsys, "policy", "diff", "FP8", str(path))
    assert compared.code == 0 and "fp8 recipes differ: FP8 vs " in compared.out
    assert "'tensorwise'" in compared.out and "'delayed'" in compared.out and "16" in compared.out
    plain = run(capsys, "policy", "show", "CPU")
    assert "fp8 recipe" not in plain.out


def test_explain_answers_for_a_device_this_machine_lacks_and_under_a_named_policy(capsys):
    cuda = run(capsys, "policy", "explain", "softmax", "--device", "cuda")
    assert cuda.code == 0 and "softmax under cuda autocast to float16, policy CUDA" in cuda.out.replace("\n", " ")
    fp8 = run(capsys, "policy", "explain", "linear", "--policy", "FP8")
    assert fp8.code == 0 and "policy FP8: fp8" in fp8.out.replace("\n", " ")
    unknown = run(capsys, "policy", "explain", "softmax", "--device", "tpu")
    assert unknown.code == 2 and "unknown device 'tpu'" in unknown.err
