"""A reference interpreter for mixprec's autocast: what a program should compute, written out by hand.

It runs a :class:`Program` with torch's autocast off and applies the policy
itself: for each ATen call, the casts of the op's category, as the README,
``docs/design.md`` and ATen's ``autocast_mode.h`` define them. It shares
nothing with mixprec's engine but the policy tables (``Policy.table`` and the
built-in policies), so a test that compares the two checks the engine against
an independent statement of the rules.

A program is data: leaf tensors, then a body of ATen calls (``Call``) and
regions (``Region``) nested in each other::

    Region("mixprec", dtype=..., enabled=..., policy=..., compute="native" | "emulated", cache_enabled=...)
    Region("torch", dtype=..., enabled=..., cache_enabled=...)       # a plain torch.autocast
    Region("module", policy=Policy | "fp32")                          # a module under set_module_policy

and optionally ``install=(policy, compute)``, a ``mixprec.install`` in force
for the whole program. ``tests/test_differential.py`` runs the same program
through mixprec's engine and compares outputs, dtypes and gradients.

The rules, in the order the interpreter applies them:

State. Autocast on or off, its dtype and cache flag (torch's), the mixprec
setting (policy and emulated compute) of the innermost region that has one,
the stack of module policies.

- ``mixprec.autocast(enabled=True)`` turns autocast on with its dtype and sets
  the setting: its policy, else the innermost module policy, else the installed
  one, else the device's default; emulated if ``compute="emulated"``.
- ``mixprec.autocast(enabled=False)`` turns autocast off and keeps the setting.
- ``torch.autocast`` sets on/off, dtype and cache flag, and keeps the setting.
- A module with a policy, entered while autocast is on, keeps on/dtype and
  sets the setting to the module's policy (keeping the setting's compute). With
  ``"fp32"`` and autocast on, the module's eligible inputs are cast to float32
  and autocast is off inside. Either way a region opened inside with
  ``policy=None`` takes the module's policy.
- Every region restores what it changed on exit.

An op's category under a policy P, for an overload o of op X. D is the
default policy of P's base device (CUDA for ``policies.CUDA``; the device the
program runs on for documented tables, XPU's included, and hand-made ones)::

    P[o] = P's entry for "aten::X.o" if it has one, else its entry for X
    category = P[o] if P[o] != D[o], else D[o] if torch registers o at D's Autocast key, else none

With no setting and no installation, the category is torch's native one (P = D
= the device's default). In-place and ``out=`` overloads have no category.

Eligible tensor: floating, on the device, not float64. The categories:

- ``lower_precision_fp``: eligible tensors not in the autocast dtype are cast
  to it; under emulated compute, when all floating inputs are then in the
  autocast dtype, the op runs on their float32 upcast and each float32 output
  is rounded to the autocast dtype, or to an explicit ``dtype``/``out_dtype``
  argument's (backward: the incoming gradient upcast, float32 backward, the
  gradient rounded).
- ``fp32``: eligible tensors cast to float32.
- ``fp32_set_opt_dtype``: if the first argument is eligible and the overload
  has a ``dtype`` argument left None, it gets ``dtype=float32``.
- ``fp32_append_dtype``: if the first argument is eligible, the sibling
  overload with a trailing ``dtype`` argument is called with ``float32``.
- ``promote``: eligible tensors cast to float32 if one is float32, else they
  are all in the autocast dtype; any other mix raises.
- ``banned``: raises if an eligible tensor is among the arguments.

The cast cache: a ``lower_precision_fp`` cast of a float32 leaf that
requires grad (not a view) is made once and reused while the cache lives
(torch's cache is keyed by the weight alone, mixprec's by weight and dtype).
There are three caches, as documented in ``docs/design.md``: an op with a
mixprec kernel (one registered for some setting the program entered) that the
setting in force changes or emulates uses mixprec's while a mixprec level is
open (a mixprec region or a module-policy level), if the cache flag is on and
grad is enabled; it is dropped when the last mixprec level closes. Outside
mixprec levels such an op uses mixprec's mirror of torch's cache, keyed there by
weight and dtype. An op with a mixprec kernel that the setting runs as native
(torch's category, native compute; or no setting) uses the mirror keyed by the
weight alone, as if it had no kernel. Any other op uses torch's own. Torch's
cache and the mirror follow torch's rule: on with the cache flag, also under
``no_grad`` (their copies carry autograd history even there), and dropped when
torch's nesting returns to 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import mixprec

DEVICE = "cpu"


# ---------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class Ref:
    """An earlier value: ``("leaf", i)`` or ``("out", i)`` (an output's first floating tensor), reshaped."""

    source: str
    index: int
    shape: tuple[int, ...] | None = None  # reshape to this (e.g. (-1,) or (-1, 1)) before use


@dataclasses.dataclass(frozen=True)
class Call:
    """One ATen call: ``torch.ops.<namespace>.<op>(*args, **kwargs)``; ``args`` may hold ``Ref``s."""

    op: str  # "aten::mm"
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Region:
    kind: str  # "mixprec", "torch" or "module"
    body: tuple[Any, ...]
    dtype: torch.dtype | None = None
    enabled: bool = True
    cache_enabled: bool | None = None
    policy: Any = None  # a Policy, None, or "fp32" (module regions)
    compute: str = "native"


@dataclasses.dataclass(frozen=True)
class Program:
    leaves: tuple[torch.Tensor, ...]  # templates; each run gets fresh copies (requires_grad as here)
    body: tuple[Any, ...]
    install: tuple[Any, str] | None = None  # (policy, compute)

    def __repr__(self) -> str:
        def show(value: Any) -> str:
            if isinstance(value, torch.Tensor):
                return f"tensor({tuple(value.shape)}, {value.dtype}{', grad' if value.requires_grad else ''})"
            if isinstance(value, Ref):
                return f"{value.source}{value.index}" + (f".reshape{value.shape}" if value.shape else "")
            if isinstance(value, (list, tuple)):
                return "[" + ", ".join(show(v) for v in value) + "]"
            if isinstance(value, mixprec.Policy):
                return f"{value.base}{value.changes or ''}"
            return repr(value)

        lines = [f"leaves: {show(self.leaves)}"]
        if self.install is not None:
            lines.append(f"install({show(self.install[0])}, compute={self.install[1]!r})")

        def walk(body: Sequence[Any], indent: str) -> None:
            for item in body:
                if isinstance(item, Call):
                    kwargs = "".join(f", {k}={show(v)}" for k, v in item.kwargs)
                    lines.append(f"{indent}{item.op}({', '.join(show(a) for a in item.args)}{kwargs})")
                    continue
                options = {"dtype": item.dtype, "enabled": item.enabled, "cache": item.cache_enabled,
                           "policy": show(item.policy), "compute": item.compute}
                keep = ("policy",) if item.kind == "module" else (
                    ("dtype", "enabled", "cache") + (("policy", "compute") if item.kind == "mixprec" else ()))
                lines.append(f"{indent}with {item.kind}({', '.join(f'{k}={options[k]}' for k in keep)}):")
                walk(item.body, indent + "    ")

        walk(self.body, "")
        return "\n".join(lines)

    def fresh_leaves(self) -> list[torch.Tensor]:
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in self.leaves]

    def calls(self) -> Iterator[Call]:
        def walk(body: Sequence[Any]) -> Iterator[Call]:
            for item in body:
                if isinstance(item, Call):
                    yield item
                else:
                    yield from walk(item.body)

        return walk(self.body)


