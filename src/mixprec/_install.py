"""``mixprec.install``: every ``torch.autocast`` region in the process follows mixprec.

The installation itself (what is in force, the settings it resolves, the handle) is engine state
(``mixprec.engine._installation``); this module checks the arguments and registers the kernels first.
"""

from __future__ import annotations

from mixprec import _errors
from mixprec.engine import _compute, _installation, _kernels
from mixprec.engine._installation import InstallHandle
from mixprec.policies import Policy

__all__ = ["InstallHandle", "install"]


def install(policy: Policy | None = None, *, compute: str = "auto") -> InstallHandle:
    """Make every ``torch.autocast`` region in the process follow mixprec.

    From this call on, regions that frameworks or libraries open with
    ``torch.autocast`` (Hugging Face ``Trainer(bf16=True)``,
    ``Accelerator(mixed_precision="bf16")``, Lightning's ``precision="bf16-mixed"``),
    in any thread, apply ``policy`` (each device's default if None) and ``compute``.
    A ``mixprec.autocast`` region keeps its own policy. Installing again replaces
    the earlier installation, whose handle then does nothing on ``remove()``.

    Args:
        policy: The policy for every device, or None for each device's default.
        compute: ``"auto"``, ``"native"`` or ``"emulated"``, as for ``mixprec.autocast``.

    Returns:
        A handle whose ``remove()`` gives torch's native autocast back (also a context manager).

    Examples:
        >>> handle = mixprec.install(mixprec.policies.CPU.with_ops(fp32=["linear"]))
        >>> with torch.autocast("cpu"):
        ...     torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype
        torch.float32
        >>> handle.remove()
    """
    _errors.check_type("policy", policy, Policy, optional=True)
    _compute.check_compute(compute)
    installation = _installation.Installation(policy, compute)
    _kernels.ensure_installed(installation)
    _installation.put(installation)
    return _installation.InstallHandle(installation)
