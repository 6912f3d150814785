"""The compute= argument: validation, the auto rule (mixprec.engine._compute), forcing a mode."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec._errors import MixprecWarning
from mixprec.engine import _compute, _state


@pytest.mark.parametrize("value", [1, None, torch.float16, ["auto"]])
def test_compute_of_wrong_type_raises_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"autocast argument 'compute' has the wrong type: .*Received: compute="):
        mixprec.autocast("cpu", compute=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["", "Native", "emulate", "fp32"])
def test_unknown_compute_raises_value_error(value: str) -> None:
    with pytest.raises(ValueError, match=r"Expected one of: auto, native, emulated\."):
        mixprec.autocast("cpu", compute=value)


CPU_CASES = {
    "avx512_bf16-bf16": (("avx512f", "avx512_bf16"), torch.bfloat16, True),
    "amx_bf16-bf16": (("avx512f", "amx_bf16", "amx_tile"), torch.bfloat16, True),
    "avx512_core-bf16": (("avx512f", "avx512bw", "avx512vl"), torch.bfloat16, False),
    "avx2-bf16": (("avx2", "f16c"), torch.bfloat16, False),
    "avx512_bf16-fp16": (("avx512f", "avx512_bf16"), torch.float16, False),
    "avx512_fp16-fp16": (("avx512f", "avx512_fp16"), torch.float16, False),  # no fast kernels without AMX-FP16
    "amx_fp16-fp16": (("amx_tile", "amx_fp16"), torch.float16, True),
    "avx2-fp16": (("avx2", "f16c"), torch.float16, False),
}


@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_rule_follows_the_flags(case: str, fake_cpu_flags) -> None:  # type: ignore[no-untyped-def]
    cpu_flags, dtype, native = CPU_CASES[case]
    fake_cpu_flags(*cpu_flags)
    support = mixprec.kernel_support("cpu", dtype)
    assert support.native is native
    assert support.device_type == "cpu" and support.dtype is dtype
    assert ("native" if native else "emulated") in str(support)


@pytest.mark.parametrize(
    ("isa", "native"),
    [("AVX2", False), ("AVX512_CORE", False), ("AVX512_CORE_BF16", True), ("ALL", True), ("bogus", True)],
)
def test_onednn_isa_cap_turns_native_off(isa: str, native: bool, fake_cpu_flags, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake_cpu_flags("avx512f", "avx512_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    _compute._max_isa.cache_clear()  # read once per process, as oneDNN does
    support = mixprec.kernel_support("cpu", torch.bfloat16)
    assert support.native is native
    if not native:
        assert "ONEDNN_MAX_CPU_ISA" in support.evidence


def test_aarch64_flags(fake_cpu_flags, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake_cpu_flags("fp", "asimd", "bf16")
    monkeypatch.setattr(_compute.platform, "machine", lambda: "aarch64")
    assert mixprec.kernel_support("cpu", torch.bfloat16).native
    assert not mixprec.kernel_support("cpu", torch.float16).native


def test_cuda_float16_is_native_and_unknown_devices_are_taken_as_native() -> None:
    assert mixprec.kernel_support("cuda", torch.float16).native
    assert mixprec.kernel_support("xla", torch.bfloat16).native


def _emulating() -> bool:
    assert torch.is_autocast_enabled("cpu")
    setting = _state.get().active.get("cpu")  # none: the default policy, native, as torch.autocast
    return setting is not None and setting.emulate


@pytest.mark.parametrize(
    ("cpu_flags", "expected"), [(("avx512_bf16",), False), (("avx2",), True)], ids=["bf16", "avx2"]
)
def test_auto_emulates_where_kernels_are_not_native(cpu_flags: tuple[str, ...], expected: bool, fake_cpu_flags) -> None:  # type: ignore[no-untyped-def]
    fake_cpu_flags(*cpu_flags)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        assert _emulating() is expected
    with mixprec.autocast("cpu", dtype=torch.bfloat16, compute="auto"):
        assert _emulating() is expected


@pytest.mark.parametrize("cpu_flags", [("avx512_bf16", "avx512_fp16"), ("avx2",)], ids=["native_cpu", "avx2_cpu"])
@pytest.mark.parametrize("compute", ["native", "emulated"])
def test_native_and_emulated_can_be_forced(compute: str, cpu_flags: tuple[str, ...], fake_cpu_flags) -> None:  # type: ignore[no-untyped-def]
    fake_cpu_flags(*cpu_flags)
    for dtype in (torch.bfloat16, torch.float16):
        with mixprec.autocast("cpu", dtype=dtype, compute=compute):
            assert _emulating() is (compute == "emulated")


def test_nested_regions_restore_the_outer_compute() -> None:
    with mixprec.autocast("cpu", compute="emulated"):
        with mixprec.autocast("cpu", compute="native"):
            assert not _emulating()
        assert _emulating()
        with mixprec.autocast("cpu", enabled=False, compute="emulated"):
            assert not torch.is_autocast_enabled("cpu")
        assert _emulating()


def test_a_disabled_region_does_not_look_at_the_device() -> None:
    with pytest.warns(MixprecWarning):
        region = mixprec.autocast("cpu", dtype=torch.int8, compute="auto")  # unsupported dtype: disabled
    with region:
        assert not torch.is_autocast_enabled("cpu") and "cpu" not in _state.get().active


@pytest.mark.parametrize(("cpu_flags", "shown"), [(("avx512_bf16",), "native"), (("avx2",), "emulated")])
def test_repr_shows_compute_and_what_auto_chose(cpu_flags: tuple[str, ...], shown: str, fake_cpu_flags) -> None:  # type: ignore[no-untyped-def]
    fake_cpu_flags(*cpu_flags)
    assert repr(mixprec.autocast("cpu")).endswith(f"compute='auto' -> {shown})")
    assert repr(mixprec.autocast("cpu", compute="emulated")).endswith("compute='emulated')")