def packet(name: str) -> Any:
    namespace, _, op = name.partition("::")
    return getattr(getattr(torch.ops, namespace), op)


def resolve(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The overload torch's dispatcher picks for ``torch.ops.<name>(*args, **kwargs)``."""
    overload = torch._C._jit_resolve_packet(name, *args, **kwargs)
    return getattr(packet(name), overload)


def first_float(value: Any) -> torch.Tensor | None:
    """The first floating tensor in an output (a tensor or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (list, tuple)):
        for v in value:
            found = first_float(v)
            if found is not None:
                return found
    return None


def lookup(ref: Ref, leaves: Sequence[torch.Tensor], outputs: Sequence[Any]) -> torch.Tensor:
    value = leaves[ref.index] if ref.source == "leaf" else first_float(outputs[ref.index])
    if value is None:
        raise LookupError(f"output {ref.index} has no floating tensor")
    return value if ref.shape is None else value.reshape(ref.shape)


def bind(value: Any, leaves: Sequence[torch.Tensor], outputs: Sequence[Any]) -> Any:
    if isinstance(value, Ref):
        return lookup(value, leaves, outputs)
    if isinstance(value, (list, tuple)):
        return type(value)(bind(v, leaves, outputs) for v in value)
    return value


def step_seed(index: int) -> None:
    """Both runs seed the generator the same way before each call (dropout and friends)."""
    torch.manual_seed(1234 + index)


# ---------------------------------------------------------------- the policy rule

# The built-in policies that reproduce a device's native tables; documented ones (XPU's guide,
# CPU_DOCUMENTED, CUDA_DOCUMENTED) and hand-made tables follow the device they run on.
_BASE_DEVICE = {"CPU": "cpu", "CUDA": "cuda"}
_DEFAULT = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU"}


class NativeTables:
    """Torch's own Autocast registrations, read once before any mixprec kernel exists."""

    def __init__(self) -> None:
        self.registered = {
            device: frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(f"Autocast{key}"))
            for device, key in (("cpu", "CPU"), ("cuda", "CUDA"), ("xpu", "XPU"))
        }


