"""Per-module precision: ``set_module_policy`` and the ``AutocastModule`` wrapper.

``set_module_policy(module, policy)`` wraps the module's ``forward``: the
module's instance attribute ``forward`` becomes a ``PolicyForward`` that runs
the forward the module had inside the levels of its policies. While the
module's forward runs (its children's too):

* with a :class:`Policy`, every device whose autocast is on (whoever turned it
  on: ``mixprec.autocast``, ``torch.autocast``, a checkpoint's recompute) uses
  that policy, and a region opened inside with ``policy=None`` uses it too;
* with ``"fp32"``, the floating inputs of every enabled device are cast to
  float32 and autocast is off (a region opened inside turns it on again).

Algorithm::

    module(*args) -> torch's _call_impl -> module.forward(*args)     (a PolicyForward)
    for each policy, outermost (first set) first:
        with a level: for each device with autocast on
                        Policy: open a level with the setting around, its policy replaced
                        "fp32": cast the floating inputs to float32, open a level with autocast off
    run the forward the module had (its class's, or an instance attribute set before)

Each level is a ``with`` block, so it closes on any exception, KeyboardInterrupt
and SystemExit included (torch runs a forward hook only for ``Exception``).
Under torch.compile dynamo inlines the wrapper; a graph break inside the module
makes it run the frame eagerly and compile the module's forward as a frame of its
own, under the levels (module hooks entered with function calls could not
carry the state across the break). A direct call of ``module.forward`` is
covered too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from mixprec import _autocast, _compat, _errors
from mixprec.engine import _cast, _compile, _devices, _installation, _kernels, _recompute, _state, _tables
from mixprec.policies import Policy

FP32 = "fp32"
_dynamo_compiling = torch.compiler.is_dynamo_compiling


@functools.cache
def _installation_devices() -> tuple[str, ...]:
    """The devices ``install`` gives the ``torch.autocast`` regions of: those with an Autocast key, present (as
    ``install`` finds them; asked once)."""
    return tuple(d for d, spec in _devices.DEVICES.items() if _tables.autocast_key(d) is not None and spec.available())


class _Level:
    """The levels one module policy opens around its module's forward (a context manager)."""

    def __init__(self, policy: Policy | str) -> None:
        self.policy = policy
        self.devices: tuple[str, ...] = ()
        self.opened: list[Any] = []  # traced: the level contexts; eager: one entry per level opened

    def __enter__(self) -> _Level:
        policy = self.policy
        if _dynamo_compiling():
            self.devices = _compile.enabled_devices()
            for device in self.devices:
                dtype, cache = torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()
                if isinstance(policy, Policy):
                    token = _compile.module_token(device, _compat.to_constant(policy))
                    opened = _autocast.level(device, None, dtype, True, cache, token)
                else:
                    opened = _autocast.level(device, None, dtype, False, cache)
                opened.__enter__()
                self.opened.append(opened)
            if isinstance(policy, Policy):
                _compile.push_module(_compile.policy_token(_compat.to_constant(policy)))
            return self
        state = _state.get()
        self.devices = tuple(_devices.enabled())
        try:
            for device in self.devices:
                dtype, cache = torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled()
                if isinstance(policy, Policy):
                    setting = _state.module_setting(device, policy, _recompute.around(device))
                    _autocast.enter(device, setting, dtype, True, cache)
                else:
                    _autocast.enter(device, None, dtype, False, cache)
                self.opened.append(device)
        except BaseException:
            _autocast.leave(state, len(self.opened))
            raise
        if isinstance(policy, Policy):
            state.module_policies.append(policy)  # regions opened inside take it (autocast.__enter__)
            _state.hold(state)
            if _installation.current is not None:
                self._installed(policy)
        return self

    def _installed(self, policy: Policy) -> None:
        """Under ``install``, for each device it covers that autocast was off for here: a ``torch.autocast``
        region opened inside the module runs under its policy (``_kernels``), whose kernels this registers, and
        a checkpoint this module runs inside records the setting around the module first (``_recompute``)."""
        installation = _installation.current
        if installation is None:
            return
        for device in _installation_devices():
            if device in self.devices:
                continue
            _recompute.record_around(device, None)
            for dtype in _devices.DEVICES[device].supported_dtypes:
                setting = installation.setting_for(device, dtype, policy)  # (memoized, and ensured once each)
                if setting.derived.get("ready") is not _kernels.generation:
                    _kernels.ensure(setting)

    def __exit__(self, *exc_info: object) -> None:
        if _dynamo_compiling():
            if isinstance(self.policy, Policy):
                _compile.pop_module()
            for opened in reversed(self.opened):
                opened.__exit__(*exc_info)
            return
        state = _state.get()
        _autocast.leave(state, len(self.opened))
        if isinstance(self.policy, Policy):
            state.module_policies.pop()
            _state.release(state)

    def cast(self, value: Any) -> Any:
        """An argument with its floating tensors on the level's devices cast to float32 (``"fp32"`` only)."""
        if self.policy != FP32:
            return value
        for device in self.devices:
            value = _cast.cast_tree(value, device, torch.float32)
        return value


