"""mixprec: automatic mixed precision for PyTorch, with its op policy as data.

Examples:
    >>> import torch, mixprec
    >>> with mixprec.autocast("cpu"):
    ...     torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype
    torch.bfloat16
"""

from mixprec import _compat

_compat.require_supported()

from mixprec import cpu, cuda, policies, xpu
from mixprec._autocast import autocast, get_autocast_dtype, get_policy, is_autocast_enabled
from mixprec._call_sites import CallSite, CallSites
from mixprec._custom import custom_bwd, custom_fwd
from mixprec._errors import AutocastDisabledWarning, MixprecWarning
from mixprec._explain import Explanation, explain
from mixprec._fp8_layers import Fp8Layers, LayerChoice, choose_fp8_layers
from mixprec._install import InstallHandle, install
from mixprec._module import AutocastModule, ModulePolicyHandle, set_module_policy
from mixprec.engine._amax import AmaxHistory
from mixprec.engine._compute import KernelSupport, kernel_support
from mixprec.policies import Category, Policy
from mixprec.scaler import GradScaler, ScaleRecord, ScalerStateError

__all__ = [
    "AmaxHistory",
    "AutocastDisabledWarning",
    "AutocastModule",
    "CallSite",
    "CallSites",
    "Category",
    "Explanation",
    "Fp8Layers",
    "GradScaler",
    "InstallHandle",
    "KernelSupport",
    "LayerChoice",
    "MixprecWarning",
    "ModulePolicyHandle",
    "Policy",
    "ScaleRecord",
    "ScalerStateError",
    "autocast",
    "choose_fp8_layers",
    "cpu",
    "cuda",
    "custom_bwd",
    "custom_fwd",
    "explain",
    "get_autocast_dtype",
    "get_policy",
    "install",
    "is_autocast_enabled",
    "kernel_support",
    "policies",
    "set_module_policy",
    "xpu",
]

__version__ = "0.1.0"

# Subpackages with heavier imports load on first use, so `import mixprec` stays light and
# `mixprec.graph.apply_policy` still works after a plain `import mixprec`.
_LAZY = ("diagnostics", "graph", "integrations")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"mixprec.{name}")
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