def _qualified(op: Any) -> str:
    name = op.overloadpacket._qualified_op_name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _functional(op: Any) -> bool:
    return not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def entry(policy: mixprec.Policy, op: Any) -> str | None:
    """The policy's entry for an overload: its own (``aten::softmax.int``), else its op's (``softmax``)."""
    if not _functional(op):
        return None
    qualified = op.overloadpacket._qualified_op_name
    namespace, _, name = qualified.partition("::")
    overload = f"{qualified}.{op._overloadname}"
    for key in (overload, overload.removeprefix("aten::")):
        if key in policy.table:
            return str(policy.table[key].value)
    for key in (qualified, name) if namespace == "aten" else (qualified,):
        if key in policy.table:
            return str(policy.table[key].value)
    return None


def category(policy: mixprec.Policy | None, op: Any, native: NativeTables) -> str | None:
    """The category of an overload under ``policy`` on the CPU (None: torch's native autocast)."""
    base_device = _BASE_DEVICE.get(policy.base, DEVICE) if policy is not None else DEVICE
    default = getattr(mixprec.policies, _DEFAULT[base_device])
    mine = entry(policy if policy is not None else default, op)
    theirs = entry(default, op)
    if mine != theirs:
        return mine
    return theirs if _qualified(op) in native.registered[base_device] else None


class UnmodelledError(Exception):
    """The program reaches something the interpreter does not model (a decomposition it cannot trace faithfully)."""


#: Composites whose kernel picks another path when traced, with results that can still agree in float32.
TRACED_DIFFERENTLY = {
    "aten::scaled_dot_product_attention": "eagerly a fused CPU kernel; traced, the math path",
}


