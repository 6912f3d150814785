"""Random programs as users write them, compiled: torch.compile must give what the same code gives eagerly.

The random programs of ``test_differential`` (ATen calls nested in ``mixprec.autocast``,
``torch.autocast`` and module-policy regions, sometimes under ``mixprec.install``) are
written out as Python source: real ``with`` statements, ``nn.Module`` s under
``set_module_policy`` for the module regions, ``torch._dynamo.graph_break()`` at random
points, and a dict of non-tensor arguments (a log list the modules append to, a
cache-like iterable object) passed through every module. Each program runs eagerly and
compiled, whole, with ``fullgraph=False``:

* ``aot_eager``: outputs and dtypes equal the eager run's bit for bit, and so do the gradients but for the
  order a leaf's contributions are summed in (AOTAutograd's backward sums them in another order than eager
  autograd, natively too);
* ``inductor``: dtypes equal the eager run's (its fused kernels round differently);
* both: the non-tensor arguments come back as the same objects, the log as eagerly;
* where the policy is native's (no module policy, no installation, default policies with
  native compute), the same program with ``torch.autocast`` in place of ``mixprec.autocast``,
  compiled with the same backend, gives the same bits, gradients included.

A program that fails compiled only because torch cannot compile it (its float32 version,
with every region taken out, fails the same way) is rejected, as is one whose eager run
raises where compiled code runs (compiled kernels check dtypes less than eager ones), and
one whose float32 version torch alone computes compiled other than eagerly.

CI runs a bounded share, part of it in a fresh process (``test_programs_in_a_fresh_process``):
the first compile in a process once crashed where later ones did not. By hand::

    MIXPREC_FUZZ=long python -m pytest tests/test_compiled.py      # >= 2,000 compiled programs
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import _share
import mixprec
import reference
from _opsamples import drawable
from mixprec import engine
from reference import Call, Program, Ref, Region
from test_differential import Outcome, _default_only, outcome, programs, same_outcome

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
LONG = os.environ.get("MIXPREC_FUZZ") == "long"
#: Programs per backend (a third of them on an older release: tests/_share.py).
EXAMPLES = {"aot_eager": 1400 if LONG else _share.examples(30), "inductor": 700 if LONG else _share.examples(10)}
FRESH = 8  # programs in the fresh-process share

#: Ops torch.compile traces on CPU as it runs them eagerly (no random numbers, no complex outputs, no
#: data-dependent shapes): the compiled programs draw from these (those with samples here). Each gives the
#: eager bits compiled with aot_eager, in float32 and bfloat16, with and without torch.autocast, except
#: upsample_bilinear2d, left out: torch traces it through a Python decomposition one ulp away.
COMPILED_OPS = (
    "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "conv1d", "conv2d", "conv_transpose1d",
    "prelu", "addmv", "addr", "dot", "mv", "softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod",
    "exp", "log", "log1p", "expm1", "pow", "rsqrt", "reciprocal", "sinh", "cosh", "tan", "acos", "asin",
    "erfinv", "softplus", "gelu", "norm", "layer_norm", "group_norm", "cat", "stack", "mse_loss", "l1_loss",
    "smooth_l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "nll_loss",
    "cosine_similarity", "cdist", "dist", "renorm", "upsample_nearest2d", "avg_pool2d",
    "adaptive_avg_pool2d", "max_pool2d", "tanh", "sigmoid", "relu", "add", "mul", "sub", "div", "sin", "abs",
    "neg", "maximum", "where", "clamp", "mean", "sqrt", "var", "std", "amax", "erf", "hardtanh", "leaky_relu",
    "silu", "linalg_vector_norm", "frobenius_norm", "trace", "atan2", "lerp", "addcmul", "addcdiv",
    "scaled_dot_product_attention", "kl_div", "huber_loss", "cross_entropy_loss",
)


@functools.cache
def compiled_ops() -> tuple[str, ...]:
    return tuple(name for name in COMPILED_OPS if name in drawable())


# ---------------------------------------------------------------- a program as source code


class Passed:
    """A non-tensor argument that a module must pass on as the same object (iterable, like a KV cache)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(2))


