"""The examples in the docstrings of the policy-shaping API run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

import mixprec

MODULES = ["mixprec._module", "mixprec._explain", "mixprec.policies._policy", "mixprec.policies._names"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "mixprec": mixprec}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
