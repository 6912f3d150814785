"""Guards for compiled code: a graph traced under some mixprec settings is not reused under others.

The kernels at the Autocast keys bake their casts into a traced graph, and dynamo
does not see mixprec's thread-local settings. ``guard_trace`` runs (eagerly)
the first time a trace meets a mixprec kernel or region and adds a guard on the
settings the frame was entered with, so that a call under other settings
recompiles. A trace that meets no mixprec kernel needs no guard: mixprec cannot
change what it computes, and ``_kernels.register`` resets dynamo when new
kernels appear.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec import _install, _state


def _entry_key() -> tuple[Any, ...]:
    """This thread's mixprec settings and the installation, as a comparable value (the policies are kept
    alive by the guard, the installation by _install)."""
    return (_install.key(), *sorted((device, setting.key) for device, setting in _state.get().active.items()))


def guard_trace() -> None:
    """Guard the frame being compiled on this thread's mixprec settings at its entry (run eagerly, once a trace).

    The kernels' casts are baked into the graph, so a call under other settings must recompile. Dynamo has no
    public way to add a guard: this adds a lambda guard through the tracing context, as torch's functorch-stack
    guard does, and puts the settings into inductor's cache key through a custom pass's ``uuid`` (the
    AOTAutograd cache keys a graph on autocast's enabled flag and dtype only). Called by the kernels and by
    ``token`` before a region inside the trace changes the settings.
    """
    context = torch._guards.TracingContext.try_get()
    if context is None or getattr(context, "_mixprec_guarded", False):
        return
    setattr(context, "_mixprec_guarded", True)  # noqa: B010 - a private mark on torch's object
    key = _entry_key()
    policies = [setting.policy for setting in _state.get().active.values()]  # keep the ids in key valid
    described = ", ".join(f"{d}: {s.policy.name}" for d, s in _state.get().active.items()) or "none"
    from torch._dynamo.source import GlobalStateSource

    def create(builder: Any, guard: Any) -> None:
        builder.guard_manager.root.add_lambda_guard(
            lambda _: _entry_key() == key and policies is not None,
            [f"mixprec settings == ({described})"],
            guard.user_stack,
        )

    context.guards_context.dynamo_guards.add(torch._guards.Guard(GlobalStateSource(), create))
    _key_inductor_cache(key)


class _SettingsPass:
    """A no-op post-grad pass whose ``uuid`` carries mixprec's settings into inductor's cache key."""

    def __init__(self, key: tuple[Any, ...], inner: Any) -> None:
        self.key, self.inner = key, inner

    def __call__(self, graph: Any) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        inner = self.inner.uuid() if self.inner is not None and hasattr(self.inner, "uuid") else None
        return ("mixprec", repr(self.key), inner)


def _key_inductor_cache(key: tuple[Any, ...]) -> None:
    import torch._inductor.config as config

    current = config.post_grad_custom_pre_pass
    inner = current.inner if isinstance(current, _SettingsPass) else current
    config.post_grad_custom_pre_pass = _SettingsPass(key, inner)
