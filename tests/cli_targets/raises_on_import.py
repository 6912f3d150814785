"""A `mixprec doctor` target whose import fails (its module-level code raises), for the CLI's error tests."""

raise RuntimeError("module level setup failed")


def build():  # pragma: no cover - never reached
    raise AssertionError
