"""Integrations with training frameworks. Each submodule imports its framework; ``import mixprec`` imports none.

- ``mixprec.integrations.lightning``: ``MixprecPrecision``, a Lightning precision plugin.

Hugging Face ``Trainer`` and Accelerate need no integration: ``mixprec.install()`` makes
the ``torch.autocast`` regions they open follow mixprec.
"""