class Body(torch.nn.Module):
    """A module region: runs its part of the program; logs its number in ``extras``."""

    def __init__(self, body: Callable[..., None], number: int) -> None:
        super().__init__()
        self.body, self.number = body, number

    def forward(self, leaves: list[Any], outputs: list[Any], extras: dict[str, Any]) -> list[Any]:
        before = len(outputs)
        outputs = list(outputs)
        self.body(leaves, outputs, extras)
        extras["log"].append(self.number)
        return outputs[before:]


class Source:
    """Python source for a program: ``run(leaves, extras) -> outputs``, with graph breaks before the calls
    numbered in ``breaks``. ``native``: ``torch.autocast`` where the program has ``mixprec.autocast``."""

    def __init__(self, program: Program, breaks: frozenset[int], native: bool = False) -> None:
        self.program, self.breaks, self.native = program, breaks, native
        self.names: dict[str, Any] = {"torch": torch, "mixprec": mixprec, "first_float": reference.first_float}
        self.functions: list[str] = []
        self.calls = itertools.count()
        self.modules: list[tuple[Body, Any]] = []
        self._function("run", self.program.body, top=True)
        self.text = "\n\n".join(self.functions)

    def _name(self, value: Any) -> str:
        name = f"_v{len(self.names)}"
        self.names[name] = value
        return name

    def _value(self, value: Any) -> str:
        if isinstance(value, Ref):
            base = f"leaves[{value.index}]" if value.source == "leaf" else f"first_float(outputs[{value.index}])"
            return base if value.shape is None else f"{base}.reshape({value.shape!r})"
        if isinstance(value, list):
            return "[" + ", ".join(self._value(v) for v in value) + "]"
        if isinstance(value, tuple):
            return "(" + "".join(self._value(v) + ", " for v in value) + ")"
        if value is None or (isinstance(value, (bool, int, float, str)) and repr(value) == repr(eval(repr(value)))):
            return repr(value)
        return self._name(value)  # a dtype, an inf, anything without a literal

    def _lines(self, items: tuple[Any, ...], indent: str) -> list[str]:
        lines: list[str] = []
        for item in items:
            if isinstance(item, Call):
                if next(self.calls) in self.breaks:
                    lines.append(f"{indent}torch._dynamo.graph_break()")
                op = self._name(reference.packet(item.op))
                args = [self._value(a) for a in item.args] + [f"{k}={self._value(v)}" for k, v in item.kwargs]
                lines.append(f"{indent}outputs.append({op}({', '.join(args)}))")
            elif item.kind == "module":
                body = self._function(f"body{len(self.modules)}", item.body)
                module = Body(self.names[body], len(self.modules))
                self.modules.append((module, item.policy))
                lines.append(f"{indent}outputs.extend({self._name(module)}(leaves, outputs, extras))")
            else:
                dtype = self._value(item.dtype or torch.bfloat16)
                if item.kind == "torch" or self.native:
                    head = f"torch.autocast('cpu', dtype={dtype}, enabled={item.enabled}, " \
                           f"cache_enabled={item.cache_enabled!r})"
                else:
                    head = f"mixprec.autocast('cpu', {dtype}, {item.enabled}, {item.cache_enabled!r}, " \
                           f"policy={self._value(item.policy)}, compute={item.compute!r})"
                lines.append(f"{indent}with {head}:")
                lines.extend(self._lines(item.body, indent + "    ") or [f"{indent}    pass"])
        return lines

    def _function(self, name: str, items: tuple[Any, ...], top: bool = False) -> str:
        head = f"def {name}(leaves, extras):\n    outputs = []" if top else f"def {name}(leaves, outputs, extras):"
        tail = "\n    return outputs" if top else ""
        text = head + "\n" + "\n".join(self._lines(items, "    ") or ["    pass"]) + tail
        exec(compile(text, f"<program {name}>", "exec"), self.names)
        self.functions.append(text)
        return name

    def runner(self, compiled: Callable[[Callable[..., Any]], Callable[..., Any]] | None) -> Callable[[], Any]:
        """``() -> (leaves, outputs)``, the program run (through ``compiled`` if given), its extras checked."""
        function = self.names["run"]

        def run() -> tuple[list[torch.Tensor], list[Any]]:
            handles = [mixprec.set_module_policy(m, p) for m, p in self.modules if not self.native]
            extras = {"log": [], "passed": Passed()}
            passed = extras["passed"]
            leaves = self.program.fresh_leaves()
            try:
                fn = compiled(function) if compiled is not None else function
                if self.program.install is None:
                    outputs = fn(leaves, extras)
                else:
                    with mixprec.install(self.program.install[0], compute=self.program.install[1]):
                        outputs = fn(leaves, extras)
            finally:
                for handle in handles:
                    handle.remove()
            assert extras["passed"] is passed, "a module rebuilt a non-tensor argument"
            self.log = list(extras["log"])
            return leaves, outputs

        return run


