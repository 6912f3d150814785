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
