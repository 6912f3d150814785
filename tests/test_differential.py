"""Random programs through mixprec, through the reference interpreter, and through native torch.autocast.

Each program is 2-10 ATen calls drawn from every op the CPU, CUDA and XPU
tables list plus unlisted ones, with sample inputs from torch's OpInfo
database (or a hand-written sample where OpInfo has none), in random input
dtypes, some of them chained on earlier outputs and on shared weights; nested
at random in ``mixprec.autocast``, ``torch.autocast`` (on or off, either dtype)
and ``set_module_policy`` regions; under a random base policy with random edits,
native or emulated compute, sometimes under ``mixprec.install``. Forward
outputs, their dtypes and the gradients of every leaf must equal the reference
interpreter's (``tests/reference.py``) bit for bit, and native torch.autocast's
where the policy is the CPU default.

CI runs a bounded share (``max_examples`` below). By hand, for thousands::

    MIXPREC_FUZZ=long python -m pytest tests/test_differential.py
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import _share
import mixprec
import reference
from _opsamples import HAND, POLICIES, UNLISTED, UNREACHABLE, drawable, samples, table_names
from mixprec import engine
from reference import Call, Program, Ref, Region

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
PROFILES = {
    # CI: a fixed set of examples (derandomized), about 25 s; a third of them on older releases (_share.py).
    "ci": settings(max_examples=_share.examples(300), deadline=None, derandomize=True, database=None, print_blob=True,
                   suppress_health_check=_QUIET),
    # By hand: MIXPREC_FUZZ=long, thousands of new examples each run.
    "long": settings(max_examples=3000, deadline=None, print_blob=True, suppress_health_check=_QUIET),
}
PROFILE = PROFILES["long" if os.environ.get("MIXPREC_FUZZ") == "long" else "ci"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)




# Chained calls on an earlier output x (any shape): (op, args, kwargs); "X" is x reshaped as noted,
# W/B/S/V the program's shared float32 weights of shapes (1, 1), (1,), () and (3,).
CHAINS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("aten::mm", (("X", (-1, 1)), "W")),
    ("aten::matmul", (("X", (-1, 1)), "W")),
    ("aten::linear", (("X", (-1, 1)), "W", "B")),
    ("aten::addmm", ("B", ("X", (-1, 1)), "W")),
    ("aten::mul", (("X", None), "S")),
    ("aten::add", (("X", None), "S")),
    ("aten::softmax", (("X", (-1,)), 0)),
    ("aten::log_softmax", (("X", (-1,)), 0)),
    ("aten::sum", (("X", None),)),
    ("aten::cumsum", (("X", (-1,)), 0)),
    ("aten::exp", (("X", None),)),
    ("aten::gelu", (("X", None),)),
    ("aten::norm", (("X", None),)),
    ("aten::layer_norm", (("X", (-1, 1)), [1])),
    ("aten::cat", ([("X", (-1,)), "V"],)),
    ("aten::stack", ([("X", (-1,)), ("X", (-1,))],)),
    ("aten::prod", (("X", (-1,)),)),
)
SHARED = {"W": (1, 1), "B": (1,), "S": (), "V": (3,)}


def _floating_output(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    with torch.no_grad():
        return reference.first_float(getattr(torch.ops.aten, name)(*args, **kwargs)) is not None


@st.composite
def policies(draw: Any, used: list[str]) -> mixprec.Policy:
    policy = getattr(mixprec.policies, draw(st.sampled_from(POLICIES)))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(used)) if used and draw(st.booleans()) else draw(st.sampled_from(drawable()))
        if draw(st.integers(0, 4)) == 0:
            if op in policy.table:
                policy = policy.without_ops(op)
            continue
        category = draw(st.sampled_from(["lower_precision_fp", "fp32", "promote", "fp32_set_opt_dtype"]))
        try:
            policy = policy.with_ops(**{category: [op]})
        except ValueError:  # a category the op cannot take (fp32_set_opt_dtype needs a dtype argument)
            continue
    return policy


@st.composite
def regions(draw: Any, used: list[str]) -> dict[str, Any]:
    kind = draw(st.sampled_from(["mixprec", "mixprec", "torch", "module"]))
    if kind == "module":
        return {"kind": kind, "policy": draw(st.one_of(st.just("fp32"), policies(used)))}
    region = {
        "kind": kind,
        "dtype": draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16])),
        "enabled": draw(st.integers(0, 4)) > 0,
        "cache_enabled": draw(st.sampled_from([None, None, True, False])),
    }
    if kind == "mixprec":
        region["policy"] = draw(st.one_of(st.none(), policies(used)))
        region["compute"] = draw(st.sampled_from(["native", "native", "emulated"]))
    return region


@st.composite
def nested(draw: Any, items: list[Any], used: list[str], depth: int = 0) -> list[Any]:
    if len(items) < 1 or depth >= 3 or draw(st.integers(0, 3)) == 0:
        return items
    start = draw(st.integers(0, len(items) - 1))
    stop = draw(st.integers(start + 1, len(items)))
    inner = draw(nested(items[start:stop], used, depth + 1))
    region = Region(body=tuple(inner), **draw(regions(used)))
    return [*items[:start], region, *draw(nested(items[stop:], used, depth + 1))]


@st.composite
def programs(draw: Any, names: tuple[str, ...] | None = None, install: bool = True, random: bool = True) -> Program:
    """A random program over ``names`` (default: every drawable op), sometimes under ``mixprec.install``;
    ``random=False``: no sample that draws random numbers (a dropout probability)."""
    names = names or drawable()
    torch.manual_seed(draw(st.integers(0, 2**16)))
    leaves: list[torch.Tensor] = [torch.randn(shape).requires_grad_() for shape in SHARED.values()]
    shared = {name: Ref("leaf", i) for i, name in enumerate(SHARED)}
    calls: list[Call] = []
    floating: list[int] = []  # calls whose output has a floating tensor
    used: list[str] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach().clone()
            if t.is_floating_point() and draw(st.booleans()):
                t.requires_grad_()
            leaves.append(t)
            return Ref("leaf", len(leaves) - 1)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(leaf(v) for v in value)
        return value

    for _ in range(draw(st.integers(2, 10))):
        if floating and draw(st.integers(0, 2)) == 0:
            op, template = draw(st.sampled_from(CHAINS))
            source = draw(st.sampled_from(floating))

            def fill(value: Any, source: int = source) -> Any:
                if isinstance(value, tuple) and value and value[0] == "X":
                    return Ref("out", source, value[1])
                if isinstance(value, str) and value in shared:
                    return shared[value]
                if isinstance(value, list):
                    return [fill(v) for v in value]
                return value

            calls.append(Call(op, tuple(fill(v) for v in template)))
            floating.append(len(calls) - 1)
            used.append(op.partition("::")[2])
            continue
        name = draw(st.sampled_from(names))
        dtype = draw(st.sampled_from(DTYPES))
        found = samples(name, dtype) or samples(name, torch.float32)
        if not random:
            found = tuple(f for f in found if not f[1].get("dropout_p"))
        if not found:
            continue
        args, kwargs = draw(st.sampled_from(found))
        named = tuple((k, leaf(v)) for k, v in kwargs.items())
        calls.append(Call(f"aten::{name}", tuple(leaf(a) for a in args), named))
        if _floating_output(name, args, kwargs):
            floating.append(len(calls) - 1)
        used.append(name)
    body = draw(nested(calls, used))
    if draw(st.integers(0, 9)) < 7:  # most programs run inside some region
        body = [Region(body=tuple(body), **draw(regions(used)))]
    installed = None
    if install and draw(st.integers(0, 9)) == 0:
        installed = (draw(policies(used)), draw(st.sampled_from(["native", "emulated"])))
    return Program(tuple(leaves), tuple(body), installed)


# ---------------------------------------------------------------- running a program through the engine


class _Body(torch.nn.Module):
    def __init__(self, run: Callable[..., list[Any]], items: tuple[Any, ...]) -> None:
        super().__init__()
        self.run, self.items = run, items

    def forward(self, leaves: list[torch.Tensor], outputs: list[Any]) -> list[Any]:
        before = len(outputs)
        outputs = list(outputs)
        self.run(self.items, leaves, outputs)
        return outputs[before:]


def run_engine(program: Program, *, native: bool = False) -> tuple[list[torch.Tensor], list[Any]]:
    """The program through mixprec (``native=True``: its mixprec regions as plain torch.autocast)."""
    leaves = program.fresh_leaves()
    outputs: list[Any] = []

    def run(items: tuple[Any, ...], leaves: list[torch.Tensor], outputs: list[Any]) -> None:
        for item in items:
            if isinstance(item, Call):
                reference.step_seed(len(outputs))
                args = reference.bind(item.args, leaves, outputs)
                kwargs = {k: reference.bind(v, leaves, outputs) for k, v in item.kwargs}
                outputs.append(reference.packet(item.op)(*args, **kwargs))
            elif item.kind == "torch" or (native and item.kind == "mixprec"):
                with torch.autocast(reference.DEVICE, dtype=item.dtype or torch.bfloat16, enabled=item.enabled,
                                    cache_enabled=item.cache_enabled):
                    run(item.body, leaves, outputs)
            elif item.kind == "mixprec":
                with mixprec.autocast(reference.DEVICE, item.dtype, item.enabled, item.cache_enabled,
                                      policy=item.policy, compute=item.compute):
                    run(item.body, leaves, outputs)
            else:
                module = _Body(run, item.body)
                with mixprec.set_module_policy(module, item.policy):
                    outputs.extend(module(leaves, outputs))

    if program.install is None:
        run(program.body, leaves, outputs)
    else:
        with mixprec.install(program.install[0], compute=program.install[1]):
            run(program.body, leaves, outputs)
    return leaves, outputs


# ---------------------------------------------------------------- comparing


@dataclasses.dataclass
class Outcome:
    outputs: list[Any]
    grads: list[Any] | None
    error: str | None  # "forward: T" or "backward: T"
    detail: str = ""  # the error's message (not compared: mixprec's and the interpreter's differ)


def _floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    return []


def outcome(run: Callable[[], tuple[list[torch.Tensor], list[Any]]]) -> Outcome:
    try:
        leaves, outputs = run()
    except reference.UnmodelledError:
        raise
    except Exception as error:
        return Outcome([], None, f"forward: {type(error).__name__}", str(error).splitlines()[0][:300])
    terms = [t.float().sum() for o in outputs for t in _floats(o) if t.requires_grad]
    wanted = [t for t in leaves if t.requires_grad]
    if not terms or not wanted:
        return Outcome(outputs, None, None)
    try:
        grads = list(torch.autograd.grad(torch.stack(terms).sum(), wanted, allow_unused=True))
    except Exception as error:
        return Outcome(outputs, None, f"backward: {type(error).__name__}", str(error).splitlines()[0][:300])
    return Outcome(outputs, grads, None)


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def same_outcome(mine: Outcome, theirs: Outcome, label: str) -> None:
    assert mine.error == theirs.error, (
        f"{label}: mixprec {mine.error} {mine.detail}, {label} {theirs.error} {theirs.detail}"
    )
    _same(mine.outputs, theirs.outputs, f"{label} outputs")
    if mine.grads is not None or theirs.grads is not None:
        _same(mine.grads, theirs.grads, f"{label} gradients")


# ---------------------------------------------------------------- the reference's view of the dispatcher


@functools.cache
def _native() -> reference.NativeTables:
    engine.reset()
    return reference.NativeTables()


def _all_overloads() -> list[Any]:
    names: set[str] = set()
    for attr in POLICIES:
        names |= set(getattr(mixprec.policies, attr).table)
    names |= set(UNLISTED)
    found = []
    for name in sorted(names):
        qualified = name if "::" in name else f"aten::{name}"
        op_name, _, overload = qualified.partition("::")[2].partition(".")
        packet = getattr(torch.ops.aten, op_name, None) if qualified.startswith("aten::") else None
        if packet is None or name.startswith("__"):
            continue
        found.extend(getattr(packet, o) for o in packet.overloads() if not overload or o == overload)
    return found


_OVERLOADS: list[Any] = []


def _overloads() -> Any:
    if not _OVERLOADS:
        _OVERLOADS.extend(_all_overloads())
    return iter(_OVERLOADS)


def _default_only(program: Program) -> bool:
    """Whether native torch.autocast has an answer: default policy, native compute, no module policy."""

    def ok(items: tuple[Any, ...]) -> bool:
        for item in items:
            if isinstance(item, Call):
                continue
            if item.kind == "module":
                return False
            if item.kind == "mixprec" and (item.policy not in (None, mixprec.policies.CPU) or item.compute != "native"):
                return False
            if not ok(item.body):
                return False
        return True

    return program.install is None and ok(program.body)


def check(program: Program) -> None:
    """The program's outcome through mixprec equals the reference's, and native torch's where it has one."""
    native = _native()
    engine.reset()  # this program's kernels are the ones its settings register (the reference's cache rule)
    mine = outcome(lambda: run_engine(program))
    engine.reset()
    try:
        expected = outcome(lambda: reference.Reference(program, native, _overloads).run())
    except reference.UnmodelledError:
        reject()
    same_outcome(mine, expected, "reference")
    if _default_only(program):
        same_outcome(mine, outcome(lambda: run_engine(program, native=True)), "native torch.autocast")


