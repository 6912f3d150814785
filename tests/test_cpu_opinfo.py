"""mixprec.autocast("cpu") against native torch.autocast("cpu") over torch's OpInfo and ModuleInfo databases.

Selection: every OpInfo of ``op_db`` whose CPU dtypes include float32 (677 of
702 in torch 2.13) and every ModuleInfo of ``module_db``; each is tested under
bfloat16 and float16 autocast, one test id per (op, autocast dtype). Per test:

* ops: up to 8 float32 samples and up to 3 samples in each of bfloat16 and
  float16 (the op's own samples if it supports the dtype, else float32 samples
  cast to it: the fp32 ops of autocast accept them natively), through the
  function variant; the first 2 float32 samples also through every other
  variant (Tensor method, operator, each alias and its method);
* modules: up to 4 inputs per dtype, the module built from a fixed seed.

Each run gets fresh copies of the inputs and the same RNG seed, so random ops
(dropout, normal, fractional_max_pool, ...) draw the same numbers. mixprec must
give native's outputs: same structure, dtypes, shapes and bits (NaN equal to
NaN), or raise the exception type native raises (native autocast raises e.g.
for cat of float16 inputs under bfloat16). Two kinds of op are compared less:

* OpInfos flagged ``has_nondeterministic_output`` (``empty``, ``empty_like``,
  ...; ``UNINITIALISED`` on a torch whose OpInfo lacks the flag) return
  uninitialised memory: dtype and shape only;
* ``linalg.lstsq`` (LAPACK gelsy) differs run to run in the last bits even
  with autocast off: values within float32 tolerance.

Under the default policy with native compute mixprec registers no kernel, so
torch's own autocast would run and the comparison would prove nothing. Each
test therefore gives every overload torch has an AutocastCPU kernel for a
mixprec kernel (``_kernels.register``), which then reproduces native (in C++
where ``engine/_fastpath`` takes the call, else in Python), runs mixprec, and
drops the kernels again; native runs first, with none of mixprec's kernels
registered. There are no known divergences. ``test_fastpath.py`` holds the C++
kernels to the Python ones.

mixprec runs with ``compute="native"`` here, so that the comparison with native
autocast holds bit for bit on any machine, whatever ``compute="auto"`` picks on it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import mixprec
from mixprec import engine
from mixprec.engine import _kernels, _tables


def _databases() -> tuple[list[Any], list[Any]]:
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.common_modules import module_db

    if not frozen:
        # Importing torch's test utilities freezes torch.backends flags for the whole process.
        torch.backends.__dict__["__allow_nonbracketed_mutation_flag"] = True
    return op_db, module_db


OP_DB, MODULE_DB = _databases()

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("error::mixprec.MixprecWarning"),
]

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
N_FLOAT32, N_LOW, N_VARIANT, N_MODULE = 8, 3, 2, 4
SEED = 1234

#: Compared with a tolerance: nondeterministic in the last bits without autocast too.
LAST_BITS_NONDETERMINISTIC = {"linalg.lstsq", "linalg.lstsq.grad_oriented"}
#: The OpInfos that return uninitialised memory, for a torch whose OpInfo has no ``has_nondeterministic_output``
#: (2.10 to 2.12; 2.13 added it and flags exactly these among the float32 CPU ops).
UNINITIALISED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
#: CUDA attention kernels whose philox seed and offset outputs (0-dim integer tensors) are ``at::empty`` when
#: dropout_p is 0: uninitialised memory, compared by dtype and shape (seen on an H200: one sample's offset
#: differed between native and mixprec, which run the same kernel, while native's two runs agreed).
RNG_STATE_OUTPUTS = {"torch.ops.aten._efficient_attention_forward", "torch.ops.aten._flash_attention_forward"}


# ---------------------------------------------------------------- running


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Float32/bfloat16/float16 tensors to ``dtype`` (autocast's eligibility), recursing into containers."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype is not torch.float64 else value
    if type(value) in (list, tuple):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _leaves(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _leaves(item)]
    return [out]


Outcome = tuple[str, Any]  # ("ok", leaves) or ("raise", exception type)


def _run(call: Callable[[], Any], context: Any) -> Outcome:
    torch.manual_seed(SEED)
    try:
        with context:
            return "ok", _leaves(call())
    except Exception as error:  # the exception type is compared
        return "raise", type(error)


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, values: str) -> str | None:
    if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if values == "none" or a.device.type == "meta":
        return None
    if a.layout is not torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.is_quantized:
        a, b = a.int_repr(), b.int_repr()
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    if values == "close":
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError:
            return "values differ beyond float32 tolerance"
        return None
    same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
    return None if bool(same.all()) else f"values differ at {int((~same).sum())} of {a.numel()}"


def _difference(native: Outcome, ours: Outcome, values: str = "bits") -> str | None:
    """None if the outcomes agree, else what differs."""
    if native[0] != ours[0] or native[0] == "raise":
        if native == ours:
            return None
        describe = {"ok": lambda o: "returns", "raise": lambda o: f"raises {o[1].__name__}"}
        return f"native {describe[native[0]](native)}, mixprec {describe[ours[0]](ours)}"
    if len(native[1]) != len(ours[1]):
        return f"{len(native[1])} outputs vs {len(ours[1])}"
    for i, (a, b) in enumerate(zip(native[1], ours[1], strict=True)):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            found = _tensor_difference(a, b, values)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            found = f"{type(a).__name__} vs {type(b).__name__}"
        elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            found = None
        else:
            found = None if a == b else f"{a!r} vs {b!r}"
        if found:
            return f"output {i}: {found}"
    return None


# ---------------------------------------------------------------- cases


Case = tuple[str, Callable[[], Any], Callable[[], Any]]  # label, call, the call on cast inputs


def _samples(opinfo: Any, dtype: torch.dtype, count: int, device: str = "cpu") -> list[Any]:
    """The first ``count`` samples of ``opinfo.sample_inputs(device, dtype)``, seeded as it seeds them.

    Without its test-function lookup, which walks the pytest stack with
    ``inspect.stack()`` and would take most of this module's run time.
    """
    torch.manual_seed(SEED)
    found = iter(opinfo.sample_inputs_func(opinfo, device, dtype, False))
    samples = []
    for _ in range(count):
        torch.manual_seed(SEED)
        sample = next(found, None)
        if sample is None:
            break
        samples.append(sample)
    return samples


def _low_samples(opinfo: Any, dtype: torch.dtype, device: str) -> Iterator[tuple[str, Any]]:
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if dtype in opinfo.supported_dtypes(device):
        for i, sample in enumerate(_samples(opinfo, dtype, N_LOW, device)):
            yield f"{short}[{i}]", sample
    else:
        for i, sample in enumerate(_samples(opinfo, torch.float32, N_LOW, device)):
            yield f"{short}-cast[{i}]", sample.transform(lambda t: _cast(t, dtype))


def _variants(opinfo: Any) -> list[tuple[str, Callable[..., Any]]]:
    found = [("Tensor", opinfo.method_variant), ("operator", opinfo.operator_variant)]
    for alias in opinfo.aliases:
        found += [(alias.name, alias.op), (f"Tensor.{alias.name}", alias.method_variant)]
    return [(name, fn) for name, fn in found if fn is not None]


def _sample_call(fn: Callable[..., Any], sample: Any, cast_to: torch.dtype | None) -> Callable[[], Any]:
    def call() -> Any:
        inp, args, kwargs = _copy(sample.input), _copy(sample.args), _copy(sample.kwargs)
        if cast_to is not None:
            inp, args, kwargs = _cast(inp, cast_to), _cast(args, cast_to), _cast(kwargs, cast_to)
        return fn(inp, *args, **kwargs)

    return call


def _op_cases(opinfo: Any, autocast_dtype: torch.dtype, device: str = "cpu") -> Iterator[Case]:
    float32 = list(enumerate(_samples(opinfo, torch.float32, N_FLOAT32, device)))
    samples = [(f"fp32[{i}]", s) for i, s in float32]
    samples += [*_low_samples(opinfo, torch.bfloat16, device), *_low_samples(opinfo, torch.float16, device)]
    for label, sample in samples:
        yield label, _sample_call(opinfo.op, sample, None), _sample_call(opinfo.op, sample, autocast_dtype)
    for name, fn in _variants(opinfo):
        for i, sample in float32[:N_VARIANT]:
            yield f"{name} fp32[{i}]", _sample_call(fn, sample, None), _sample_call(fn, sample, autocast_dtype)


def _module_call(
    info: Any, module_input: Any, dtype: torch.dtype, cast_to: torch.dtype | None, device: str = "cpu"
) -> Callable[[], Any]:
    def call() -> Any:
        torch.manual_seed(0)
        module = info.module_cls(*module_input.constructor_input.args, **module_input.constructor_input.kwargs)
        module = module.to(device=device, dtype=dtype).eval()
        if cast_to is not None:
            module = module.to(cast_to)
        args, kwargs = _copy(module_input.forward_input.args), _copy(module_input.forward_input.kwargs)
        args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
        if cast_to is not None:
            args, kwargs = _cast(args, cast_to), _cast(kwargs, cast_to)
        torch.manual_seed(SEED)
        return module(*args, **kwargs)

    return call


def _module_cases(info: Any, autocast_dtype: torch.dtype, device: str = "cpu") -> Iterator[Case]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        own = dtype in info.dtypes
        inputs = info.module_inputs_func(
            info, device=device, dtype=dtype if own else torch.float32, requires_grad=False, training=False
        )
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        for i, module_input in enumerate([m for m in inputs if m.forward_input is not None][:N_MODULE]):
            label = f"{short}{'' if own else '-cast'}[{i}]"
            yield (
                label,
                _module_call(info, module_input, dtype, None, device),
                _module_call(info, module_input, dtype, autocast_dtype, device),
            )


# ---------------------------------------------------------------- the test


@pytest.fixture(autouse=True)
def _pristine_native():
    """Native runs with none of mixprec's kernels (earlier tests may have registered some)."""
    engine.reset()
    yield
    engine.reset()


