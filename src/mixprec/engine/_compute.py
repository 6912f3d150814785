"""Native or emulated low-precision compute: the ``compute=`` argument of autocast.

``compute="native"`` runs ``lower_precision_fp`` ops on the device's float16 /
bfloat16 kernels, as torch autocast does. ``compute="emulated"`` rounds their
inputs to the autocast dtype, runs float32 kernels and rounds the outputs (see
``mixprec.engine._emulate``). ``compute="auto"`` (the default) picks native where the
device has native low-precision matrix kernels and emulated elsewhere.

The rule for CPUs, from measurements with torch 2.13 (docs/benchmarks.md,
"When low precision is native on a CPU")::

    bfloat16 native  iff  oneDNN may use AVX512-BF16 or AMX-BF16 (x86), or BF16 (aarch64)
    float16  native  iff  oneDNN may use AMX-FP16 (x86), or FP16 arithmetic (aarch64)

"may use": the CPU flag is present (``/proc/cpuinfo``, or torch's own CPU
probes) and ``ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below that ISA. Measured
on an AMD EPYC with AVX512-BF16 and no AMX or AVX512-FP16: bfloat16 mm,
linear and convolutions run at 0.3-0.6x the float32 time; with oneDNN capped
at AVX512_CORE (no BF16 instructions) they cost 2.6-3x float32, and capped at
AVX2 (torch then leaves oneDNN for a scalar fallback) 9-108x; float16 costs
8-100x float32 there in every setting. Measured on an Intel Xeon with AVX512-FP16
and AMX-BF16 but no AMX-FP16: float16 mm, linear and SDPA run at 0.9-1.1x float32
and convolutions at 1.4x (no gain), and a float16 convolution's backward is a slow
fallback (42x float32; the demo's float16 step costs 64x), so AVX512-FP16 alone
does not make float16 native. ATen's vectorization level
(``torch.backends.cpu.get_cpu_capability()``) does not decide it: bfloat16 mm
stayed at 0.3x float32 with ``ATEN_CPU_CAPABILITY=default``. It is reported in
``KernelSupport.evidence`` only.

CUDA: float16 is native; bfloat16 is native from compute capability 8.0
(``torch.cuda.is_bf16_supported(including_emulation=False)``). Other devices
are taken to be native.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from collections.abc import Callable

import torch

from mixprec import _errors
from mixprec._compat import constant
from mixprec.engine import _devices

COMPUTE_MODES = ("auto", "native", "emulated")

# oneDNN's ISA names in increasing order (ONEDNN_MAX_CPU_ISA values), and the
# lowest that has each dtype's dot-product instructions.
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "ALL",
)
_ONEDNN_NEEDS = {torch.bfloat16: "AVX512_CORE_BF16", torch.float16: "AVX10_1_512_AMX_FP16"}

# CPU flags (as /proc/cpuinfo spells them) that give native matrix kernels.
_CPU_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("amx_fp16", "asimdhp"),
}
# torch's own probes of the same instructions, where this torch has them.
_TORCH_PROBES = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


@dataclasses.dataclass(frozen=True)
class KernelSupport:
    """Whether a device has native matrix kernels for a low-precision dtype.

    Examples:
        >>> support = mixprec.kernel_support("cpu", torch.bfloat16)
        >>> isinstance(support.native, bool)
        True
    """

    device_type: str
    dtype: torch.dtype
    native: bool
    evidence: str

    def __str__(self) -> str:
        verdict = "native" if self.native else "emulated"
        return f"{self.device_type} {str(self.dtype).removeprefix('torch.')}: {verdict} ({self.evidence})"


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _torch_probes(dtype: torch.dtype) -> tuple[str, ...]:
    found = []
    for name in _TORCH_PROBES.get(dtype, ()):
        probe = getattr(torch.cpu, name, None)
        if probe is not None and probe():
            found.append(f"torch.cpu.{name}()")
    return tuple(found)


def _onednn_cap(dtype: torch.dtype, max_isa: str) -> str | None:
    """Why ``ONEDNN_MAX_CPU_ISA`` keeps oneDNN off the dtype's instructions, or None."""
    isa = max_isa.strip().upper()
    if not isa or isa not in _ONEDNN_ISAS or dtype not in _ONEDNN_NEEDS:
        return None
    if _ONEDNN_ISAS.index(isa) < _ONEDNN_ISAS.index(_ONEDNN_NEEDS[dtype]):
        return f"ONEDNN_MAX_CPU_ISA={max_isa} caps oneDNN below {_ONEDNN_NEEDS[dtype]}"
    return None


