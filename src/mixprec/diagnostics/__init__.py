"""Numerics diagnostics: a per-op recorder and the doctor's float32-vs-autocast comparison.

Imported only by the CLI (``mixprec doctor``) or on demand; ``import mixprec`` does not load it.
"""

from mixprec.diagnostics._compare import LOSS, OpReport, Run, compare, run_once
from mixprec.diagnostics._doctor import SCHEMA, Diagnosis, Suggestion, diagnose
from mixprec.diagnostics._recorder import CastCounter, OpRecord, Recorder

__all__ = [
    "LOSS",
    "SCHEMA",
    "CastCounter",
    "Diagnosis",
    "OpRecord",
    "OpReport",
    "Recorder",
    "Run",
    "Suggestion",
    "compare",
    "diagnose",
    "run_once",
]
