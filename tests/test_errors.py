"""Bad input gets a clear error (never an assert); unusable regions warn and disable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mixprec
import mixprec.engine._devices


def test_unknown_device_type_lists_known_ones():
    with pytest.raises(ValueError, match=r"device_type='tpu'.*Expected one of: .*cpu.*cuda.*xpu"):
        mixprec.autocast("tpu")


def test_device_type_with_index_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="rather than 'cuda:0'"):
        mixprec.autocast("cuda:0")


def test_device_type_must_be_a_string():
    with pytest.raises(TypeError, match=r"device_type=.*torch.device"):
        mixprec.autocast(torch.device("cpu"))


def test_dtype_must_be_a_torch_dtype():
    with pytest.raises(TypeError, match=r"dtype='bfloat16' \(type builtins.str\)"):
        mixprec.autocast("cpu", dtype="bfloat16")


def test_enabled_must_be_a_bool():
    with pytest.raises(TypeError, match=r"enabled=1 \(type builtins.int\)"):
        mixprec.autocast("cpu", enabled=1)


def test_cache_enabled_must_be_a_bool():
    with pytest.raises(TypeError, match="cache_enabled"):
        mixprec.autocast("cpu", cache_enabled="yes")


def test_policy_must_be_a_policy():
    with pytest.raises(TypeError, match="policy"):
        mixprec.autocast("cpu", policy={"mm": "fp32"})


def test_unsupported_dtype_warns_and_disables():
    with pytest.warns(mixprec.AutocastDisabledWarning, match=r"dtype=torch.float32.*bfloat16, float16"):
        region = mixprec.autocast("cpu", dtype=torch.float32)
    with region:
        assert not mixprec.is_autocast_enabled("cpu")
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype is torch.float32


def test_unavailable_device_warns_and_disables(monkeypatch):
    cuda = mixprec.engine._devices.DEVICES["cuda"]
    monkeypatch.setitem(mixprec.engine._devices.DEVICES, "cuda", dataclasses.replace(cuda, available=lambda: False))
    with pytest.warns(mixprec.AutocastDisabledWarning, match="'cuda' is not available") as record:
        region = mixprec.cuda.amp.autocast()
    assert record[0].filename == __file__  # the warning points at the user's line
    with region:
        assert not mixprec.is_autocast_enabled("cuda")


def test_warning_is_a_mixprec_warning():
    assert issubclass(mixprec.AutocastDisabledWarning, mixprec.MixprecWarning)


def test_query_functions_validate_device_type():
    with pytest.raises(ValueError, match="device_type"):
        mixprec.is_autocast_enabled("gpu")
    with pytest.raises(ValueError, match="device_type"):
        mixprec.get_autocast_dtype("gpu")
