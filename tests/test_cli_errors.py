"""Bad input to the `mixprec` command: one line naming what was wrong, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from _cli import PLANTED, TARGETS, run

CASES = {
    "missing-target": (["doctor"], "Missing argument 'TARGET'"),
    "target-file-missing": (["doctor", "no/such/file.py:build"], "does not exist"),
    "target-module-missing": (["doctor", "no_such_module_xyz:build"], "cannot be imported"),
    "target-no-colon": (["doctor", "just_text"], "must be path/to/file.py:callable"),
    "target-attribute-missing": (["doctor", f"{PLANTED}:missing"], "has no attribute 'missing'"),
    "target-not-callable": (["doctor", f"{PLANTED}:NOT_CALLABLE"], "is not callable"),
    "target-raises": (["doctor", f"{PLANTED}:raises"], "raised FileNotFoundError: weights.pt"),
    "target-wrong-shape": (["doctor", f"{PLANTED}:wrong_shape"], "expected (model, example_inputs)"),
    "target-import-raises": (["doctor", f"{TARGETS / 'raises_on_import.py'}:build"],
                             "raised RuntimeError as it was imported: module level setup failed"),
    "target-exits-in-forward": (["doctor", f"{PLANTED}:exits_in_forward"],
                                "called sys.exit(0) while the doctor ran it"),
    "doctor-unknown-device": (["doctor", f"{PLANTED}:build", "--device", "tpu"], "unknown device 'tpu'"),
    "doctor-unavailable-device": (["doctor", f"{PLANTED}:build", "--device", "mps"], "not available"),
    "doctor-unknown-dtype": (["doctor", f"{PLANTED}:build", "--dtype", "int8"], "unknown dtype 'int8'"),
    "doctor-policy-missing": (["doctor", f"{PLANTED}:build", "--policy", "nope.toml"], "does not exist"),
    "demo-unknown-device": (["demo", "--device", "tpu"], "unknown device 'tpu'"),
    "demo-zero-steps": (["demo", "--steps", "0"], "--steps"),
    "policy-unknown": (["policy", "show", "nope"], "unknown policy 'nope'"),
    "policy-diff-unknown": (["policy", "diff", "CPU", "nope"], "unknown policy 'nope'"),
    "explain-unknown-op": (["policy", "explain", "notanop"], "cannot explain op 'notanop'"),
    "unknown-command": (["bogus"], "No such command 'bogus'"),
}


@pytest.mark.parametrize("argv,needle", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    result = run(capsys, *argv)
    assert result.code == 2
    assert result.err.startswith("mixprec: error: ") and result.err.count("\n") == 1, result.err
    assert needle in result.err
    assert "Traceback" not in result.err + result.out


@pytest.mark.parametrize("command", [["doctor", f"{PLANTED}:build"], ["demo", "--steps", "1"]], ids=["doctor", "demo"])
def test_an_out_directory_that_cannot_be_made_is_refused_before_the_run(capsys, tmp_path, command):
    """``--out`` under a file: refused at once (it was a traceback after the whole run)."""
    (tmp_path / "afile").write_text("")
    result = run(capsys, *command, "--out", str(tmp_path / "afile" / "sub"))
    assert result.code == 2 and result.err.startswith("mixprec: error: --out ") and "cannot be made" in result.err
    assert "Traceback" not in result.err + result.out and result.err.count("\n") == 1


def test_the_command_without_its_extra_says_what_to_install(capsys, monkeypatch):
    """`pip install mixprec` alone has no typer: the console script names the extra instead of a traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "typer" else real(name, *a))
    result = run(capsys, "policy", "show", "cpu")
    assert result.code == 2
    assert result.err.strip() == (
        "mixprec: error: the mixprec command needs the cli extra (typer not installed); "
        "install it with: pip install 'mixprec[cli]'"
    )