class PolicyForward:
    """A module's ``forward`` under ``set_module_policy``: its policies' levels around the forward it had.

    It stands in for the bound method it wraps: ``__wrapped__``, ``__signature__`` and ``__name__`` are
    the original's, so code that inspects ``module.forward`` (a trainer that drops unused input columns)
    sees the real parameters.
    """

    def __init__(self, module: torch.nn.Module, inner: Any) -> None:
        self.module = module
        self.inner = inner  # the instance attribute ``forward`` the module had, or None: its class's forward
        self.policies: list[tuple[object, Policy | str]] = []  # (handle token, policy), outermost first

    @property
    def __wrapped__(self) -> Any:
        inner = self.inner
        return inner if inner is not None else type(self.module).forward.__get__(self.module)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__wrapped__)

    @property
    def __name__(self) -> str:
        return str(getattr(self.__wrapped__, "__name__", "forward"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(0, list(self.policies), args, kwargs)

    def _run(self, index: int, policies: list[tuple[object, Policy | str]], args: Any, kwargs: Any) -> Any:
        if index == len(policies):
            inner = self.inner
            if inner is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            return inner(*args, **kwargs)
        with _Level(policies[index][1]) as level:
            try:
                return self._run(index + 1, policies, level.cast(args), level.cast(kwargs))
            except RuntimeError as error:
                if level.policy == FP32:
                    _explain_fp32_failure(self.module, error)
                raise

    def __repr__(self) -> str:
        names = ", ".join(p if isinstance(p, str) else p.name for _, p in self.policies)
        return f"<forward of {type(self.module).__name__} under mixprec module policies [{names}]>"


class _Replicate:
    """A module's ``_replicate_for_data_parallel`` while it has a ``PolicyForward``: torch's, then the replica
    gets a ``PolicyForward`` of its own. torch's copies the module's ``__dict__``, so the replica would
    otherwise share the original's, which runs the original module (its parameters, on its device), not the
    replica (``nn.DataParallel``'s ``replicate`` calls this on each module, each forward)."""

    def __init__(self, forward: PolicyForward) -> None:
        self.forward = forward

    def __call__(self) -> torch.nn.Module:
        original = self.forward
        replica = type(original.module)._replicate_for_data_parallel(original.module)
        own = _wrap(replica, _rebound(original.inner, original.module, replica))
        own.policies = list(original.policies)
        return replica


def _rebound(inner: Any, original: torch.nn.Module, module: torch.nn.Module) -> Any:
    """A ``PolicyForward``'s ``inner`` for a copy of its module: a method bound to the original, bound to the
    copy instead (any other callable as it is)."""
    if inspect.ismethod(inner) and inner.__self__ is original:
        return inner.__func__.__get__(module)
    return inner


def _refuse_script() -> torch.nn.Module:
    raise RuntimeError(
        _errors.message(
            "torch.jit.script cannot compile a module under set_module_policy",
            "TorchScript compiles the module's class forward, which would drop the policy",
            fix="Script the module without its policy (handle.remove()), or use torch.compile or "
            "torch.jit.trace, which run the policy; in TorchScript, a `with torch.autocast(...)` block "
            "inside forward is how autocast is written.",
        )
    )


def _wrap(module: torch.nn.Module, inner: Any) -> PolicyForward:
    """Give ``module`` a ``PolicyForward`` around ``inner`` (what its own ``forward`` attribute was, or None),
    with the attributes that go with it: its ``_Replicate`` and the hook that refuses TorchScript."""
    forward = PolicyForward(module, inner)
    module.__dict__["forward"] = forward
    module.__dict__["_replicate_for_data_parallel"] = _Replicate(forward)
    module.__dict__[_compat.SCRIPT_PREPARE] = _refuse_script
    return forward


_FP32_FAILED = "failed under set_module_policy(module, 'fp32')"
_DTYPE_WORDS = ("dtype", "scalar type", "BFloat16", "Half", "bfloat16", "float16")


def _explain_fp32_failure(module: torch.nn.Module, error: RuntimeError) -> None:
    """Where a module under ``"fp32"`` failed on a dtype and holds low-precision weights, say that the policy is
    why: it runs the module with autocast off and float32 inputs, which meet those weights."""
    text = str(error)
    if _FP32_FAILED in text or not any(word in text for word in _DTYPE_WORDS):
        return
    low = sorted({str(p.dtype) for p in module.parameters() if p.is_floating_point() and p.dtype.itemsize < 4})
    if not low:
        return
    raise RuntimeError(
        _errors.message(
            f"{type(module).__name__} {_FP32_FAILED}",
            f"'fp32' runs it with autocast off and float32 inputs, and its weights are {', '.join(low)} "
            f"(torch: {text.strip().splitlines()[0]})",
            fix="Make the module's weights float32 (module.float()), or give it a Policy that moves its ops to "
            "the fp32 category (policies.CPU.with_ops(fp32=['linear'])), which casts the weights too.",
        )
    ) from error


@dataclasses.dataclass(frozen=True, eq=False)
class ModulePolicyHandle:
    """What ``set_module_policy`` returns: ``remove()`` takes the policy off the module.

    Also a context manager that removes the policy on exit.
    """

    policy: Policy | str
    _forward: PolicyForward | None  # (None once removed: a removed handle keeps no module alive)
    _token: object

    def remove(self) -> None:
        """Take the policy off; calling it again does nothing. A call of the module running now keeps its
        levels until it returns; later calls run without the policy."""
        forward = self._forward
        if forward is None:
            return
        object.__setattr__(self, "_forward", None)
        forward.policies[:] = [entry for entry in forward.policies if entry[0] is not self._token]
        module, inner = forward.module, forward.inner
        if not forward.policies and module.__dict__.get("forward") is forward:
            if inner is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = inner
            module.__dict__.pop("_replicate_for_data_parallel", None)
            if module.__dict__.get(_compat.SCRIPT_PREPARE) is _refuse_script:
                del module.__dict__[_compat.SCRIPT_PREPARE]

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
    It wraps the module's ``forward`` (an instance attribute, taken off again by
    ``remove()``), so calls ``module(...)`` and ``module.forward(...)`` are
    covered, and the levels close on any exception, KeyboardInterrupt included.
    ``nn.DataParallel``'s replicas keep the policy and run themselves; a shallow
    ``copy.copy`` of the module shares the original's ``forward``, and so runs
    the original, until the copy is given a policy of its own (then it runs
    itself, under the policies set on it) or is made with ``copy.deepcopy``
    (which keeps the policies). ``torch.jit.script`` refuses the module while
    it has a policy.
    Arguments pass through as they are: ``"fp32"`` casts the tensors among them,
    also inside lists, tuples and dicts, and rebuilds no other object.

    Args:
        module: The module whose forward (children included) the policy covers.
        policy: A :class:`Policy`, or ``"fp32"`` to cast the module's floating
            inputs to float32 and run it with autocast off.

    Returns:
        A handle whose ``remove()`` takes the policy off again.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> handle = mixprec.set_module_policy(model[1], "fp32")
        >>> with mixprec.autocast("cpu"):
        ...     model(torch.randn(2, 4)).dtype
        torch.float32
        >>> handle.remove()
    """
    _check(module, policy)
    forward = module.__dict__.get("forward")
    if isinstance(forward, PolicyForward) and forward.module is not module:
        # a shallow copy's: the original's, which runs the original; the copy gets its own, around the forward
        # the original's wraps (bound to the copy), with only the policies set on the copy
        forward = _wrap(module, _rebound(forward.inner, forward.module, module))
    elif not isinstance(forward, PolicyForward):
        forward = _wrap(module, forward)
    token = object()
    forward.policies.append((token, policy))
    return ModulePolicyHandle(policy, forward, token)


class AutocastModule(torch.nn.Module):
    """Run a module under ``mixprec.autocast`` without editing its forward.

    The arguments after ``module`` are those of :class:`mixprec.autocast`. The
    wrapped module is the child ``module``, so state dict keys gain the prefix
    ``module.``.

    Examples:
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
        compute: str = "auto",
    ) -> None:
        super().__init__()
        _check_module("AutocastModule", module)
        self.module = module
        self.region = _autocast.autocast(device_type, dtype, enabled, cache_enabled, policy=policy, compute=compute)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.region._fresh():
            return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return repr(self.region)