@pytest.fixture(autouse=True)
def _pristine_kernels() -> Any:
    yield
    engine.reset()


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
@settings(PROFILE)
@given(programs())
def test_random_programs_follow_the_reference(program: Program) -> None:
    check(program)


def test_every_table_op_is_drawn_or_named_unreachable() -> None:
    missing = []
    for name in table_names():
        if name in UNREACHABLE or not hasattr(torch.ops.aten, name):
            continue
        if not any(samples(name, dtype) for dtype in (torch.float32, torch.bfloat16)):
            missing.append(name)
    assert not missing, f"table ops with no sample input and no reason in UNREACHABLE: {missing}"
    tables = [getattr(mixprec.policies, attr).table for attr in ("CPU", "CUDA", "XPU")]
    defaults = {name.split("::")[-1].split(".")[0] for table in tables for name in table}
    assert set(UNLISTED).isdisjoint(defaults), "UNLISTED ops are not in any device's default table"


# ---------------------------------------------------------------- shrunk programs, kept as regular tests


def _exact(program: Program) -> Outcome:
    """``check`` for a hand-kept program: the interpreter must model it (no rejection); mixprec's outcome."""
    native = _native()
    engine.reset()
    mine = outcome(lambda: run_engine(program))
    engine.reset()
    same_outcome(mine, outcome(lambda: reference.Reference(program, native, _overloads).run()), "reference")
    if _default_only(program):
        same_outcome(mine, outcome(lambda: run_engine(program, native=True)), "native torch.autocast")
    return mine


