"""``tests/cuda``: the suite's GPU half, run whenever CUDA is available.

Without CUDA every test in this directory is skipped with one reason, and nothing else in the suite changes.
``MIXPREC_CUDA_TESTS_DEVICE=cpu`` runs the same tests on the CPU instead, to check the tests' own logic on a
machine without a GPU (CI does not set it; the CPU behaviour they check is covered by the rest of the suite).

On CUDA the tests ask for reproducible kernels (``torch.use_deterministic_algorithms``, warn only, and
``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS starts), since they compare mixprec with native bit for bit.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

#: The device these tests run on: "cuda", or "cpu" to check them without a GPU.
DEVICE = os.environ.get("MIXPREC_CUDA_TESTS_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise pytest.UsageError(f"MIXPREC_CUDA_TESTS_DEVICE must be 'cuda' or 'cpu', got {DEVICE!r}")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (read when cuBLAS starts: before any CUDA work)

_HERE = pathlib.Path(__file__).parent
SKIP_REASON = "tests/cuda: this machine has no CUDA device (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=SKIP_REASON)
        for item in items:
            if _HERE in pathlib.Path(str(item.fspath)).parents:
                item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def deterministic():
    """Reproducible kernels for a bit-for-bit comparison (restored afterwards)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)