@functools.cache
def _cpu_support(dtype: torch.dtype, max_isa: str) -> KernelSupport:
    flags = sorted(_cpu_flags().intersection(_CPU_FLAGS.get(dtype, ())))
    arm = platform.machine().lower() in ("aarch64", "arm64")
    flags = [f for f in flags if f.startswith(("avx", "amx")) != arm]
    probes = _torch_probes(dtype) if not arm else ()
    capability = torch.backends.cpu.get_cpu_capability()
    if not flags and not probes:
        wanted = ", ".join(_CPU_FLAGS.get(dtype, ()))
        return KernelSupport("cpu", dtype, False, f"no CPU flag among {wanted}; capability {capability}")
    capped = _onednn_cap(dtype, max_isa)
    evidence = ", ".join([*flags, *probes]) + f"; capability {capability}"
    if capped is not None:
        return KernelSupport("cpu", dtype, False, f"{evidence}; but {capped}")
    return KernelSupport("cpu", dtype, True, evidence)


@functools.cache
def _max_isa() -> str:
    """oneDNN's ISA cap, read once: oneDNN itself reads the variable once, when it starts."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA", "")


def clear_probes() -> None:
    """Probe the CPU again on next use (``mixprec.engine.reset``)."""
    _cpu_support.cache_clear()
    _max_isa.cache_clear()


def _cpu(dtype: torch.dtype) -> KernelSupport:
    return _cpu_support(dtype, _max_isa())


def _cuda(dtype: torch.dtype) -> KernelSupport:
    if dtype is not torch.bfloat16:
        return KernelSupport("cuda", dtype, True, "float16 tensor cores or FMA units")
    native = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False))
    return KernelSupport("cuda", dtype, native, f"torch.cuda.is_bf16_supported(including_emulation=False)={native}")


_DETECTORS: dict[str, Callable[[torch.dtype], KernelSupport]] = {"cpu": _cpu, "cuda": _cuda}


def kernel_support(device_type: str, dtype: torch.dtype) -> KernelSupport:
    """Whether ``device_type`` has native matrix kernels for ``dtype`` (what ``compute="auto"`` uses).

    Args:
        device_type: A device type, e.g. ``"cpu"``.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        A ``KernelSupport`` whose ``native`` answers the question and whose
        ``evidence`` names the CPU flags or probes the answer rests on.

    Examples:
        >>> print(mixprec.kernel_support("cpu", torch.float16))  # doctest: +SKIP
        cpu float16: emulated (no CPU flag among amx_fp16, asimdhp; capability AVX512)
    """
    _devices.check_dtype("kernel_support", device_type, dtype)
    return _support(device_type, dtype)


def _support(device_type: str, dtype: torch.dtype) -> KernelSupport:
    """``kernel_support`` without the argument checks (its callers pass checked values)."""
    detect = _DETECTORS.get(device_type)
    if detect is None:
        return KernelSupport(device_type, dtype, True, "no detector for this device type; assumed native")
    return detect(dtype)


def check_compute(compute: object) -> str:
    """Validate the ``compute`` argument of autocast."""
    if not isinstance(compute, str):
        raise TypeError(
            _errors.message(
                "autocast argument 'compute' has the wrong type",
                "it must be a str",
                received={"compute": compute},
                expected=COMPUTE_MODES,
            )
        )
    if compute not in COMPUTE_MODES:
        raise ValueError(
            _errors.message(
                "autocast argument 'compute' is invalid",
                "it chooses how lower_precision_fp ops compute",
                received={"compute": compute},
                expected=COMPUTE_MODES,
                fix='Use "auto" (the default) unless you need to force one for comparison.',
            )
        )
    return compute


#: Overloads a device has no low-precision kernel for even where its matrix kernels are native: oneDNN's
#: RNN primitive has no float16 (native autocast raises on an Intel Xeon with AVX512-FP16 and AMX-BF16; kept
#: for CPUs with AMX-FP16, where float16 is otherwise native).
_NO_NATIVE_KERNEL = {("cpu", torch.float16): frozenset({"aten::mkldnn_rnn_layer"})}


@constant
def emulated_ops(compute: str, device_type: str, dtype: torch.dtype) -> frozenset[str]:
    """The overloads ``compute="auto"`` emulates although it runs the others natively."""
    if compute != "auto" or emulates(compute, device_type, dtype):
        return frozenset()
    return _NO_NATIVE_KERNEL.get((device_type, dtype), frozenset())


@constant
def emulates(compute: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether a region with these settings emulates its lower_precision_fp ops.

    Computed eagerly under torch.compile (a constant in the trace): it reads
    /proc/cpuinfo and the environment once per process.
    """
    if compute == "auto":
        return not _support(device_type, dtype).native
    return compute == "emulated"