def _weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape).requires_grad_() for shape in SHARED.values()]


W, B, S, V = (Ref("leaf", i) for i in range(4))


def test_a_composite_s_calls_meet_the_policy() -> None:
    """chain_matmul is not listed; the mm calls it decomposes into are cast (shrunk from a fuzz failure)."""
    leaves = [*_weights(), torch.randn(2, 3), torch.randn(3, 4), torch.randn(4, 2)]
    call = Call("aten::chain_matmul", ([Ref("leaf", 4), Ref("leaf", 5), Ref("leaf", 6)],))
    found = _exact(Program(tuple(leaves), (Region("mixprec", (call,)),)))
    assert found.outputs[0].dtype == torch.bfloat16


def test_a_composite_is_expanded_one_level() -> None:
    """cross_entropy_loss calls log_softmax, which CUDA_DOCUMENTED runs in float32: its result is float32."""
    leaves = [*_weights(), torch.randn(4, 5).half().requires_grad_(), torch.tensor([0, 2, 4, 1])]
    call = Call("aten::cross_entropy_loss", (Ref("leaf", 4), Ref("leaf", 5)))
    region = Region("mixprec", (call,), dtype=torch.float16, policy=mixprec.policies.CUDA_DOCUMENTED)
    found = _exact(Program(tuple(leaves), (region,)))
    assert found.outputs[0].dtype == torch.float32


