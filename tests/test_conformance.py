"""Conformance with torch's own autocast test lists (``torch.testing._internal.autocast_test_lists``).

Every entry of the lists is its own test, called each way torch's
``_run_autocast_outofplace`` calls it (``torch.X`` or ``torch._C._nn.X`` /
``torch._C._linalg.X``, and ``Tensor.X``), plus ``torch.ops.aten.X`` where the
entry's arguments fit an ATen schema: native autocast sits in the dispatcher,
so it casts those calls too.

* CPU lists (``AutocastCPUTestLists``), under bfloat16 and float16: the output
  of ``mixprec.autocast("cpu")`` must equal that of native ``torch.autocast("cpu")``,
  dtype and bits.
* CUDA lists (``AutocastTestLists``, built on CPU tensors), under the CUDA policy
  applied to CPU tensors: the output must have the dtype the list names, and
  equal bit for bit a hand-cast control (floating arguments cast to the run
  type, autocast off), as ``_run_autocast_outofplace`` checks. An op with no CPU
  kernel (the cuDNN convolutions) is checked in the dispatcher instead: it must
  be reached with inputs in the list's dtype.
* Promote entries also check, in the dispatcher, that the kernel received its
  inputs already promoted: the output dtype alone cannot tell autocast's
  promotion from the kernel's own type promotion.

mixprec runs with ``compute="native"`` here, so that the comparison with native
autocast holds bit for bit on any machine, whatever ``compute="auto"`` picks on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec

pytestmark = [  # torch's lists call chain_matmul and cross the deprecated way
    pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim:UserWarning"),
]

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _torch_lists() -> tuple[Any, Any]:
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal import autocast_test_lists

    if not frozen:
        # Importing torch's test utilities freezes torch.backends flags for the whole process.
        torch.backends.__dict__["__allow_nonbracketed_mutation_flag"] = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return autocast_test_lists.AutocastCPUTestLists("cpu"), autocast_test_lists.AutocastTestLists("cpu")


CPU_LISTS, CUDA_LISTS = _torch_lists()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """The hand cast of ``_run_autocast_outofplace``: floating tensors to ``dtype``, recursing into sequences."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


@dataclasses.dataclass(eq=False)
class Call:
    """One listed op, called one way: ``module.X``, ``Tensor.X`` or ``torch.ops.aten.X``."""

    op: str
    way: str  # "module", "Tensor" or "aten"
    module: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self, cast_to: torch.dtype | None = None) -> Any:
        args = self.args if cast_to is None else _cast(self.args, cast_to)
        if self.way == "Tensor":
            return getattr(args[0], self.op)(*args[1:], **self.kwargs)
        if self.way == "aten":
            return getattr(torch.ops.aten, self.op)(*args, **self.kwargs)
        return getattr(self.module, self.op)(*args, **self.kwargs)

    @property
    def label(self) -> str:
        return {"module": "", "Tensor": "Tensor.", "aten": "aten."}[self.way] + self.op


def _aten_accepts(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if op.startswith("__") or not hasattr(torch.ops.aten, op):
        return False
    try:
        torch._C._jit_resolve_packet(f"aten::{op}", *args, **kwargs)
    except RuntimeError:
        return False
    return True


def _calls(op: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Call]:
    """The ways ``_run_autocast_outofplace`` calls ``op``, then ``torch.ops.aten``."""
    if module is not None and hasattr(module, op):
        yield Call(op, "module", module, args, kwargs)
    if hasattr(torch.Tensor, op):
        yield Call(op, "Tensor", None, args, kwargs)
    if _aten_accepts(op, args, kwargs):
        yield Call(op, "aten", None, args, kwargs)


def _numbered(entries: list[tuple[Any, ...]]) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Each entry with a unique name: ``norm``, ``norm.2``, ... for an op listed more than once."""
    seen: dict[str, int] = {}
    for entry in entries:
        seen[entry[0]] = seen.get(entry[0], 0) + 1
        yield (entry[0] if seen[entry[0]] == 1 else f"{entry[0]}.{seen[entry[0]]}"), entry


def _module(list_name: str) -> Any:
    return {"torch": torch, "nn": torch._C._nn, "linalg": torch._C._linalg, "methods": None}[list_name.split("_")[0]]


def _out_dtypes(value: Any) -> set[torch.dtype]:
    return {t.dtype for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}


def _assert_identical(got: Any, expected: Any, where: str = "output") -> None:
    """Same type, same dtypes, same bits (recursing into tuples), as torch's ``compare``."""
    assert type(got) is type(expected), f"{where}: {type(got).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype}, expected {expected.dtype}"
        assert torch.equal(got, expected), f"{where}: values differ from the reference"
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), f"{where}: {len(got)} items, expected {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_identical(g, e, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r}, expected {expected!r}"