@contextlib.contextmanager
def _every_native_op_as_mixprec_kernel(device: str = "cpu") -> Iterator[None]:
    _kernels.register(_tables.autocast_key(device), device, frozenset(_tables.native(device)))  # type: ignore[arg-type]
    try:
        yield
    finally:
        engine.reset()


def _check(
    key: str,
    cases: Iterator[Case],
    autocast_dtype: torch.dtype,
    values: str,
    device: str = "cpu",
    calibrate: bool = False,
) -> None:
    """Every case as native, bits, dtypes and errors.

    With ``calibrate`` (CUDA, where some kernels are nondeterministic) native runs twice: a case whose two
    native runs differ in bits is compared within float32 tolerance, or by dtypes and shapes only if the two
    native runs are not even close.
    """
    cases = list(cases)
    natives = [_run(call, torch.autocast(device, dtype=autocast_dtype)) for _, call, _ in cases]
    again = [_run(call, torch.autocast(device, dtype=autocast_dtype)) for _, call, _ in cases] if calibrate else natives
    with _every_native_op_as_mixprec_kernel(device):
        ours = [_run(call, mixprec.autocast(device, dtype=autocast_dtype, compute="native")) for _, call, _ in cases]
    if key in RNG_STATE_OUTPUTS:
        natives, again, ours = ([_rng_state_as_meta(o) for o in runs] for runs in (natives, again, ours))
    unexplained = []
    for (label, _, _), native, second, mine in zip(cases, natives, again, ours, strict=True):
        level = values
        if level == "bits" and _difference(native, second, "bits") is not None:
            level = "close" if _difference(native, second, "close") is None else "none"
        found = _difference(native, mine, level)
        if found is not None:
            unexplained.append(f"{label}: {found}")
    if unexplained:
        pytest.fail(f"mixprec differs from native autocast on {key}:\n  " + "\n  ".join(unexplained))