def test_promote_walks_its_inputs_in_order() -> None:
    """A bfloat16 input in a float16 region raises before a float32 one is met, and not after (as ATen)."""
    x = Ref("leaf", 4)
    leaves = [*_weights(), torch.randn(3).bfloat16()]
    raises = Call("aten::cat", ([x, V],))
    widens = Call("aten::cat", ([V, x],))
    first, second = (Program(tuple(leaves), (Region("torch", (c,), dtype=torch.float16),)) for c in (raises, widens))
    assert _exact(first).error == "forward: RuntimeError"
    assert _exact(second).outputs[0].dtype == torch.float32


def test_append_dtype_fills_in_the_defaults() -> None:
    """norm.Scalar under CUDA's fp32_append_dtype becomes norm.ScalarOpt_dtype with p=2 and dtype=float32."""
    leaves = [*_weights(), torch.randn(5).bfloat16()]
    region = Region("mixprec", (Call("aten::norm", (Ref("leaf", 4),)),), policy=mixprec.policies.CUDA)
    assert _exact(Program(tuple(leaves), (region,))).outputs[0].dtype == torch.float32


def test_a_documented_table_follows_the_device_it_runs_on() -> None:
    """XPU lists _convolution, but on CPU only its .deprecated overload has an Autocast kernel: .default stays."""
    args, _ = HAND["_convolution"]()
    leaves = [*_weights(), *args[:3]]
    call = Call("aten::_convolution", (Ref("leaf", 4), Ref("leaf", 5), Ref("leaf", 6), *args[3:]))
    found = _exact(Program(tuple(leaves), (Region("mixprec", (call,), policy=mixprec.policies.XPU),)))
    assert found.outputs[0].dtype == torch.float32