class _OpReachedError(Exception):
    """Raised by _KernelLog at the op it was told to stop at."""


class _KernelLog(TorchDispatchMode):
    """Logs the floating input dtypes of every ATen op that reaches a kernel; stops at ``stop_at``."""

    def __init__(self, stop_at: str | None = None) -> None:
        super().__init__()
        self.stop_at = stop_at
        self.seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        leaves = pytree.tree_leaves((args, kwargs))
        floats = tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())
        self.seen.append((name, floats))
        if name == self.stop_at:
            raise _OpReachedError
        return func(*args, **kwargs)


def _dtypes_reaching(call: Call, region: Any) -> tuple[torch.dtype, ...]:
    """The floating input dtypes with which ``call`` reaches its ATen op, which is not run."""
    log = _KernelLog(stop_at=call.op)
    with region, log, pytest.raises(_OpReachedError):
        call()
    return log.seen[-1][1]


def _assert_kernels_got_promoted_inputs(log: _KernelLog, promoted: torch.dtype) -> None:
    """Every op but the casts themselves received its floating inputs in ``promoted``."""
    kernels = [(name, dtypes) for name, dtypes in log.seen if name != "_to_copy"]
    assert kernels, "no kernel ran"
    mixed = [(name, dtypes) for name, dtypes in kernels if set(dtypes) - {promoted}]
    assert not mixed, f"kernels got unpromoted inputs: {mixed}"


def _has_cpu_kernel(call: Call) -> bool:
    """Whether the ATen overload ``call`` resolves to can run on CPU (a Python-only op always can)."""
    if not _aten_accepts(call.op, call.args, call.kwargs):
        return True
    overload = torch._C._jit_resolve_packet(f"aten::{call.op}", *call.args, **call.kwargs)
    name = getattr(getattr(torch.ops.aten, call.op), overload).name()
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, "CPU")


# --- CPU lists: mixprec against native CPU autocast -------------------------------------------


@dataclasses.dataclass(eq=False)
class CpuCase:
    list_name: str
    name: str
    call: Call
    dtype: torch.dtype
    expected: torch.dtype  # what the list says native gives

    @property
    def id(self) -> str:
        suffix = self.name[len(self.call.op) :]
        return f"{self.list_name}-{self.call.label}{suffix}-{_SHORT[self.dtype]}"


def _cpu_cases() -> Iterator[CpuCase]:
    lower = (torch.bfloat16, torch.float16)
    for list_name in ("torch_expect_builtin_promote", "methods_expect_builtin_promote", "torch_need_autocast_promote"):
        for name, entry in _numbered(getattr(CPU_LISTS, list_name)):
            op, bf16_args, fp16_args = entry[:3]
            out = entry[3] if len(entry) > 3 else torch.float32
            for dtype, args in zip(lower, (bf16_args, fp16_args), strict=True):
                for call in _calls(op, _module(list_name), args, {}):
                    yield CpuCase(list_name, name, call, dtype, out)
    for list_name in ("torch_16", "nn_16", "torch_fp32", "nn_fp32"):
        for name, entry in _numbered(getattr(CPU_LISTS, list_name)):
            op, args = entry[:2]
            kwargs = entry[2] if len(entry) > 2 else {}
            for dtype in lower:
                out = dtype if list_name.endswith("_16") else torch.float32
                for call in _calls(op, _module(list_name), args, kwargs):
                    yield CpuCase(list_name, name, call, dtype, out)


