"""mixprec's engine: what runs when a region is open. Internal; the rest of mixprec imports it, never the
other way round (``pyproject.toml``'s import contracts, checked in CI).

Its parts, in the order a call meets them (``docs/design.md`` draws the flow):

* ``_state``: the thread's region state beside torch's (the innermost ``Setting`` per device: policy and
  compute), and the ``Setting`` itself.
* ``_installation``: the setting ``mixprec.install`` puts in force for plain ``torch.autocast`` regions.
* ``_recompute``: the setting a checkpoint's recompute must use (the one its forward used).
* ``_devices``: what differs per device type (dtypes, availability, torch's Autocast key).
* ``_tables``: policies resolved to ATen overloads, torch's own Autocast registrations, overload lookup.
* ``_rules``: what each category does to an op's arguments (casts, appended dtypes, errors).
* ``_cast``: eligibility (which tensors a cast touches) and the cast cache.
* ``_kernels``: the kernels at the Autocast dispatch keys and their registration through ``torch.library``.
* ``_compute``, ``_emulate``, ``_emulate_kernels``: ``compute="auto" | "native" | "emulated"``.
* ``_compile``, ``_guard``: regions inside code that ``torch.compile`` traces, and the guards on the state.
"""


def reset() -> None:
    """Put the engine's process-wide state back as a fresh process has it: the one reset tests use.

    * No mixprec kernel at any Autocast key: torch's own kernels serve every region again (registering one
      later resets dynamo, as the first registration in a process does).
    * Every memo empty (settings, resolved tables, kernel entries, made regions, policy fingerprints, fp8 weight
      quantisations, delayed fp8 amax histories), and the CPU's low-precision support probed again on next use
      (``ONEDNN_MAX_CPU_ISA`` read again).

    What a test opens stays its own to close: regions, module policies and an ``install`` are left alone (the
    suite's ``_no_autocast_leak`` fixture checks that each test closed them). An installation still in force gets
    its kernels again, so ``torch.autocast`` regions keep following it; a region open through the reset runs on
    torch's kernels for the rest of its body. Compile tokens stay too, as a compiled graph may still hold one.
    """
    from mixprec.engine import _amax, _compute, _fp8, _installation, _kernels, _memo

    _kernels.reset()
    _memo.clear_all()
    _compute.clear_probes()
    _fp8.clear_weight_cache()
    _amax.clear()
    if _installation.current is not None:
        _kernels.ensure_installed(_installation.current)
