"""The installation in force (``mixprec.install``): every ``torch.autocast`` region in the process follows it.

Frameworks (Hugging Face ``Trainer``, Accelerate, Lightning) open ``torch.autocast``
regions themselves. mixprec's kernels at the Autocast keys already run in those
regions; with no mixprec setting in the thread they do what torch's kernels do.
``install`` gives them a setting to use instead: the installed policy (or each
device's default) and compute, resolved per device and autocast dtype, since
``compute="auto"`` decides by dtype. A ``mixprec.autocast`` region still uses its
own setting, and a checkpoint's recompute the one its forward used.

Algorithm::

    install(policy, compute):  check the arguments as autocast does
                               register the kernels of (device, dtype) for every usable device and dtype
                               current = the installation     (replacing any earlier one)
    kernel, no region setting: setting = current.setting_for(device, torch.get_autocast_dtype(device))
                               (inside a module under a module policy, entered while autocast was off for the
                               device: the module's policy with the installation's compute)
    handle.remove():           current = None if it is still this installation
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from mixprec.engine import _compute, _memo, _state, _tables
from mixprec.policies import Policy

_lock = threading.Lock()
#: How many module policies' settings an installation keeps (the oldest goes first, made again if needed).
_MODULE_SETTINGS = 256


@dataclasses.dataclass(frozen=True, eq=False)
class Installation:
    """One ``install`` call: what it installed, and the settings it resolved."""

    policy: Policy | None
    compute: str
    _settings: dict[tuple[str, torch.dtype], _state.Setting] = dataclasses.field(default_factory=dict, repr=False)
    _module_settings: _memo.Memo[tuple[str, torch.dtype, Policy], _state.Setting] = dataclasses.field(
        default_factory=lambda: _memo.Memo(_MODULE_SETTINGS, "installed module settings", reset=False), repr=False
    )

    def setting_for(self, device_type: str, dtype: torch.dtype, module: Policy | None = None) -> _state.Setting:
        """The setting for regions on ``device_type`` in ``dtype``; with ``module``, for those opened inside a
        module under that module policy (the installation's compute, the module's policy)."""
        if module is not None:
            found = self._module_settings.get((device_type, dtype, module))
            if found is None:
                found = _state.module_setting(device_type, module, self.setting_for(device_type, dtype))
                # (bounded: a run may make a module policy of new content at every step)
                self._module_settings.put((device_type, dtype, module), found)
            return found
        found = self._settings.get((device_type, dtype))
        if found is None:
            policy = self.policy if self.policy is not None else _tables.default_policy(device_type)
            found = _state.make_setting(
                device_type,
                policy,
                _compute.emulates(self.compute, device_type, dtype),
                _compute.emulated_ops(self.compute, device_type, dtype),
            )
            self._settings[(device_type, dtype)] = found
        return found


current: Installation | None = None
#: Told, with whether nothing is installed now, when ``current`` changes (``_kernels`` sets it for the C++
#: kernels, which must leave a call with no setting to Python while an installation is in force).
on_change: Callable[[bool], None] | None = None


class InstallHandle:
    """What ``mixprec.install`` returns: ``remove()`` gives torch's native autocast back.

    Also a context manager that removes the installation on exit.
    """

    def __init__(self, installation: Installation) -> None:
        self._installation = installation

    @property
    def policy(self) -> Policy | None:
        return self._installation.policy

    @property
    def compute(self) -> str:
        return self._installation.compute

    @property
    def active(self) -> bool:
        """Whether this installation is the one in force (a later ``install`` replaces it)."""
        return current is self._installation

    def remove(self) -> None:
        """Uninstall, if this is still the installation in force; calling it again does nothing."""
        global current
        with _lock:
            if current is self._installation:
                current = None
                if on_change is not None:
                    on_change(True)

    def __enter__(self) -> InstallHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        name = "default policies" if self.policy is None else f"policy {self.policy.name!r}"
        return f"InstallHandle({name}, compute={self.compute!r}, active={self.active})"


def put(installation: Installation) -> None:
    """Put ``installation`` in force, replacing any earlier one."""
    global current
    with _lock:
        current = installation
        if on_change is not None:
            on_change(False)


def installed_setting(device_type: str, module: Policy | None = None) -> _state.Setting | None:
    """The installed setting for ``device_type`` at torch's current autocast dtype (with ``module``: inside a
    module under that module policy), or None."""
    installation = current
    if installation is None:
        return None
    return installation.setting_for(device_type, torch.get_autocast_dtype(device_type), module)


def policy() -> Policy | None:
    """The installed policy, or None (nothing installed, or each device's default)."""
    installation = current
    return None if installation is None else installation.policy


def key() -> tuple[Policy | None, str] | None:
    """What is installed, as a value for guards on compiled code (None when nothing is installed)."""
    installation = current
    return None if installation is None else (installation.policy, installation.compute)
