"""mixprec's own thread-local state, beside torch's autocast state.

A region sets torch's autocast state for its device (enabled, dtype, cache,
nesting), so everything that asks torch sees it. What torch has no slot for,
the policy and the compute choice, lives here: for each device, the innermost
mixprec ``Setting`` of this thread. The kernels at the Autocast keys read it;
a thread with no setting for a device (a plain ``torch.autocast`` region) gets
the device's native behaviour.

``holders`` says, without touching any thread's state, whether mixprec holds
anything: while no mixprec kernel is registered, torch's kernels do all the
work, and a region of the device's default policy with native compute that
opens in a thread with no mixprec levels sets torch's state only, exactly as
``torch.autocast`` does (``autocast.__enter__``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from mixprec import _compat
from mixprec.engine import _memo
from mixprec.policies import Policy


@dataclasses.dataclass(frozen=True, eq=False)
class Setting:
    """What a mixprec region adds to torch's state for one device: the policy and the compute."""

    device_type: str
    policy: Policy
    emulate: bool = False  # every lower_precision_fp op computes emulated
    emulate_ops: frozenset[str] = frozenset()  # these overloads too, under native compute (compute="auto")
    from_module: bool = False  # set by set_module_policy's hook (which runs again in a checkpoint's recompute)
    #: The setting's content, hashable: caches key a setting by it (an equal setting made later shares them).
    key: tuple[str, Policy, bool, frozenset[str], bool] = dataclasses.field(init=False, repr=False)
    #: What the engine derived for this setting, filled in by ``_kernels`` (``"ready"``: the kernel generation
    #: that ``ensure`` registered its kernels under; ``"entries"``: ``{overload: (rule, emulate)}``). A dict
    #: the frozen setting holds, not a field it changes.
    derived: dict[str, Any] = dataclasses.field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        key = (self.device_type, self.policy, self.emulate, self.emulate_ops, self.from_module)
        object.__setattr__(self, "key", key)  # (a frozen dataclass sets its derived fields so)
        _compat.share(self)  # findable from compiled code on releases whose dynamo cannot pass it


def module_setting(device_type: str, policy: Policy, around: Setting | None) -> Setting:
    """The setting a module policy puts in force on ``device_type``: the one ``around`` it (its compute), with the
    module's policy."""
    if around is None:
        return Setting(device_type, policy, from_module=True)
    return dataclasses.replace(around, policy=policy, from_module=True)


_settings: _memo.Memo[tuple[str, Policy, bool, frozenset[str]], Setting] = _memo.Memo(256, "settings")


def make_setting(device_type: str, policy: Policy, emulate: bool, emulate_ops: frozenset[str]) -> Setting:
    """The one ``Setting`` for these values (memoized by content: regions are entered once per step)."""
    key = (device_type, policy, emulate, emulate_ops)
    found = _settings.get(key)
    if found is None:
        found = _settings.put(key, Setting(device_type, policy, emulate, emulate_ops))
    return found


#: One open region level, what to restore when it closes: (device type, whether the level set a mixprec
#: setting, the thread's setting before it, torch's state before it: a tuple (enabled, dtype, cache) on the
#: eager path, else what torch.amp._enter_autocast returned).
Frame = tuple[str, bool, "Setting | None", Any]


#: The ident of each thread with open levels, settings or module policies (a thread is released when it has
#: none). With ``kernels_registered``, what a region of the default policy must not bypass.
holders: set[int] = set()
#: Whether mixprec has kernels at an Autocast key (``_kernels``): they read the settings, so every region must
#: set its own then.
kernels_registered = False


def set_kernels_registered(registered: bool) -> None:
    global kernels_registered
    kernels_registered = registered


#: Told of every change to a thread's settings, on that thread: ``(device type, its setting now or None)``.
#: ``_kernels`` sets it once it has C++ kernels, which keep a copy of each thread's plans (``_fastpath``).
on_change: Callable[[str, Setting | None], None] | None = None


class ActiveSettings(dict[str, Setting]):
    """A thread's settings, device type -> innermost setting: a dict that tells ``on_change`` of each change."""

    def __setitem__(self, device_type: str, setting: Setting) -> None:
        before = super().get(device_type)
        super().__setitem__(device_type, setting)
        if on_change is not None:
            try:
                on_change(device_type, setting)
            except BaseException:  # (told nothing: the thread keeps the setting it had, here as in C++)
                if before is None:
                    super().pop(device_type, None)
                else:
                    super().__setitem__(device_type, before)
                raise

    def pop(self, device_type: str, *default: Any) -> Any:  # type: ignore[override]
        found = super().pop(device_type, *default)
        if on_change is not None:
            on_change(device_type, None)
        return found

    def clear(self) -> None:
        devices = list(self)
        super().clear()
        if on_change is not None:
            for device_type in devices:
                on_change(device_type, None)

    def update(self, *others: Any, **more: Any) -> None:
        for device_type, setting in dict(*others, **more).items():
            self[device_type] = setting

    def __delitem__(self, device_type: str) -> None:
        self.pop(device_type)

    def setdefault(self, device_type: str, setting: Any = None) -> Any:
        if device_type not in self:
            self[device_type] = setting
        return self[device_type]

    def popitem(self) -> tuple[str, Setting]:
        device_type, setting = super().popitem()
        if on_change is not None:
            on_change(device_type, None)
        return device_type, setting


class ThreadState(threading.local):
    def __init__(self) -> None:
        self.ident = threading.get_ident()  # this thread's entry in ``holders``
        self.active: dict[str, Setting] = ActiveSettings()  # device type -> innermost mixprec setting
        self.frames: list[Frame] = []
        self.module_policies: list[Policy] = []  # set_module_policy: innermost last
        # One per setting pushed (``_region.push_setting``), innermost last: its device and the checkpoint whose
        # recompute pushed it (``_recompute.recompute_holder``), or None (pushed outside any recompute).
        self.pushes: list[tuple[str, Any]] = []
        self.cache: Any = None  # mixprec's cast cache kept in Python (``_cast.thread_cache``)

    @property
    def nesting(self) -> int:
        return len(self.frames)


_state = ThreadState()


_holding = threading.Lock()  # (taken as a thread starts or stops holding: once per outermost region)


def hold(state: ThreadState) -> None:
    """``state``'s thread holds mixprec state (it opened a level, set a setting or entered a module policy)."""
    if state.ident in holders:
        return
    with _holding:
        holders.add(state.ident)


def release(state: ThreadState) -> None:
    """Take ``state``'s thread out of ``holders`` if it holds nothing any more."""
    if not state.frames and not state.active and not state.module_policies and state.ident in holders:
        with _holding:
            holders.discard(state.ident)


def get() -> ThreadState:
    """This thread's mixprec state."""
    return _state