#: Ops whose kernels call other ops themselves, below autograd, where autocast (native, and so mixprec's)
#: still applies to those calls. The interpreter models the calls a program and a composite make above
#: autograd only: a program that reaches one of these uncategorized while a callee has a category is
#: refused (``UnmodelledError``). Found by the differential tests.
CALLS_BELOW_AUTOGRAD = {
    "aten::_trilinear": ("bmm",),  # bilinear's kernel
    # (matmul decomposes into mm or bmm, which a policy may list where it leaves matmul out: CPU_DOCUMENTED)
    "aten::linalg_pinv": ("matmul", "mm", "bmm"),  # pinverse's
    "aten::linalg_matrix_sqrth": ("matmul", "mm", "bmm"),  # torch 2.15's: its CPU kernel calls matmul
    "aten::vdot": ("dot",),
    "aten::stack": ("cat",),
}


def _identical(a: Any, b: Any) -> bool:
    """Same structure, and tensors equal bit for bit in dtype, shape and value (NaNs where NaNs)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach(), b.detach()
        if a.is_complex():
            a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                          and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or a != a)


def _composite(op: Any) -> bool:
    """Whether the op runs as its CompositeImplicitAutograd decomposition on CPU tensors (torch's computed
    dispatch table has the "math kernel" at AutogradCPU)."""
    return _runs_decomposed(_qualified(op))


@functools.cache
def _runs_decomposed(name: str) -> bool:
    rows = torch._C._dispatch_dump_table(name).splitlines()
    return any(row.startswith("AutogradCPU:") and row.endswith("[math kernel]") for row in rows)


# ---------------------------------------------------------------- the interpreter


@dataclasses.dataclass
class _Setting:
    policy: mixprec.Policy
    emulate: bool


@dataclasses.dataclass
class _State:
    enabled: bool = False
    dtype: torch.dtype = torch.bfloat16
    cache_flag: bool = True
    setting: _Setting | None = None
    module_policies: list[mixprec.Policy] = dataclasses.field(default_factory=list)
    mixprec_levels: int = 0
    torch_nesting: int = 0
    mixprec_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)
    torch_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)
    mirror_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)  # mixprec's of torch's
    exact_cache: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)  # the mirror's by-dtype entries
    kernels: set[Any] = dataclasses.field(default_factory=set)  # overloads with a mixprec kernel


class Reference:
    """Interprets programs; one instance per program run."""

    def __init__(self, program: Program, native: NativeTables, overloads: Callable[[], Iterator[Any]]) -> None:
        self.program = program
        self.native = native
        self.overloads = overloads  # every overload a policy could name (for the kernels a setting registers)
        self.state = _State()
        self.installed: _Setting | None = None
        self.leaves: list[torch.Tensor] = []
        self.outputs: list[Any] = []

    # -- which ops run through a mixprec kernel: those some entered setting changes, or emulates

    def _register(self, setting: _Setting) -> None:
        for op in self.overloads():
            mine, theirs = category(setting.policy, op, self.native), category(None, op, self.native)
            if mine != theirs or (setting.emulate and mine == "lower_precision_fp"):
                self.state.kernels.add(op)

    # -- regions

    def run(self) -> tuple[list[torch.Tensor], list[Any]]:
        self.leaves = self.program.fresh_leaves()
        if self.program.install is not None:
            policy, compute = self.program.install
            self.installed = _Setting(policy, compute == "emulated")
            self._register(self.installed)
        self._body(self.program.body)
        return self.leaves, self.outputs

    def _body(self, body: Sequence[Any]) -> None:
        for item in body:
            if isinstance(item, Call):
                self._call(item)
            else:
                self._region(item)

    def _region(self, region: Region) -> None:
        s = self.state
        saved = (s.enabled, s.dtype, s.cache_flag, s.setting)
        opened_mixprec = opened_torch = False
        module_pushed = False
        leaves, outputs = self.leaves, self.outputs
        if region.kind == "mixprec":
            if region.enabled:
                policy = region.policy
                if policy is None:
                    policy = s.module_policies[-1] if s.module_policies else None
                if policy is None and self.installed is not None:
                    policy = self.installed.policy
                if policy is None:
                    policy = mixprec.policies.CPU
                s.setting = _Setting(policy, region.compute == "emulated")
                self._register(s.setting)
            s.enabled = region.enabled
            s.dtype = region.dtype or torch.bfloat16
            s.cache_flag = s.cache_flag if region.cache_enabled is None else region.cache_enabled  # as torch
            opened_mixprec = opened_torch = True
        elif region.kind == "torch":
            s.enabled = region.enabled
            s.dtype = region.dtype or torch.bfloat16
            s.cache_flag = s.cache_flag if region.cache_enabled is None else region.cache_enabled
            opened_torch = True
        elif isinstance(region.policy, mixprec.Policy):
            if s.enabled:
                current = s.setting or self.installed
                s.setting = _Setting(region.policy, current.emulate if current is not None else False)
                self._register(s.setting)
                opened_mixprec = opened_torch = True
            s.module_policies.append(region.policy)
            module_pushed = True
        else:  # a module under "fp32": its inputs are the values so far, cast
            if s.enabled:
                self.leaves = [self._to32(t) for t in leaves]
                self.outputs = [self._to32_output(o) for o in outputs]
                s.enabled = False
                opened_mixprec = opened_torch = True
        s.mixprec_levels += opened_mixprec
        s.torch_nesting += opened_torch
        try:
            self._body(region.body)
        finally:
            new_outputs = self.outputs[len(outputs):]
            self.leaves, self.outputs = leaves, outputs + new_outputs
            if module_pushed:
                s.module_policies.pop()
            s.enabled, s.dtype, s.cache_flag, s.setting = saved
            s.mixprec_levels -= opened_mixprec
            s.torch_nesting -= opened_torch
            if opened_mixprec and s.mixprec_levels == 0:
                s.mixprec_cache.clear()
            if opened_torch and s.torch_nesting == 0:
                s.torch_cache.clear()
                s.mirror_cache.clear()
                s.exact_cache.clear()

    @staticmethod
    def _eligible(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.is_cpu

    def _to32(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32) if self._eligible(t) else t

    def _to32_output(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._to32(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._to32_output(v) for v in value)
        return value

    # -- calls

    def _call(self, call: Call) -> None:
        step_seed(len(self.outputs))
        args = bind(call.args, self.leaves, self.outputs)
        kwargs = {k: bind(v, self.leaves, self.outputs) for k, v in call.kwargs}
        op = resolve(call.op, args, kwargs)
        self.outputs.append(self._apply(op, tuple(args), kwargs))

    def _apply(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        s = self.state
        if not s.enabled:
            return op(*args, **kwargs)
        setting = s.setting or self.installed
        policy = setting.policy if setting is not None else None
        found = category(policy, op, self.native)
        if found is None and any(
            category(policy, inner, self.native) is not None
            for name in CALLS_BELOW_AUTOGRAD.get(op.overloadpacket._qualified_op_name, ())
            for inner in (getattr(packet(f"aten::{name}"), o) for o in packet(f"aten::{name}").overloads())
        ):
            raise UnmodelledError(f"{_qualified(op)}: its kernel calls a listed op below autograd")
        if found is None:
            if _composite(op):  # it decomposes below the Autocast key: the ops it calls meet autocast there
                return self._decomposed(op, args, kwargs)
            return op(*args, **kwargs)
        first = args[0] if args else next(iter(kwargs.values()), None)
        if found == "lower_precision_fp":
            cast_args, cast_kwargs = self._cast_all(args, kwargs, s.dtype, weights=self._cache_for(op, setting))
            if setting is not None and setting.emulate:
                return self._emulated(op, cast_args, cast_kwargs, s.dtype)
            return op(*cast_args, **cast_kwargs)
        if found == "fp32":
            cast_args, cast_kwargs = self._cast_all(args, kwargs, torch.float32, weights=None)
            return op(*cast_args, **cast_kwargs)
        if found == "fp32_set_opt_dtype":
            names = [a.name for a in op._schema.arguments]
            bound = self._by_name(op, args, kwargs)
            if self._eligible(first) and "dtype" in names and bound.get("dtype") is None:
                bound["dtype"] = torch.float32
                return self._call_by_name(op, bound)
            return op(*args, **kwargs)
        if found == "fp32_append_dtype":
            sibling = self._with_dtype(op)
            if self._eligible(first) and sibling is not None:
                bound = self._by_name(op, args, kwargs)
                bound["dtype"] = torch.float32
                return self._call_by_name(sibling, bound)
            return op(*args, **kwargs)
        if found == "promote":
            to = s.dtype  # walk the eligible inputs in order: float32 wins, another low dtype before it raises
            for t in self._tensors(args, kwargs):
                if not self._eligible(t) or to == torch.float32:
                    continue
                if t.dtype == torch.float32:
                    to = torch.float32
                elif t.dtype != s.dtype:
                    raise RuntimeError("promote: a low-precision input other than the autocast dtype")
            cast_args, cast_kwargs = self._cast_all(args, kwargs, to, weights=None)
            return op(*cast_args, **cast_kwargs)
        if found == "banned":
            if any(self._eligible(t) for t in self._tensors(args, kwargs)):
                raise RuntimeError(f"{_qualified(op)} is banned in autocast")
            return op(*args, **kwargs)
        raise AssertionError(f"no rule for category {found!r}")

    def _decomposed(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A composite op, one call of its decomposition at a time: each meets the rules as it would natively.

        The composite kernel's own calls are traced with ``make_fx(pre_dispatch=True)``, one level deep
        (a composite it calls is expanded again when replayed), on the arguments (it may branch on
        ``requires_grad``),
        in float32 if their dtypes are mixed (the rules reconcile them call by call), then replayed. A
        decomposition that takes another path under the trace than eagerly (some branch on "is this being
        traced": sdpa's kernel choice, svdvals computing the vectors) is refused: replayed without casts,
        it must give the op's own result bit for bit, or the interpreter raises ``UnmodelledError``.
        """
        flat, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]

        def call(function: Any, *tensors: torch.Tensor) -> Any:
            values = list(flat)
            for i, t in zip(slots, tensors, strict=True):
                values[i] = t
            call_args, call_kwargs = pytree.tree_unflatten(values, spec)
            return function(*call_args, **call_kwargs)

        def one_level(*call_args: Any, **call_kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():  # run the composite kernel itself, so the trace sees its calls
                return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *call_args, **call_kwargs)

        def trace(tensors: list[torch.Tensor]) -> torch.fx.GraphModule:
            return make_fx(functools.partial(call, one_level), pre_dispatch=True)(*tensors)

        state = torch.random.get_rng_state()
        tensors = [flat[i] for i in slots]
        try:
            graph = trace(tensors)
        except Exception:  # mixed input dtypes, which the rules reconcile call by call
            tensors = [t.float() if self._eligible(t) else t for t in tensors]
            torch.random.set_rng_state(state)
            try:
                graph = trace(tensors)
            except Exception as error:  # data-dependent control flow (quantile): no graph to replay
                raise UnmodelledError(f"{_qualified(op)}: its decomposition cannot be traced") from error
        torch.random.set_rng_state(state)
        traced = graph(*tensors)
        torch.random.set_rng_state(state)
        eager = call(op, *tensors)
        torch.random.set_rng_state(state)  # replay from the random state the op would have started from
        if _qualified(op) in TRACED_DIFFERENTLY or not _identical(traced, eager):
            raise UnmodelledError(f"{_qualified(op)}: its decomposition takes another path when traced")
        reference = self

        class Replay(torch.fx.Interpreter):
            def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
                if isinstance(target, torch._ops.OpOverload):
                    return reference._apply(target, tuple(args), dict(kwargs))
                return super().call_function(target, args, kwargs)

        return Replay(graph).run(*[flat[i] for i in slots])

    def _cache_for(self, op: Any, setting: _Setting | None) -> dict[Any, torch.Tensor] | None:
        """The cache a ``lower_precision_fp`` op's weights go through (see the module)."""
        s = self.state
        if op not in s.kernels:
            return s.torch_cache if s.cache_flag else None
        as_native = setting is None or (
            not setting.emulate and category(setting.policy, op, self.native) == category(None, op, self.native)
        )
        if as_native:
            return s.mirror_cache if s.cache_flag else None
        if s.mixprec_levels > 0:
            return s.mixprec_cache if s.cache_flag and torch.is_grad_enabled() else None
        return s.exact_cache if s.cache_flag else None

    def _cast(self, t: torch.Tensor, to: torch.dtype, weights: dict[Any, torch.Tensor] | None) -> torch.Tensor:
        if not self._eligible(t) or t.dtype == to:
            return t
        weight = t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
        if weights is not None and weight:
            # torch's cache is keyed by the weight alone (a copy cast for an outer region's dtype is
            # returned in a nested region of another dtype); mixprec's by the weight and the dtype.
            torch_cache = weights is not self.state.mixprec_cache
            by_dtype = not torch_cache or weights is self.state.exact_cache
            key = (id(t), to) if by_dtype else (id(t), None)
            if key not in weights:
                # torch's cache records the cast's autograd history even under no_grad (a copy cached there
                # carries the weight's gradient when reused with grad on); mixprec's is off under no_grad.
                with torch.enable_grad() if torch_cache else contextlib.nullcontext():
                    weights[key] = t.to(to)
            return weights[key]
        return t.to(to)

    def _cast_all(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], to: torch.dtype, weights: dict[Any, torch.Tensor] | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def one(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return self._cast(value, to, weights)
            if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(self._cast(v, to, weights) if isinstance(v, torch.Tensor) else v for v in value)
            return value

        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    @staticmethod
    def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        found = []
        for value in (*args, *kwargs.values()):
            items = value if type(value) in (list, tuple) else (value,)
            found.extend(v for v in items if isinstance(v, torch.Tensor))
        return found

    def _emulated(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype) -> Any:
        floating = [t for t in self._tensors(args, kwargs) if t.is_floating_point() or t.is_complex()]
        if not floating or any(t.dtype != low for t in floating):
            return op(*args, **kwargs)

        def up(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.float() if value.dtype == low else value
            if type(value) in (list, tuple):
                return type(value)(up(v) for v in value)
            return value

        bound = self._by_name(op, args, kwargs)  # an explicit dtype= argument is the output's dtype natively
        explicit = [bound.get(name) for name in ("dtype", "out_dtype") if isinstance(bound.get(name), torch.dtype)]
        out = explicit[0] if explicit else low

        def down(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value.to(out) if value.dtype == torch.float32 else value
            if isinstance(value, (list, tuple)):
                return type(value)(down(v) for v in value)
            return value

        return down(op(*up(args), **{k: up(v) for k, v in kwargs.items()}))

    @staticmethod
    def _by_name(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        schema = op._schema.arguments
        bound = {a.name: v for a, v in zip(schema, args, strict=False)}
        bound.update(kwargs)
        bound.update((a.name, a.default_value) for a in schema if a.name not in bound and a.has_default_value())
        return bound

    @staticmethod
    def _call_by_name(op: Any, bound: dict[str, Any]) -> Any:
        positional = []
        for a in op._schema.arguments:  # positionally while there is no gap, by keyword after one
            if a.kwarg_only or a.name not in bound:
                break
            positional.append(bound.pop(a.name))
        return op(*positional, **bound)

    @staticmethod
    def _with_dtype(op: Any) -> Any:
        names = [a.name for a in op._schema.arguments]
        if "dtype" in names:
            return op
        for name in op.overloadpacket.overloads():
            sibling = getattr(op.overloadpacket, name)
            if [a.name for a in sibling._schema.arguments] == [*names, "dtype"]:
                return sibling
        return None