# ---------------------------------------------------------------- checking


def _compiler(backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Compile with ``backend``, the backward traced with autocast off, as eager autograd runs it here.

    By default torch traces a compiled frame's backward under the autocast state the frame was entered with
    (``torch._functorch.config.backward_pass_autocast = "same_as_forward"``): a frame compiled inside a region
    (one that a graph break in a region with a policy leaves to be compiled alone, or any compiled call inside
    a torch.autocast region) then casts its backward where eager autograd, run after the region, does not. Native
    torch.autocast around a compiled call differs from eager the same way; ``"off"`` makes both eager's.
    """

    def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
        torch._dynamo.reset()
        inner = torch.compile(fn, backend=backend)

        def call(*args: Any, **kwargs: Any) -> Any:
            with torch._functorch.config.patch(backward_pass_autocast="off"):
                return inner(*args, **kwargs)

        return call

    return compiled


def _stripped(program: Program) -> Program:
    """The program with every region taken out (float32 throughout): what torch can compile of it."""

    def flat(items: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(c for item in items for c in ((item,) if isinstance(item, Call) else flat(item.body)))

    return Program(program.leaves, flat(program.body), None)


def _torch_differs(program: Program, breaks: frozenset[int], backend: str) -> bool:
    """Whether torch alone computes the program's float32 version (its regions taken out) compiled other than
    eagerly: a NaN one side of a fused backward, say. Only a program whose float32 version runs is judged."""
    stripped = Source(_stripped(program), breaks)
    eager, compiled = outcome(stripped.runner(None)), outcome(stripped.runner(_compiler(backend)))
    if eager.error is not None or compiled.error is not None:
        return False
    try:
        same_outcome(Outcome(compiled.outputs, None, None), Outcome(eager.outputs, None, None), "float32")
        _same_up_to_order(compiled.grads, eager.grads, torch.float32, "float32 gradients")
    except AssertionError:
        return True
    return False


def _dtypes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return [_dtypes(v) for v in value]
    return type(value).__name__


def check(program: Program, breaks: frozenset[int], backend: str) -> None:
    """The program compiled with ``backend`` against its eager run, and against native's where it has one."""
    engine.reset()
    source = Source(program, breaks)
    eager = outcome(source.runner(None))
    eager_log = source.log if eager.error is None else None
    engine.reset()
    mine = outcome(source.runner(_compiler(backend)))
    if mine.error is not None and eager.error is None:
        stripped = Source(_stripped(program), breaks)
        if outcome(stripped.runner(_compiler(backend))).error is not None:
            reject()  # torch cannot compile this program, regions or not
        raise AssertionError(f"compiled {mine.error} {mine.detail}; eagerly it runs\n{source.text}")
    if eager.error is not None:
        if mine.error is None:
            reject()  # compiled kernels check dtypes less than eager ones: a torch property
        return
    assert source.log == eager_log, f"modules logged {source.log}, eagerly {eager_log}\n{source.text}"
    if backend == "aot_eager":
        try:
            same_outcome(Outcome(mine.outputs, None, None), Outcome(eager.outputs, None, None),
                         f"eager ({source.text})")
            _same_up_to_order(mine.grads, eager.grads, _low(program), f"eager gradients ({source.text})")
        except AssertionError:
            if _torch_differs(program, breaks, backend):
                reject()  # torch's compiled code differs from eager on this program without any region
            raise
    else:
        assert _dtypes(mine.outputs) == _dtypes(eager.outputs), f"dtypes differ from eager\n{source.text}"
        assert _dtypes(mine.grads) == _dtypes(eager.grads), f"gradient dtypes differ from eager\n{source.text}"
    if _default_only(program):
        native = Source(program, breaks, native=True)
        engine.reset()
        same_outcome(mine, outcome(native.runner(_compiler(backend))), f"native torch.autocast ({source.text})")


def _low(program: Program) -> torch.dtype:
    """The coarsest floating dtype the program's gradients can be summed in."""
    def regions(items: tuple[Any, ...]) -> bool:
        return any(not isinstance(i, Call) and ((i.kind != "module" and i.enabled) or regions(i.body)) for i in items)

    low = {t.dtype for t in program.leaves} & {torch.bfloat16, torch.float16}
    if regions(program.body) or program.install is not None or torch.bfloat16 in low:
        return torch.bfloat16
    return torch.float16 if low else torch.float32


def _same_up_to_order(mine: Any, theirs: Any, low: torch.dtype, where: str) -> None:
    """Gradients equal but for the order a leaf's contributions are summed in: AOTAutograd's backward graph
    sums them in another order than eager autograd, natively too (a weight used five times under bfloat16
    autocast: its gradient moves by 0.5 in 250, measured with torch.autocast). The sums may be in ``low``, so
    the tolerance is a few of its roundings; forward outputs are compared bit for bit."""
    assert (mine is None) == (theirs is None), where
    if mine is None:
        return
    assert _dtypes(mine) == _dtypes(theirs), f"{where}: dtypes differ"
    eps = 4 * torch.finfo(low).eps if low is not torch.float32 else 64 * torch.finfo(low).eps
    for a, b in zip(mine, theirs, strict=True):
        if isinstance(a, torch.Tensor):
            scale = float(b.detach().abs().max().nan_to_num()) if b.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=eps, atol=eps * scale, equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")


@st.composite
def compiled_programs(draw: Any) -> tuple[Program, frozenset[int]]:
    program = draw(programs(compiled_ops(), random=False))
    count = sum(1 for _ in program.calls())
    breaks = draw(st.frozensets(st.integers(0, max(count - 1, 0)), max_size=3))
    return program, breaks


def _settings(backend: str) -> settings:
    return settings(max_examples=EXAMPLES[backend], deadline=None, derandomize=not LONG, database=None,
                    print_blob=True, suppress_health_check=_QUIET)


@pytest.fixture(autouse=True)
def _pristine() -> Any:
    yield
    engine.reset()
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_programs_give_the_eager_results(backend: str) -> None:
    checked: list[Program] = []

    @_settings(backend)
    @given(compiled_programs())
    def compiled_as_eager(drawn: tuple[Program, frozenset[int]]) -> None:
        check(*drawn, backend)
        checked.append(drawn[0])

    compiled_as_eager()
    # The profile's count is of programs checked clean (a program check() rejects does not count).
    assert len(checked) >= EXAMPLES[backend], f"{len(checked)} programs checked, of {EXAMPLES[backend]}"


def fresh(count: int) -> None:
    """Run ``count`` compiled programs (aot_eager), starting in this process's first compile."""

    @settings(max_examples=count, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=_QUIET)
    @given(compiled_programs())
    def compiled_as_eager(drawn: tuple[Program, frozenset[int]]) -> None:
        check(*drawn, "aot_eager")

    compiled_as_eager()


def test_programs_in_a_fresh_process() -> None:
    code = f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_compiled
        test_compiled.fresh({_share.examples(FRESH)})
        print("clean")
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("clean"), done.stdout[-3000:] + done.stderr[-6000:]


def test_the_compiled_op_set_is_drawable() -> None:
    missing = sorted(set(COMPILED_OPS) - set(compiled_ops()))
    assert len(compiled_ops()) >= 60, f"too few compiled ops with samples; without one: {missing}"


def test_source_of_a_program_reads_as_user_code() -> None:
    torch.manual_seed(0)
    program = Program(
        (torch.randn(2, 2).requires_grad_(),),
        (Region("mixprec", (Call("aten::mm", (Ref("leaf", 0), Ref("leaf", 0))),
                            Region("module", (Call("aten::exp", (Ref("out", 0),)),), policy="fp32")),
                policy=mixprec.policies.CPU.with_ops(fp32=["exp"])),),
    )
    source = Source(program, frozenset({1}))
    assert "with mixprec.autocast('cpu'" in source.text and "torch._dynamo.graph_break()" in source.text
    _, outputs = source.runner(None)()
    assert [o.dtype for o in outputs] == [torch.bfloat16, torch.float32] and source.log == [0]
    check(program, frozenset({1}), "aot_eager")