CPU_CASES = list(_cpu_cases())


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_cpu_list_matches_native_autocast(case: CpuCase) -> None:
    with torch.autocast("cpu", dtype=case.dtype):
        native = case.call()
    assert _out_dtypes(native) == {case.expected}, "native autocast no longer gives what torch's list says"
    promotes = case.list_name == "torch_need_autocast_promote"
    log = _KernelLog()
    with mixprec.autocast("cpu", dtype=case.dtype, compute="native"), log if promotes else contextlib.nullcontext():
        got = case.call()
    _assert_identical(got, native)
    if promotes:
        _assert_kernels_got_promoted_inputs(log, torch.float32)


# --- CUDA lists: the CUDA policy on CPU tensors against a hand-cast control --------------------

_CUDA_RUN_AS = {
    "torch_fp16": torch.float16,
    "nn_fp16": torch.float16,
    "linalg_fp16": torch.float16,
    "methods_fp16": torch.float16,
    "torch_fp32": torch.float32,
    "nn_fp32": torch.float32,
    "methods_fp32": torch.float32,
    "torch_need_autocast_promote": torch.float32,
}


@dataclasses.dataclass(eq=False)
class CudaCase:
    list_name: str
    name: str
    call: Call
    run_as: torch.dtype  # the control's dtype
    expected: torch.dtype  # the output's dtype

    @property
    def id(self) -> str:
        return f"{self.list_name}-{self.call.label}{self.name[len(self.call.op) :]}"