def test_an_op_whose_kernel_calls_matmul_is_unmodelled_where_a_policy_lists_mm_alone() -> None:
    """linalg_pinv's kernel calls matmul below autograd, and matmul decomposes into mm: under CPU_DOCUMENTED (mm
    listed, matmul not) the interpreter cannot say what the op computes, and refuses the program. It ran such an
    op in float32 where mixprec's mm ran in bfloat16 (found on torch 2.15 with linalg_matrix_sqrth)."""
    region = Region("mixprec", (Call("aten::linalg_pinv", (Ref("leaf", 0),)),),
                    policy=mixprec.policies.CPU_DOCUMENTED)  # fmt: skip
    with pytest.raises(reference.UnmodelledError, match="calls a listed op below autograd"):
        reference.Reference(Program((torch.randn(5, 5),), (region,)), _native(), _overloads).run()


def test_an_installed_documented_policy_in_torch_regions() -> None:
    """Under install(CPU_DOCUMENTED), matmul is unlisted and decomposes into mm, which is cast (long fuzz)."""
    leaves = [*_weights(), torch.randn(6, 1)]
    body = (Call("aten::matmul", (Ref("leaf", 4), W)), Call("aten::mm", (Ref("leaf", 4), W)))
    program = Program(tuple(leaves), (Region("torch", body),), install=(mixprec.policies.CPU_DOCUMENTED, "native"))
    assert [t.dtype for t in _exact(program).outputs] == [torch.bfloat16, torch.bfloat16]


def test_a_weight_cast_by_torch_and_by_mixprec_kernels() -> None:
    """W meets torch's mm kernel and mixprec's mul kernel in one region: one cast in each cache (docs/design.md)."""
    policy = mixprec.policies.CPU.with_ops(lower_precision_fp=["mul"])
    leaves = [*_weights(), torch.randn(3, 1)]
    x = Ref("leaf", 4)
    body = (Call("aten::mm", (x, W)), Call("aten::mul", (x, W)), Call("aten::mm", (x, W)), Call("aten::mul", (x, W)))
    found = _exact(Program(tuple(leaves), (Region("mixprec", body, policy=policy),)))
    assert found.grads is not None and found.grads[0] is not None


def test_mixprec_s_cache_keeps_one_copy_per_dtype() -> None:
    """Emulated compute gives mm a mixprec kernel; in a nested float16 torch.autocast, W is cast to float16."""
    leaves = [*_weights(), torch.randn(3, 1)]
    x = Ref("leaf", 4)
    inner = Region("torch", (Call("aten::mm", (x, W)),), dtype=torch.float16)
    region = Region("mixprec", (Call("aten::mm", (x, W)), inner), compute="emulated")
    found = _exact(Program(tuple(leaves), (region,)))
    assert [t.dtype for t in found.outputs] == [torch.bfloat16, torch.float16]


def test_a_weight_in_a_default_region_and_in_an_emulated_region_nested_in_it() -> None:
    """mm runs as native in the default region, so W's cast there follows torch's cache (the mirror), while the
    emulated region nested in it casts W through mixprec's own: two copies, whose gradients sum as the engine
    sums them (shrunk from a fuzz failure on torch 2.10)."""
    leaves = [*_weights(), torch.linspace(-7.3, 9.1, 9).reshape(9, 1)]
    x = Ref("leaf", 4)
    emulated = Region("mixprec", (Call("aten::mm", (x, W)),), compute="emulated")
    body = (Call("aten::mm", (x, W)), Region("mixprec", (emulated,), enabled=False), *(Call("aten::mm", (x, W)),) * 5)
    found = _exact(Program(tuple(leaves), (Region("mixprec", body),)))
    assert [t.dtype for t in found.outputs] == [torch.bfloat16] * 7
