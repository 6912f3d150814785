"""Per-module precision: ``set_module_policy`` and the ``AutocastModule`` wrapper.

``set_module_policy(module, policy)`` registers a forward pre-hook and a forward
hook. While the module's forward runs (its children's too):

* with a :class:`Policy`, every device whose autocast is on (whoever turned it
  on: ``mixprec.autocast``, ``torch.autocast``, a checkpoint's recompute) uses
  that policy, and a region opened inside with ``policy=None`` uses it too;
* with ``"fp32"``, the floating inputs of every enabled device are cast to
  float32 and autocast is off (a region opened inside turns it on again).

Algorithm::

    pre-hook:  for each device with autocast on: enter a level with the policy
               (or, for "fp32", cast inputs to float32 and enter a disabled level); push a frame
    forward:   runs; nested modules push and pop their own frames
    hook:      if the top frame is this hook's: pop it; leave(its levels)

The hook is registered with ``always_call=True``, so torch calls it also when
forward raises, and the state is restored on exceptions. The frame check keeps
it from closing levels its pre-hook never opened (an earlier pre-hook raised).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from mixprec import _autocast, _custom, _devices, _errors, _install, _recompute, _state
from mixprec.policies import Policy

FP32 = "fp32"


def _enabled_devices() -> list[str]:
    """The device types whose autocast is on in this thread (torch's state)."""
    return [d for d in _devices.DEVICES if _devices.torch_knows(d) and torch.is_autocast_enabled(d)]


class _Frames(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[object, int, bool]] = []  # (hook token, levels opened, pushed a policy)


_frames = _Frames()


@dataclasses.dataclass(frozen=True, eq=False)
class ModulePolicyHandle:
    """What ``set_module_policy`` returns: ``remove()`` takes the policy off the module.

    Also a context manager that removes the policy on exit.
    """

    policy: Policy | str
    _hooks: tuple[Any, ...]
    _token: object

    def remove(self) -> None:
        """Unregister the hooks; calling it again does nothing.

        Raises:
            RuntimeError: if called while the module's forward runs in this thread,
                where removing the hook would leave the policy in force.
        """
        if any(frame[0] is self._token for frame in _frames.stack):
            raise RuntimeError(
                _errors.message(
                    "Cannot remove a module policy now",
                    "the module's forward is running, and its policy is undone only when forward returns",
                    fix="Call remove() after the module's forward has returned.",
                )
            )
        for hook in self._hooks:
            hook.remove()

    def __enter__(self) -> ModulePolicyHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _check_module(where: str, module: object) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            _errors.message(f"{where}: module has the wrong type", "it must be a torch.nn.Module",
                            received={"module": module}, expected="a torch.nn.Module")
        )


def _check(module: object, policy: object) -> None:
    _check_module("set_module_policy", module)
    if isinstance(policy, Policy) or policy == FP32:
        return
    raise (ValueError if isinstance(policy, str) else TypeError)(
        _errors.message(
            "set_module_policy: policy is invalid",
            "it must be a mixprec Policy or the string 'fp32'",
            received={"policy": policy},
            expected="a mixprec.Policy (e.g. mixprec.policies.CPU.with_ops(...)) or 'fp32'",
        )
    )


def set_module_policy(module: torch.nn.Module, policy: Policy | str) -> ModulePolicyHandle:
    """Apply ``policy`` while ``module``'s forward runs, or run it in float32 with ``"fp32"``.

    The policy applies to autocast regions open around the call; with no region
    open, ops run as they would (``"fp32"`` casts nothing then). Setting a
    second policy on the same module nests it inside the first until removed.
    It works through module hooks, so it covers calls ``module(...)``, not
    direct calls of ``module.forward``.

    Args:
        module: The module whose forward (children included) the policy covers.
        policy: A :class:`Policy`, or ``"fp32"`` to cast the module's floating
            inputs to float32 and run it with autocast off.

    Returns:
        A handle whose ``remove()`` takes the policy off again.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> handle = mixprec.set_module_policy(model[1], "fp32")
        >>> with mixprec.autocast("cpu"):
        ...     model(torch.randn(2, 4)).dtype
        torch.float32
        >>> handle.remove()
    """
    _check(module, policy)
    token = object()

    def pre_hook(mod: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        state = _state.get()
        devices = _enabled_devices()
        for entered, device in enumerate(devices):
            dtype, cache = torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()
            try:
                if isinstance(policy, Policy):
                    current = state.active.get(device) or _recompute.setting(device) or _install.setting(device)
                    setting = (
                        _state.Setting(device, policy, from_module=True)
                        if current is None
                        else dataclasses.replace(current, policy=policy, from_module=True)
                    )
                    _autocast.enter(device, setting, dtype, True, cache)
                else:
                    args = _custom._cast_inputs(args, device, torch.float32)
                    kwargs = _custom._cast_inputs(kwargs, device, torch.float32)
                    _autocast.enter(device, None, dtype, False, cache)
            except BaseException:  # the hook closes only what a finished pre-hook opened: close these levels
                _autocast.leave(state, entered)
                raise
        if isinstance(policy, Policy):
            state.module_policies.append(policy)  # regions opened inside take it (autocast.__enter__)
            _state.hold(state)
        _frames.stack.append((token, len(devices), isinstance(policy, Policy)))
        return args, kwargs

    def hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
        stack = _frames.stack
        if not stack or stack[-1][0] is not token:
            return
        _, levels, pushed = stack.pop()
        state = _state.get()
        _autocast.leave(state, levels)
        if pushed:
            state.module_policies.pop()
            _state.release(state)

    hooks = (
        module.register_forward_pre_hook(pre_hook, with_kwargs=True),
        module.register_forward_hook(hook, prepend=True, always_call=True),
    )
    return ModulePolicyHandle(policy, hooks, token)


class AutocastModule(torch.nn.Module):
    """Run a module under ``mixprec.autocast`` without editing its forward.

    The arguments after ``module`` are those of :class:`mixprec.autocast`. The
    wrapped module is the child ``module``, so state dict keys gain the prefix
    ``module.``.

    Example:
        >>> fast = mixprec.AutocastModule(torch.nn.Linear(4, 4), "cpu")
        >>> fast(torch.randn(2, 4)).dtype
        torch.bfloat16
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | None = None,
    ) -> None:
        super().__init__()
        _check_module("AutocastModule", module)
        self.module = module
        self.region = _autocast.autocast(device_type, dtype, enabled, cache_enabled, policy=policy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.region:
            return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return repr(self.region)