def _cuda_entry(entry: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An entry's (args, kwargs), repairing torch's malformed einsum entry.

    torch lists ``("einsum", "bkhd,bqhd->bqkh", (mat0, mat1))``: test_cuda reads
    the tensors as the ROCm skip flag, so the entry never runs there, and the
    equation names 4-d operands. The matrices are reshaped to the 4-d operands
    the equation names; a trailing bool (the ROCm flag) is dropped.
    """
    if isinstance(entry[1], str):
        return (entry[1], *(m.reshape(2, 2, 4, 4) for m in entry[2])), {}
    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    return entry[1], kwargs


def _cuda_cases() -> Iterator[CudaCase]:
    for list_name in ("torch_expect_builtin_promote", "methods_expect_builtin_promote"):
        for name, (op, args, out) in _numbered(getattr(CUDA_LISTS, list_name)):
            for call in _calls(op, _module(list_name), args, {}):
                yield CudaCase(list_name, name, call, torch.float32, out)
    for list_name, run_as in _CUDA_RUN_AS.items():
        for name, entry in _numbered(getattr(CUDA_LISTS, list_name)):
            args, kwargs = _cuda_entry(entry)
            for call in _calls(entry[0], _module(list_name), args, kwargs):
                yield CudaCase(list_name, name, call, run_as, run_as)


CUDA_CASES = list(_cuda_cases())


def _cuda_policy_region() -> mixprec.autocast:
    return mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.policies.CUDA, compute="native")


@pytest.mark.parametrize("case", CUDA_CASES, ids=[c.id for c in CUDA_CASES])
def test_cuda_list_matches_hand_cast(case: CudaCase) -> None:
    if not _has_cpu_kernel(case.call):
        # No CPU kernel at all (cudnn_convolution): check what reaches the dispatcher.
        assert set(_dtypes_reaching(case.call, _cuda_policy_region())) == {case.expected}
        assert set(_dtypes_reaching(case.call, mixprec.autocast("cpu", enabled=False))) == {torch.float32}
        return
    promotes = case.list_name == "torch_need_autocast_promote"
    log = _KernelLog()
    with _cuda_policy_region(), log if promotes else contextlib.nullcontext():
        got = case.call()
    control = case.call(cast_to=case.run_as)
    if isinstance(got, torch.Tensor):
        assert got.dtype == case.expected, f"{case.call.label} produced {got.dtype}, should produce {case.expected}"
    assert _out_dtypes(got) <= {case.expected}
    _assert_identical(got, control)
    if promotes:
        _assert_kernels_got_promoted_inputs(log, torch.float32)


def test_every_cuda_list_entry_has_a_case() -> None:
    lists = ("torch_expect_builtin_promote", "methods_expect_builtin_promote", *_CUDA_RUN_AS)
    listed = {(name, n) for name in lists for n, _ in _numbered(getattr(CUDA_LISTS, name))}
    assert {(c.list_name, c.name) for c in CUDA_CASES} == listed


def test_every_cpu_list_entry_has_a_case_under_both_dtypes() -> None:
    lists = ("torch_expect_builtin_promote", "methods_expect_builtin_promote", "torch_need_autocast_promote",
             "torch_16", "nn_16", "torch_fp32", "nn_fp32")
    listed = {(name, n, d) for name in lists for n, _ in _numbered(getattr(CPU_LISTS, name))
              for d in (torch.bfloat16, torch.float16)}
    assert {(c.list_name, c.name, c.dtype) for c in CPU_CASES} == listed


# --- banned ops ---------------------------------------------------------------------------------

_BANNED_CALLS = [
    pytest.param(namespace, op, args, id=f"{label}{op}")
    for op, args, listed in CUDA_LISTS.banned
    for label, namespace in (("_nn.", listed), ("F.", F), ("aten.", torch.ops.aten))
]


@pytest.mark.parametrize(("module", "op", "args"), _BANNED_CALLS)
def test_cuda_policy_bans_with_advice(module: Any, op: str, args: tuple[Any, ...]) -> None:
    with _cuda_policy_region(), pytest.raises(RuntimeError) as raised:
        getattr(module, op)(*args)
    assert "binary_cross_entropy_with_logits" in str(raised.value)
    assert "BCEWithLogitsLoss" in str(raised.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("module", "op", "args"), _BANNED_CALLS)
def test_cpu_policy_runs_cuda_banned_op_in_fp32_like_native(
    module: Any, op: str, args: tuple[Any, ...], dtype: torch.dtype
) -> None:
    lower_args = _cast(args, dtype)
    with torch.autocast("cpu", dtype=dtype):
        native = getattr(module, op)(*lower_args)
    with mixprec.autocast("cpu", dtype=dtype, compute="native"):
        got = getattr(module, op)(*lower_args)
    assert native.dtype == torch.float32
    _assert_identical(got, native)


# --- calling conventions the lists do not exercise ---------------------------------------------

_X16 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).to(torch.float16)
_aten = torch.ops.aten
_CONVENTIONS = {
    # dtype given as None positionally: ATen's set_opt_dtype replaces it like an omitted one
    "softmax-dtype=None-positional": (lambda x: torch.softmax(x, 0, None), lambda x: torch.softmax(x, 0)),
    "Tensor.log_softmax-dtype=None-positional": (lambda x: x.log_softmax(0, None), lambda x: x.log_softmax(0)),
    "aten.softmax.int": (lambda x: _aten.softmax.int(x, 0, None), lambda x: torch.softmax(x, 0)),
    "aten.sum.dim_IntList": (lambda x: _aten.sum.dim_IntList(x, [0]), lambda x: torch.sum(x, 0)),
    # overloads without dtype: ATen's fp32_append_dtype redispatches to the sibling that takes one
    "aten.norm.Scalar": (lambda x: _aten.norm.Scalar(x, 3), lambda x: torch.norm(x, 3)),
    "aten.norm.ScalarOpt_dim": (lambda x: _aten.norm.ScalarOpt_dim(x, 2, [1]), lambda x: torch.norm(x, 2, [1])),
}


@pytest.mark.parametrize(("call", "reference"), list(_CONVENTIONS.values()), ids=list(_CONVENTIONS))
def test_cuda_policy_fp32_dtype_ops_accept_every_calling_convention(call: Any, reference: Any) -> None:
    with _cuda_policy_region():
        got = call(_X16)
    _assert_identical(got, reference(_X16.float()))