def _rng_state_as_meta(outcome: Outcome) -> Outcome:
    """The outcome with its 0-dim integer tensors (an attention kernel's philox seed and offset) on the meta
    device: compared by dtype and shape only (``_tensor_difference``)."""
    if outcome[0] != "ok":
        return outcome
    return "ok", [
        leaf.to("meta")
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 0 and not leaf.is_floating_point()
        else leaf
        for leaf in outcome[1]
    ]


def _key(opinfo: Any) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


OPS = {_key(o): o for o in OP_DB if torch.float32 in o.supported_dtypes("cpu")}
MODULES = {m.formatted_name: m for m in MODULE_DB}


def _uninitialised(opinfo: Any) -> bool:
    """Whether the op returns uninitialised memory: torch's flag where its OpInfo has one, else the list."""
    flag = getattr(opinfo, "has_nondeterministic_output", None)
    return _key(opinfo) in UNINITIALISED if flag is None else bool(flag)


def _op_values(key: str) -> str:
    if _uninitialised(OPS[key]):
        return "none"
    return "close" if key in LAST_BITS_NONDETERMINISTIC else "bits"


@pytest.mark.parametrize("autocast_dtype", LOW.values(), ids=LOW.keys())
@pytest.mark.parametrize("key", sorted(OPS))
def test_op_matches_native(key: str, autocast_dtype: torch.dtype) -> None:
    _check(key, _op_cases(OPS[key], autocast_dtype), autocast_dtype, _op_values(key))


@pytest.mark.parametrize("autocast_dtype", LOW.values(), ids=LOW.keys())
@pytest.mark.parametrize("key", sorted(MODULES))
def test_module_matches_native(key: str, autocast_dtype: torch.dtype) -> None:
    _check(key, _module_cases(MODULES[key], autocast_dtype), autocast_dtype, "bits")


def test_nondeterministic_entries_name_real_ops() -> None:
    assert set(LAST_BITS_NONDETERMINISTIC) <= set(OPS)
    assert set(UNINITIALISED) <= set(OPS)


def test_the_uninitialised_list_is_torchs_flag_where_torch_has_it() -> None:
    flagged = {key for key, opinfo in OPS.items() if getattr(opinfo, "has_nondeterministic_output", None)}
    if any(hasattr(opinfo, "has_nondeterministic_output") for opinfo in OPS.values()):
        assert flagged == UNINITIALISED
    else:  # torch 2.10 to 2.12: the list stands in for the flag
        assert {key for key, opinfo in OPS.items() if _uninitialised(opinfo)} == UNINITIALISED
