"""torch.cpu.amp / torch.cuda.amp / torch.xpu.amp names, and a clean import."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

import mixprec


def test_cpu_amp_autocast_defaults_to_bfloat16():
    with mixprec.cpu.amp.autocast():
        assert mixprec.get_autocast_dtype("cpu") is torch.bfloat16
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.bfloat16


def test_cpu_amp_autocast_takes_dtype_and_enabled():
    with mixprec.cpu.amp.autocast(dtype=torch.float16):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.float16
    with mixprec.cpu.amp.autocast(enabled=False):
        assert not mixprec.is_autocast_enabled("cpu")


def test_cuda_and_xpu_namespaces_name_their_devices():
    assert mixprec.cuda.amp.autocast(enabled=False).device == "cuda"
    assert mixprec.cuda.amp.autocast(enabled=False).fast_dtype is torch.float16
    assert mixprec.xpu.amp.autocast(enabled=False).device == "xpu"
    assert mixprec.xpu.amp.autocast(enabled=False).fast_dtype is torch.bfloat16


def test_is_autocast_enabled_with_no_argument_asks_about_cuda_as_torchs_does():
    assert mixprec.is_autocast_enabled() is torch.is_autocast_enabled() is False
    with torch.autocast("cuda", enabled=True) if torch.cuda.is_available() else mixprec.autocast("cpu"):
        assert mixprec.is_autocast_enabled() is torch.is_autocast_enabled()


def test_import_does_no_work():
    code = (
        "import sys, mixprec, mixprec.policies as p;"
        "import mixprec.policies._policy as pol;"
        "assert p._build.cache_info().currsize == 0, 'a policy was built at import';"
        "assert 'transformers' not in sys.modules and 'numpy.testing' not in sys.modules;"
        "assert not {'typer', 'rich', 'matplotlib', 'sklearn'} & set(sys.modules), 'the cli extra was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_surface():
    assert set(mixprec.__all__) >= {
        "autocast", "is_autocast_enabled", "get_autocast_dtype", "get_policy",
        "custom_fwd", "custom_bwd", "policies", "Policy",
    }


def test_subpackages_load_on_first_use():
    """`mixprec.graph.apply_policy` works after a plain `import mixprec`, which does not import graph itself."""
    code = (
        "import sys, mixprec;"
        "assert 'mixprec.graph' not in sys.modules and 'mixprec.diagnostics' not in sys.modules;"
        "assert callable(mixprec.graph.apply_policy) and 'mixprec.graph' in sys.modules;"
        "assert mixprec.integrations.__name__ == 'mixprec.integrations' and 'graph' in dir(mixprec)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'grpah'"):
        mixprec.grpah  # noqa: B018


def test_import_mixprec_needs_torch_alone():
    """The core dependencies are torch, what the C++ kernels' build needs (ninja, setuptools; used on first
    use, not at import) and tomli on Python 3.10; the CLI's libraries are the cli extra."""
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split(";")[0].strip() for d in project["dependencies"]]
    assert names == ["torch", "ninja", "setuptools", "tomli"]
    cli = {d.split(">")[0] for d in project["optional-dependencies"]["cli"]}
    assert cli == {"typer", "rich", "matplotlib", "scikit-learn"}


def test_policies_all_names_every_built_in_policy_as_a_string():
    # The API reference reads __all__ statically (griffe): built from BUILTIN at run time, it broke the docs build.
    assert all(isinstance(name, str) for name in mixprec.policies.__all__)
    assert set(mixprec.policies.BUILTIN) <= set(mixprec.policies.__all__)
