"""The examples in mixprec's docstrings run as written: every module whose source holds one (they are
also the API reference's examples, docs/api.md)."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest
import torch

import mixprec

SRC = pathlib.Path(mixprec.__file__).parent
MODULES = sorted(
    ".".join(("mixprec", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
    for path in SRC.rglob("*.py")
    if ">>>" in path.read_text()
)


def test_modules_are_found():
    assert {"mixprec._module", "mixprec.scaler._grad_scaler", "mixprec.policies._policy"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "mixprec": mixprec}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
