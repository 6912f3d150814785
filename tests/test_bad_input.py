"""Bad input, tried systematically (issue 14): one line naming the value and the choices, and nothing changed.

``ROWS`` is the table: a public callable, what it is given (wrong types, unknown device types, dtypes,
categories, op names, policy names and compute modes, malformed policies, ops torch lacks), the exception
and the substrings its message must hold (the received value, and the choices or what is expected). Each
row runs three times (once for ``plain_only`` rows): plainly, inside an open ``mixprec.autocast`` region and
under ``mixprec.install``; after the error torch's autocast state on every device torch knows, mixprec's
thread state, installation, kernel registrations and the test's GradScalers must be as they were.
``CLI_ROWS`` does the same for the ``mixprec`` command (one line on stderr, exit code 2, no traceback).

``test_every_public_callable_has_bad_input`` fails when a public callable (or a public method of a public
class) has no row, so new API cannot be added without its bad-input cases. Bad input already covered
elsewhere (tests/test_errors.py, tests/test_cli_errors.py, tests/test_policy_serial.py) is not repeated
except where a row here also checks the state.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import inspect
import shutil
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import typer
from torch.fx.experimental.proxy_tensor import make_fx

import mixprec
import mixprec.cli
import mixprec.diagnostics
import mixprec.graph
from _cli import PLANTED
from _cli import run as run_cli
from mixprec.cli._app import app
from mixprec.diagnostics import Diagnosis, Run
from mixprec.engine import _cast, _devices, _kernels, _state
from mixprec.engine import _installation as _install
from mixprec.integrations.lightning import MixprecPrecision
from mixprec.policies import Category, Policy

CPU, CUDA = mixprec.policies.CPU, mixprec.policies.CUDA
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LINEAR_FP32 = CPU.with_ops(fp32=["linear"])
NOT_OPS = ("aten::no_such_op", "no_such_op", "mylib::nothing")  # names of ops torch lacks
CATEGORY_CHOICES = (
    "Expected one of: lower_precision_fp, fp32, fp32_set_opt_dtype, fp32_append_dtype, promote, banned, fp8"
)
DEVICE_CHOICES = "Expected one of: cpu, cuda, hpu, ipu, maia, mps, mtia, xla, xpu"
LOW_CHOICES = "Expected one of: bfloat16, float16"
OP_EXPECTED = "Expected an op name in ATen or docs spelling"

# --- what the rows are given -------------------------------------------------------------------------------

MODEL = torch.nn.Linear(4, 4)
GOOD_X, BAD_X = torch.randn(3, 4), torch.randn(3, 5)  # BAD_X: the wrong shape for MODEL
WRAPPED = mixprec.AutocastModule(torch.nn.Linear(4, 4), "cpu")


class _FailsUnderAutocast(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("planted failure under autocast")
        return x * 2


TARGET = (MODEL, (GOOD_X,), None)
FAILING_TARGET = (_FailsUnderAutocast(), (torch.randn(2, 2),), None)
RUN = Run([], 0, {})
DIAGNOSIS = Diagnosis("cpu", BF16, "CPU", False, [], 0, 0, None, None)

GM = make_fx(lambda x: torch.mm(x, x))(torch.randn(2, 2))
GM_BANNED = make_fx(lambda x, y: F.binary_cross_entropy(x, y))(torch.rand(3), torch.rand(3))
GM_NO_META = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))


def _optimizer(dtype: torch.dtype) -> torch.optim.Optimizer:
    weight = torch.nn.Parameter(torch.ones(2, dtype=dtype))
    weight.grad = torch.ones(2, dtype=dtype)
    return torch.optim.SGD([weight], lr=0.1)


OPT, HALF_OPT = _optimizer(F32), _optimizer(F16)  # HALF_OPT: float16 gradients
UNSCALED = mixprec.GradScaler("cpu")  # no scale() yet
SCALED = mixprec.GradScaler("cpu")
SCALED.scale(torch.ones(()))
SCALERS = (UNSCALED, SCALED)
STATE_DICT = SCALED.state_dict()


def _fwd(ctx: Any, x: torch.Tensor) -> torch.Tensor:
    return x


# --- policy files: written once per run ----------------------------------------------------------------------

_DIR = Path(tempfile.mkdtemp(prefix="mixprec-bad-input-"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)

#: file name -> (content, exception from Policy.from_file, substrings of its message)
POLICY_FILES: dict[str, tuple[str | bytes, type[Exception], tuple[str, ...]]] = {
    "empty": ("", ValueError, ("it is empty", "data={}", "Expected at least one of the keys name, base, ops")),
    "comments-only": ("# nothing else\n", ValueError, ("it is empty", "data={}")),
    "syntax-error": ('base = "CPU"\n[ops\n', ValueError, ("not valid TOML", "line 2", "Expected a TOML file")),
    "not-utf8": (b'name = "\xff"\n', ValueError, ("not valid TOML", "Expected a TOML file with the keys")),
    "top-level-array": ("ops = [1, 2]\n", ValueError, ("ops=[1, 2]", "Expected a table such as {fp32")),
    "ops-string": ('ops = "fp32"\n', ValueError, ("ops='fp32'", "Expected a table such as")),
    "name-int": ("name = 3\n", ValueError, ("name=3 (type builtins.int)", "Expected a string")),
    "base-unknown": ('base = "TPU"\n', ValueError, ("base='TPU'", "Expected one of: CPU, CUDA, XPU")),
    "base-int": ("base = 1\n", ValueError, ("base=1", "Expected one of: CPU, CUDA")),
    "unknown-key": ('base = "CPU"\n[opps]\nfp32 = ["mm"]\n',
        ValueError, ("key='opps'", "name, base, ops, without_ops")),
    "unknown-category": ('[ops]\nfp4 = ["mm"]\n', ValueError, ("category='fp4'", CATEGORY_CHOICES)),
    "ops-not-a-list": ("[ops]\nfp32 = 3\n", ValueError, ("ops=3", "Expected a list of strings")),
    "ops-nested-table": ("[ops.fp32]\nmm = true\n", ValueError, ("ops={'mm': True}", "Expected a list of strings")),
    "op-not-a-string": ("[ops]\nfp32 = [3]\n", ValueError, ("ops=[3]", "Expected a list of strings")),
    "without-ops-int": ("without_ops = 3\n", ValueError, ("without_ops=3", "Expected a list of strings")),
    "op-twice": ('[ops]\nfp32 = ["mm"]\npromote = ["mm"]\n', ValueError, ("op='mm'", "each op at most once")),
    "dtype-category": ('[ops]\nfp32_set_opt_dtype = ["mm"]\n', ValueError, ("op='mm'", "with a dtype argument")),
    **{
        f"op-{name}": (f'base = "CPU"\n[ops]\nfp32 = ["{name}"]\n', ValueError, (f"op='{name}'", OP_EXPECTED))
        for name in NOT_OPS
    },
    "without-no-such-op": ('base = "CPU"\nwithout_ops = ["no_such_op"]\n', ValueError, ("op='no_such_op'",)),
}


def _policy_file(name: str) -> Path:
    path = _DIR / f"{name}.toml"
    content = POLICY_FILES[name][0]
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


FILES = {name: _policy_file(name) for name in POLICY_FILES}
MISSING = _DIR / "missing.toml"
A_DIRECTORY = _DIR / "a-directory.toml"
A_DIRECTORY.mkdir()
A_FILE = _DIR / "a-file"
A_FILE.write_text("not a directory\n")
TARGETS = _DIR / "bad_targets.py"
TARGETS.write_text(
    "import torch\n\n"
    "def bad_inputs():\n"
    "    return torch.nn.Linear(4, 4), (torch.randn(3, 5),)\n\n"
    "class FailsUnderAutocast(torch.nn.Module):\n"
    "    def forward(self, x):\n"
    "        if torch.is_autocast_enabled('cpu'):\n"
    "            raise RuntimeError('planted failure\\nunder autocast')\n"
    "        return x * 2\n\n"
    "def fails_under_autocast():\n"
    "    return FailsUnderAutocast(), (torch.randn(2, 2),)\n\n"
    "def bad_loss():\n"
    "    return torch.nn.Linear(4, 4), (torch.randn(3, 4),), lambda out: out.no_such_method()\n"
)

# --- how a row's call is made ------------------------------------------------------------------------------


def call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The plain call ``target(*args, **kwargs)``."""
    return target(*args, **kwargs)


def enter(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Make the region and enter it: errors and warnings raised at region entry."""
    with target(*args, **kwargs):
        pass


def exit_unentered(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Exit a region that was never entered."""
    target(*args, **kwargs).__exit__(None, None, None)


def attribute(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``getattr(module, name)``: ``target`` is the module's ``__getattr__``."""
    return getattr(mixprec.policies, args[0])


@dataclasses.dataclass(frozen=True)
class Warmed:
    """The plain call, after ``first`` ran once (kernels a first run registers, and keeps, are no change)."""

    first: Callable[[], object]

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return target(*args, **kwargs)

    def warm(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.first()


@dataclasses.dataclass(frozen=True)
class Decorate:
    """Decorate ``func`` with the region."""

    func: object

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return target(*args, **kwargs)(self.func)


@dataclasses.dataclass(frozen=True)
class Inside:
    """Run ``body`` inside the region: errors raised in a region. ``warm`` enters it once before the state is
    taken, so that kernels a first entry registers (and keeps) do not count as a change."""

    body: Callable[[], object]

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with target(*args, **kwargs):
            self.body()

    def warm(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with target(*args, **kwargs):
            pass


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """Call the module given a policy by ``set_module_policy(*args)`` with ``inputs``, inside ``regions``."""

    regions: tuple[Callable[[], contextlib.AbstractContextManager[Any]], ...]
    inputs: tuple[Any, ...]

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with target(*args, **kwargs), contextlib.ExitStack() as stack:
            for region in self.regions:
                stack.enter_context(region())
            args[0](*self.inputs)

    def warm(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with target(*args, **kwargs), mixprec.autocast("cpu"):
            args[0](GOOD_X)


@dataclasses.dataclass(frozen=True)
class CustomFunction:
    """Run a custom autograd Function whose forward is decorated by ``target(*args, **kwargs)`` and raises."""

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        forward = target(*args, **kwargs)(lambda ctx, x: torch.mm(x, x))

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return forward(ctx, x)  # type: ignore[no-any-return]

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad

        with mixprec.autocast("cpu"):
            Function.apply(torch.randn(2, 3, requires_grad=True))

    def warm(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with mixprec.autocast("cpu"):
            pass


def row(name: str, target: Any, *args: Any, raises: type[BaseException], names: tuple[str, ...] | str,
        how: Callable[..., Any] = call, plain_only: bool = False, **kwargs: Any) -> Any:
    """One row: ``how(target, args, kwargs)`` raises ``raises`` (a Warning: warns it) whose message holds ``names``.

    ``plain_only``: the row runs only outside any region (its call would act on the region around it).
    """
    names = (names,) if isinstance(names, str) else names
    return pytest.param(target, args, kwargs, raises, names, how, plain_only, id=_id(name))


def _id(name: str) -> str:
    return name.replace("::", "--")  # "::" separates the parts of a pytest node id


def missing_arguments(name: str, target: Any, *missing: str) -> Any:
    """A record or handle that mixprec makes and returns: built by hand without its fields. Its constructor
    is a dataclass's (or takes mixprec's own object), so the bad input it can refuse is a missing argument."""
    return row(name, target, raises=TypeError, names=tuple(f"'{m}'" for m in missing))


def bce() -> Any:
    return F.binary_cross_entropy(torch.rand(3), torch.rand(3))


def mm_mismatch() -> Any:
    return torch.mm(torch.randn(2, 3), torch.randn(2, 3))


def promote_mismatch() -> Any:
    return torch.add(torch.ones(2, dtype=BF16), torch.ones(2, dtype=F16))


# --- the table -------------------------------------------------------------------------------------------

LAYERS = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))  # for choose_fp8_layers' rows

AUTOCAST_ROWS = [
    row("autocast-device-unknown", mixprec.autocast, "tpu", raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("autocast-device-index", mixprec.autocast, "cpu:0", raises=ValueError,
        names=("device_type='cpu:0'", "rather than 'cuda:0'")),
    row("autocast-device-int", mixprec.autocast, 0, raises=TypeError,
        names=("device_type=0 (type builtins.int)", DEVICE_CHOICES)),
    row("autocast-device-empty", mixprec.autocast, "", raises=ValueError, names=("device_type=''", DEVICE_CHOICES)),
    row("autocast-dtype-name", mixprec.autocast, "cpu", dtype="float16", raises=TypeError,
        names=("dtype='float16' (type builtins.str)", "Expected a torch.dtype")),
    row("autocast-dtype-python-float", mixprec.autocast, "cpu", dtype=float, raises=TypeError,
        names=("dtype=<class 'float'>", "Expected a torch.dtype")),
    row("autocast-enabled-none", mixprec.autocast, "cpu", enabled=None, raises=TypeError,
        names=("enabled=None", "Expected a bool")),
    row("autocast-cache-enabled-int", mixprec.autocast, "cpu", cache_enabled=0, raises=TypeError,
        names=("cache_enabled=0", "Expected a bool")),
    row("autocast-policy-name", mixprec.autocast, "cpu", policy="CPU", raises=TypeError,
        names=("policy='CPU'", "Policy")),
    row("autocast-policy-dict", mixprec.autocast, "cpu", policy={"fp32": ["mm"]}, raises=TypeError,
        names=("policy={'fp32': ['mm']}", "Policy")),
    row("autocast-compute-unknown", mixprec.autocast, "cpu", compute="fast", raises=ValueError,
        names=("compute='fast'", "Expected one of: auto, native, emulated")),
    row("autocast-compute-case", mixprec.autocast, "cpu", compute="Native", raises=ValueError,
        names=("compute='Native'", "Expected one of: auto, native, emulated")),
    row("autocast-compute-none", mixprec.autocast, "cpu", compute=None, raises=TypeError,
        names=("compute=None", "Expected one of: auto, native, emulated")),
    row("autocast-compute-bool", mixprec.autocast, "cpu", compute=True, raises=TypeError,
        names=("compute=True", "Expected one of: auto, native, emulated")),
    # Unsupported dtypes warn and disable the region, as torch.autocast does (tests/test_errors.py).
    row("autocast-dtype-int32-enter", mixprec.autocast, "cpu", dtype=torch.int32, how=enter,
        raises=mixprec.AutocastDisabledWarning, names=("dtype=torch.int32", LOW_CHOICES)),
    row("autocast-dtype-float64-enter", mixprec.autocast, "cpu", dtype=torch.float64, how=enter,
        raises=mixprec.AutocastDisabledWarning, names=("dtype=torch.float64", LOW_CHOICES)),
    row("autocast-dtype-complex-enter", mixprec.autocast, "xla", dtype=torch.complex64, how=enter,
        raises=mixprec.AutocastDisabledWarning, names=("dtype=torch.complex64", "Expected one of: float16, bfloat16")),
    # Errors at region entry: xla has no Autocast key Python can reach, so only its native autocast runs.
    row("autocast-enter-policy-without-key", mixprec.autocast, "xla", policy=LINEAR_FP32, how=enter,
        raises=RuntimeError, names=("device_type='xla'", "policy='CPU'", "compute='native'")),
    row("autocast-enter-emulated-without-key", mixprec.autocast, "xla", compute="emulated", how=enter,
        raises=RuntimeError, names=("device_type='xla'", "compute='native'")),
    # Errors inside a region.
    row("autocast-inside-banned-op", mixprec.autocast, "cpu", policy=CUDA, how=Inside(bce), raises=RuntimeError,
        names=("binary_cross_entropy_with_logits", "with_ops(fp32=['binary_cross_entropy'])")),
    row("autocast-inside-promote-mix", mixprec.autocast, "cpu", dtype=BF16, policy=CPU.with_ops(promote=["add"]),
        how=Inside(promote_mismatch), raises=RuntimeError,
        names=("dtype=torch.float16", "Expected one of: float32, bfloat16")),
    row("autocast-inside-shape-error", mixprec.autocast, "cpu", how=Inside(mm_mismatch), raises=RuntimeError,
        names="(2x3 and 2x3)"),
    row("autocast-inside-emulated-shape-error", mixprec.autocast, "cpu", compute="emulated",
        how=Inside(mm_mismatch), raises=RuntimeError, names="(2x3 and 2x3)"),
    row("autocast-decorate-non-callable", mixprec.autocast, "cpu", how=Decorate(3), raises=TypeError,
        names=("func=3", "Expected a callable")),
    row("autocast-exit-unentered", mixprec.autocast, "cpu", how=exit_unentered, plain_only=True,
        raises=RuntimeError, names=("region=autocast(device_type='cpu'", "Use the region in a with statement")),
    row("cpu-amp-dtype-name", mixprec.cpu.amp.autocast, dtype="bfloat16", raises=TypeError,
        names=("dtype='bfloat16'", "Expected a torch.dtype")),
    row("cpu-amp-enabled-str", mixprec.cpu.amp.autocast, "yes", raises=TypeError, names=("enabled='yes'", "bool")),
    row("cpu-amp-cache-enabled-str", mixprec.cpu.amp.autocast, cache_enabled="off", raises=TypeError,
        names=("cache_enabled='off'", "bool")),
    row("cpu-amp-dtype-float32-enter", mixprec.cpu.amp.autocast, dtype=F32, how=enter,
        raises=mixprec.AutocastDisabledWarning, names=("dtype=torch.float32", LOW_CHOICES)),
    row("cuda-amp-dtype-name", mixprec.cuda.amp.autocast, dtype="float16", raises=TypeError,
        names=("dtype='float16'", "Expected a torch.dtype")),
    row("cuda-amp-enabled-int", mixprec.cuda.amp.autocast, 1, raises=TypeError, names=("enabled=1", "bool")),
    row("xpu-amp-dtype-int", mixprec.xpu.amp.autocast, dtype=16, raises=TypeError,
        names=("dtype=16", "Expected a torch.dtype")),
    row("xpu-amp-cache-enabled-str", mixprec.xpu.amp.autocast, cache_enabled="no", raises=TypeError,
        names=("cache_enabled='no'", "bool")),
]

QUERY_ROWS = [
    row("is-autocast-enabled-unknown", mixprec.is_autocast_enabled, "gpu", raises=ValueError,
        names=("device_type='gpu'", DEVICE_CHOICES)),
    row("is-autocast-enabled-list", mixprec.is_autocast_enabled, ["cpu"], raises=TypeError,
        names=("device_type=['cpu']", DEVICE_CHOICES)),
    row("get-autocast-dtype-unknown", mixprec.get_autocast_dtype, "CPU", raises=ValueError,
        names=("device_type='CPU'", DEVICE_CHOICES)),
    row("get-autocast-dtype-none", mixprec.get_autocast_dtype, None, raises=TypeError,
        names=("device_type=None", DEVICE_CHOICES)),
    row("get-policy-unknown", mixprec.get_policy, "tpu", raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("get-policy-list", mixprec.get_policy, ["cpu"], raises=TypeError,
        names=("device_type=['cpu']", DEVICE_CHOICES)),
    row("kernel-support-device-unknown", mixprec.kernel_support, "tpu", BF16, raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("kernel-support-device-int", mixprec.kernel_support, 3, BF16, raises=TypeError,
        names=("device_type=3", DEVICE_CHOICES)),
    row("kernel-support-dtype-name", mixprec.kernel_support, "cpu", "bfloat16", raises=TypeError,
        names=("dtype='bfloat16'", LOW_CHOICES)),
    row("kernel-support-dtype-int32", mixprec.kernel_support, "cpu", torch.int32, raises=ValueError,
        names=("dtype=torch.int32", LOW_CHOICES)),
    row("kernel-support-dtype-float32", mixprec.kernel_support, "cuda", F32, raises=ValueError,
        names=("dtype=torch.float32", "Expected one of: float16, bfloat16")),
    missing_arguments("kernel-support-record", mixprec.KernelSupport, "device_type", "dtype", "native", "evidence"),
    row("explain-device-unknown", mixprec.explain, "mm", "tpu", raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("explain-policy-name", mixprec.explain, "mm", "cpu", "CUDA", raises=TypeError,
        names=("policy='CUDA'", "Policy")),
    row("explain-dtype-name", mixprec.explain, "mm", dtype="bf16", raises=TypeError,
        names=("dtype='bf16'", "Expected a torch.dtype")),
    row("explain-dtype-int32", mixprec.explain, "mm", dtype=torch.int32, raises=ValueError,
        names=("dtype=torch.int32", LOW_CHOICES)),
    row("explain-input-dtypes-empty", mixprec.explain, "mm", input_dtypes=(), raises=TypeError,
        names=("input_dtypes=()", "Expected a non-empty tuple of torch.dtype")),
    row("explain-input-dtypes-names", mixprec.explain, "mm", input_dtypes=("float32",), raises=TypeError,
        names=("input_dtypes=('float32',)", "Expected a non-empty tuple of torch.dtype")),
    row("explain-op-int", mixprec.explain, 3, raises=TypeError, names=("op=3", OP_EXPECTED)),
    row("explain-op-lambda", mixprec.explain, lambda x: x, raises=ValueError,
        names=("not a torch op or op name", OP_EXPECTED)),
    row("explain-op-typo", mixprec.explain, "sofmax", raises=ValueError,
        names=("op='sofmax'", OP_EXPECTED, "Did you mean one of: softmax")),
    *(row(f"explain-op-{name}", mixprec.explain, name, raises=ValueError, names=(f"op='{name}'", OP_EXPECTED))
      for name in NOT_OPS),
    missing_arguments("explanation-record", mixprec.Explanation, "op", "entry", "category"),
    row("explain-model-no-example", mixprec.explain, LAYERS, "cpu", raises=ValueError,
        names=("a model needs example=", "example=None")),
]

FP8_LAYER_ROWS = [
    row("choose-fp8-layers-no-fp8-ops", mixprec.choose_fp8_layers, LAYERS, mixprec.policies.CUDA, raises=ValueError,
        names=("Policy 'CUDA' runs no op in fp8", "mixprec.policies.FP8")),
    row("choose-fp8-layers-policy-name", mixprec.choose_fp8_layers, LAYERS, "FP8", raises=TypeError,
        names=("policy='FP8'", "Policy")),
    row("choose-fp8-layers-keep-int", mixprec.choose_fp8_layers, LAYERS, keep=[3], raises=TypeError,
        names=("keep=[3]", "module paths or fnmatch patterns")),
    row("choose-fp8-layers-keep-typo", mixprec.choose_fp8_layers, LAYERS, keep="O", raises=ValueError,
        names=("keep pattern 'O' matches no module", "keep='O'")),
    row("choose-fp8-layers-min-features", mixprec.choose_fp8_layers, LAYERS, min_features=-1, raises=ValueError,
        names=("min_features=-1", "an int >= 0")),
    row("choose-fp8-layers-flag", mixprec.choose_fp8_layers, LAYERS, keep_first_and_last=1, raises=TypeError,
        names=("keep_first_and_last=1", "True or False")),
    row("choose-fp8-layers-not-a-module", mixprec.choose_fp8_layers, LAYERS.forward, raises=TypeError,
        names=("module has the wrong type", "torch.nn.Module")),
    missing_arguments("fp8-layers-handle", mixprec.Fp8Layers, "policy", "fallback", "choices", "_handles"),
    missing_arguments("layer-choice-record", mixprec.LayerChoice, "path", "kind", "in_features"),
    missing_arguments("call-site-record", mixprec.CallSite, "module", "op", "shape"),
    missing_arguments("call-sites-record", mixprec.CallSites, "sites"),
    row("amax-history-model", mixprec.AmaxHistory, "net", raises=TypeError,
        names=("AmaxHistory: model has the wrong type", "model='net'", "torch.nn.Module")),
    row("amax-history-group-type", mixprec.AmaxHistory, LAYERS, process_group=1, raises=TypeError,
        names=("process_group=1", "a torch.distributed.ProcessGroup, 'default' or None")),
    row("amax-history-group-uninitialised", mixprec.AmaxHistory, LAYERS, "default", raises=RuntimeError,
        names=("no process group is initialised", "init_process_group")),
    row("amax-history-load-not-a-dict", mixprec.AmaxHistory.load_state_dict, mixprec.AmaxHistory(LAYERS), [],
        raises=TypeError, names=("state is invalid", "state=[]", "a dict of tensors")),
    row("amax-history-load-unknown-name", mixprec.AmaxHistory.load_state_dict, mixprec.AmaxHistory(LAYERS),
        {"w.amax_history": torch.zeros(3, 2)}, raises=ValueError,
        names=("no history for 'w' can be loaded", "Expected one of: 0.bias, 0.weight")),
    row("amax-history-load-missing-part", mixprec.AmaxHistory.load_state_dict, mixprec.AmaxHistory(LAYERS),
        {"0.weight.amax_history": torch.zeros(3, 2)}, raises=ValueError,
        names=("no history for '0.weight' can be loaded", "0.weight.amax_pending")),
    row("amax-history-load-bad-shape", mixprec.AmaxHistory.load_state_dict, mixprec.AmaxHistory(LAYERS),
        {"0.weight.amax_history": torch.zeros(2), "0.weight.amax_pending": torch.zeros(3),
         "0.weight.amax_steps": torch.tensor(1)}, raises=ValueError, names=("wrong shape", "(3, steps)")),
]

INSTALL_ROWS = [
    row("install-policy-name", mixprec.install, "CPU", raises=TypeError, names=("policy='CPU'", "Policy")),
    row("install-policy-dict", mixprec.install, {"fp32": ["linear"]}, raises=TypeError,
        names=("policy={'fp32': ['linear']}", "Policy")),
    row("install-compute-unknown", mixprec.install, compute="emulate", raises=ValueError,
        names=("compute='emulate'", "Expected one of: auto, native, emulated")),
    row("install-compute-int", mixprec.install, LINEAR_FP32, compute=0, raises=TypeError,
        names=("compute=0", "Expected one of: auto, native, emulated")),
    missing_arguments("install-handle", mixprec.InstallHandle, "installation"),
]

MODULE_ROWS = [
    row("set-module-policy-unknown-name", mixprec.set_module_policy, MODEL, "fp16", raises=ValueError,
        names=("policy='fp16'", "or 'fp32'")),
    row("set-module-policy-none", mixprec.set_module_policy, MODEL, None, raises=TypeError,
        names=("policy=None", "or 'fp32'")),
    row("set-module-policy-upper-case", mixprec.set_module_policy, MODEL, "FP32", raises=ValueError,
        names=("policy='FP32'", "or 'fp32'")),
    row("set-module-policy-module-int", mixprec.set_module_policy, 3, "fp32", raises=TypeError,
        names=("module=3", "Expected a torch.nn.Module")),
    row("set-module-policy-module-function", mixprec.set_module_policy, F.linear, LINEAR_FP32, raises=TypeError,
        names=("module=<built-in function linear>", "Expected a torch.nn.Module")),
    row("set-module-policy-forward-error", mixprec.set_module_policy, MODEL, LINEAR_FP32,
        how=ModuleCall((lambda: mixprec.autocast("cpu"),), (BAD_X,)), raises=RuntimeError, names="(3x5 and 4x4)"),
    row("set-module-policy-fp32-forward-error", mixprec.set_module_policy, MODEL, "fp32",
        how=ModuleCall((lambda: mixprec.autocast("cpu"),), (BAD_X,)), raises=RuntimeError, names="(3x5 and 4x4)"),
    # The pre-hook enters cpu, then fails on xla: the cpu level it opened must be closed again.
    row("set-module-policy-pre-hook-error", mixprec.set_module_policy, MODEL, LINEAR_FP32,
        how=ModuleCall((lambda: mixprec.autocast("cpu"), lambda: torch.autocast("xla")), (GOOD_X,)),
        raises=RuntimeError, names=("device_type='xla'", "compute='native'")),
    missing_arguments("module-policy-handle", mixprec.ModulePolicyHandle, "policy", "_forward", "_token"),
    row("autocast-module-module-int", mixprec.AutocastModule, 3, "cpu", raises=TypeError,
        names=("module=3", "Expected a torch.nn.Module")),
    row("autocast-module-device-unknown", mixprec.AutocastModule, MODEL, "tpu", raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("autocast-module-dtype-name", mixprec.AutocastModule, MODEL, "cpu", "bf16", raises=TypeError,
        names=("dtype='bf16'", "Expected a torch.dtype")),
    row("autocast-module-policy-name", mixprec.AutocastModule, MODEL, "cpu", policy="CPU", raises=TypeError,
        names=("policy='CPU'", "Policy")),
    row("autocast-module-forward-error", mixprec.AutocastModule.forward, WRAPPED, BAD_X,
        how=Warmed(lambda: WRAPPED(GOOD_X)), raises=RuntimeError, names="(3x5 and 4x4)"),
]

CUSTOM_ROWS = [
    row("custom-fwd-device-unknown", mixprec.custom_fwd, _fwd, device_type="tpu", raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("custom-fwd-device-missing", mixprec.custom_fwd, _fwd, raises=TypeError, names="'device_type'"),
    row("custom-fwd-not-callable", mixprec.custom_fwd, 3, device_type="cpu", raises=TypeError,
        names=("fwd=3", "Expected a callable")),
    row("custom-fwd-cast-inputs-name", mixprec.custom_fwd, _fwd, device_type="cpu", cast_inputs="float32",
        raises=TypeError, names=("cast_inputs='float32'", "Expected a torch.dtype or None")),
    row("custom-fwd-cast-inputs-name-decorator", mixprec.custom_fwd, device_type="cpu", cast_inputs=float,
        raises=TypeError, names=("cast_inputs=<class 'float'>", "Expected a torch.dtype or None")),
    row("custom-fwd-forward-error", mixprec.custom_fwd, device_type="cpu", cast_inputs=F32, how=CustomFunction(),
        raises=RuntimeError, names="(2x3 and 2x3)"),
    row("custom-bwd-device-unknown", mixprec.custom_bwd, _fwd, device_type="gpu", raises=ValueError,
        names=("device_type='gpu'", DEVICE_CHOICES)),
    row("custom-bwd-not-callable", mixprec.custom_bwd, "backward", device_type="cpu", raises=TypeError,
        names=("bwd='backward'", "Expected a callable")),
    row("cuda-amp-custom-fwd-cast-inputs", mixprec.cuda.amp.custom_fwd, _fwd, cast_inputs="half", raises=TypeError,
        names=("cast_inputs='half'", "Expected a torch.dtype or None")),
    row("cuda-amp-custom-bwd-not-callable", mixprec.cuda.amp.custom_bwd, None, raises=TypeError,
        names=("bwd=None", "Expected a callable")),
]

CATEGORY_ROWS = [
    row("category-unknown", Category, "fp4", raises=ValueError, names=("category='fp4'", CATEGORY_CHOICES)),
    row("category-upper-case", Category, "FP32", raises=ValueError, names=("category='FP32'", CATEGORY_CHOICES)),
    row("category-int", Category, 3, raises=TypeError, names=("category=3 (type builtins.int)", CATEGORY_CHOICES)),
    row("category-list", Category, ["fp32"], raises=TypeError, names=("category=['fp32']", CATEGORY_CHOICES)),
]

POLICY_ROWS = [
    row("policy-name-int", Policy, 3, {}, raises=TypeError, names=("name=3", "Expected a str")),
    row("policy-table-list", Policy, "p", [("mm", Category.FP32)], raises=TypeError,
        names=("table=[('mm', <Category.FP32: 'fp32'>)]", "Expected a mapping", "Policy.from_lists")),
    row("policy-table-category-name", Policy, "p", {"mm": "fp32"}, raises=TypeError,
        names=("category='fp32'", "Category.FP32", "Policy.from_lists")),
    row("policy-table-category-unknown", Policy, "p", {"mm": "fp8"}, raises=TypeError,
        names=("category='fp8'", "Category.LOWER_PRECISION_FP")),
    row("policy-table-op-int", Policy, "p", {3: Category.FP32}, raises=TypeError, names=("op=3", "Category.FP32")),
    row("policy-base-unknown", Policy, "p", {}, "TPU", raises=ValueError,
        names=("base='TPU'", "Expected one of: CPU, CUDA, XPU, CPU_DOCUMENTED, CUDA_DOCUMENTED")),
    row("policy-base-lower-case", Policy, "p", {}, "cpu", raises=ValueError, names=("base='cpu'", "CPU, CUDA")),
    row("policy-base-int", Policy, "p", {}, 1, raises=TypeError, names=("base=1", "CPU, CUDA")),
    row("from-lists-not-a-mapping", Policy.from_lists, "p", ["mm"], raises=TypeError,
        names=("lists=['mm']", "Expected a mapping")),
    row("from-lists-unknown-category", Policy.from_lists, "p", {"fp4": ["mm"]}, raises=ValueError,
        names=("category='fp4'", CATEGORY_CHOICES)),
    row("from-lists-op-int", Policy.from_lists, "p", {"fp32": [3]}, raises=ValueError,
        names=("fp32=[3]", "Expected a list of strings")),
    row("from-lists-ops-int", Policy.from_lists, "p", {"fp32": 3}, raises=ValueError,
        names=("fp32=3", "Expected a list of strings")),
    row("from-lists-name-none", Policy.from_lists, None, {}, raises=TypeError, names=("name=None", "Expected a str")),
    row("from-lists-base-unknown", Policy.from_lists, "p", {}, "GPU", raises=ValueError,
        names=("base='GPU'", "CPU, CUDA")),
    row("with-ops-unknown-category", Policy.with_ops, CPU, fp4=["mm"], raises=ValueError,
        names=("category='fp4'", CATEGORY_CHOICES)),
    row("with-ops-category-case", Policy.with_ops, CPU, FP32=["mm"], raises=ValueError,
        names=("category='FP32'", CATEGORY_CHOICES)),
    row("with-ops-none", Policy.with_ops, CPU, fp32=None, raises=TypeError, names=("ops=None", OP_EXPECTED)),
    row("with-ops-fp8-not-a-gemm", Policy.with_ops, CPU, fp8=["conv2d"], raises=ValueError,
        names=("op='conv2d'", "Expected one of: linear, mm, addmm, matmul")),
    row("with-fp8-recipe-not-a-recipe", Policy.with_fp8_recipe, CPU, "rowwise", raises=TypeError,
        names=("recipe='rowwise'", "Expected a mixprec.policies.Fp8Recipe")),
    row("with-fp8-recipe-unknown-field", Policy.with_fp8_recipe, CPU, granularity="row", raises=TypeError,
        names=("field='granularity'", "Expected one of: scaling, power_of_2")),
    row("with-fp8-recipe-bad-scaling", Policy.with_fp8_recipe, CPU, scaling="blockwise", raises=ValueError,
        names=("scaling='blockwise'", "Expected one of: tensorwise, rowwise, delayed")),
    row("fp8-recipe-bad-history", mixprec.policies.Fp8Recipe, history=0, raises=ValueError,
        names=("history=0", "Expected an int of at least 1")),
    row("fp8-recipe-bad-format", mixprec.policies.Fp8Recipe, forward="bfloat16", raises=ValueError,
        names=("forward='bfloat16'", "Expected one of: float8_e4m3fn, float8_e5m2")),
    row("fp8-recipe-eps-string", mixprec.policies.Fp8Recipe, eps="1e-12", raises=ValueError,
        names=("eps='1e-12'", "Expected a positive finite float")),
    row("with-ops-dict", Policy.with_ops, CPU, fp32={"mm": 1}, raises=TypeError, names=("ops={'mm': 1}", OP_EXPECTED)),
    row("with-ops-op-float", Policy.with_ops, CPU, fp32=[1.5], raises=TypeError, names=("op=1.5", OP_EXPECTED)),
    row("with-ops-op-empty", Policy.with_ops, CPU, fp32=[""], raises=ValueError, names=("op=''", OP_EXPECTED)),
    row("with-ops-op-dotted-namespace", Policy.with_ops, CPU, fp32=["::"], raises=ValueError,
        names=("op='::'", OP_EXPECTED)),
    row("with-ops-overload-unknown", Policy.with_ops, CPU, fp32=["aten::mm.no_such_overload"], raises=ValueError,
        names=("op='aten::mm.no_such_overload'", OP_EXPECTED)),
    row("with-ops-not-a-torch-function", Policy.with_ops, CPU, fp32=[print], raises=ValueError,
        names=("op=<built-in function print>", OP_EXPECTED)),
    *(row(f"with-ops-{name}", Policy.with_ops, CPU, fp32=[name], raises=ValueError,
          names=(f"op='{name}'", OP_EXPECTED)) for name in NOT_OPS),
    row("with-ops-twice", Policy.with_ops, CPU, fp32=["mm"], promote=[torch.mm], raises=ValueError,
        names=("op='mm'", "each op at most once")),
    row("with-ops-dtype-category", Policy.with_ops, CPU, fp32_append_dtype=["mm"], raises=ValueError,
        names=("op='mm'", "Expected an op with a dtype argument")),
    row("without-ops-none", Policy.without_ops, CPU, None, raises=TypeError, names=("ops=None", OP_EXPECTED)),
    row("without-ops-int", Policy.without_ops, CPU, [3], raises=TypeError, names=("op=3", OP_EXPECTED)),
    row("without-ops-overload-alone", Policy.without_ops, CPU, "aten::mm.default", raises=ValueError,
        names=("op='aten::mm.default'", "Expected the op itself, 'mm'")),
    *(row(f"without-ops-{name}", Policy.without_ops, CPU, [name], raises=ValueError,
          names=(f"op='{name}'", OP_EXPECTED)) for name in NOT_OPS),
    row("diff-name", Policy.diff, CPU, "CUDA", raises=TypeError, names=("other='CUDA'", "Expected a mixprec.Policy")),
    row("diff-table", Policy.diff, CPU, dict(CUDA.table), raises=TypeError, names=("other={", "a mixprec.Policy")),
    row("category-op-int", Policy.category, CPU, 3, raises=TypeError, names=("op=3", OP_EXPECTED)),
    row("category-op-list", Policy.category, CPU, ["mm"], raises=TypeError, names=("op=['mm']", OP_EXPECTED)),
    row("category-op-typo", Policy.category, CPU, "sofmax", raises=ValueError,
        names=("op='sofmax'", "Did you mean one of: softmax")),
    row("category-op-lambda", Policy.category, CPU, lambda x: x, raises=ValueError,
        names=("not a torch op or op name", OP_EXPECTED)),
    *(row(f"category-{name}", Policy.category, CPU, name, raises=ValueError, names=(f"op='{name}'", OP_EXPECTED))
      for name in NOT_OPS),
    row("target-op-int", Policy.target, CPU, 3, raises=TypeError, names=("op=3", OP_EXPECTED)),
    row("target-op-typo", Policy.target, CPU, "sofmax", raises=ValueError,
        names=("op='sofmax'", "Did you mean one of: softmax")),
    row("ops-unknown-category", Policy.ops, CPU, "half", raises=ValueError,
        names=("category='half'", CATEGORY_CHOICES)),
    row("ops-category-none", Policy.ops, CPU, None, raises=TypeError, names=("category=None", CATEGORY_CHOICES)),
    row("advice-op-int", Policy.advice, CUDA, 3, raises=TypeError, names=("op=3", "Expected a str")),
    row("advice-op-callable", Policy.advice, CUDA, F.binary_cross_entropy, raises=TypeError,
        names=("op=<function binary_cross_entropy", "Expected a str")),
    row("builtin-policy-unknown", mixprec.policies.__getattr__, "GPU", how=attribute, raises=AttributeError,
        names=("name='GPU'", "Expected one of: CPU, CUDA, XPU, CPU_DOCUMENTED, CUDA_DOCUMENTED")),
    row("builtin-policy-typo", mixprec.policies.__getattr__, "CUDA_DOCUMENTD", how=attribute, raises=AttributeError,
        names=("name='CUDA_DOCUMENTD'", "Expected one of: CPU, CUDA")),
    row("lists-unknown-policy", mixprec.policies.lists, "GPU", raises=ValueError,
        names=("No built-in policy named 'GPU'", "Expected one of: CPU, CUDA")),
    row("lists-name-not-str", mixprec.policies.lists, CPU, raises=TypeError, names=("name=", "Expected a str")),
    row("lists-unsupported-release", mixprec.policies.lists, "CPU", "2.9", raises=ValueError,
        names=("No CPU table for torch 2.9", "release='2.9'", "Expected one of: 2.10")),
    row("lists-release-float", mixprec.policies.lists, "CPU", 2.15, raises=TypeError,
        names=("release=2.15", "Expected a str")),
    row("describes-a-name", mixprec.policies.describes, "CPU", raises=TypeError,
        names=("policy='CPU'", "Expected a mixprec.policies._policy.Policy")),
]

_DICTS: list[tuple[str, object, type[Exception], tuple[str, ...]]] = [
    ("none", None, TypeError, ("data=None", "Expected a dict with keys: name, base, ops, without_ops")),
    ("list", ["mm"], TypeError, ("data=['mm']", "Expected a dict with keys")),
    ("empty", {}, ValueError, ("it is empty", "Expected at least one of the keys name, base, ops")),
    ("unknown-key", {"bsae": "CPU"}, ValueError, ("key='bsae'", "name, base, ops, without_ops")),
    ("base-unknown", {"base": "TPU"}, ValueError, ("base='TPU'", "CPU, CUDA")),
    ("base-list", {"base": ["CPU"]}, ValueError, ("base=['CPU']", "CPU, CUDA")),
    ("name-int", {"name": 3}, ValueError, ("name=3", "Expected a string")),
    ("ops-list", {"ops": ["mm"]}, ValueError, ("ops=['mm']", "Expected a table such as")),
    ("ops-unknown-category", {"ops": {"fp4": ["mm"]}}, ValueError, ("category='fp4'", CATEGORY_CHOICES)),
    ("ops-category-int", {"ops": {3: ["mm"]}}, TypeError, ("category=3", CATEGORY_CHOICES)),
    ("ops-not-a-list", {"ops": {"fp32": 3}}, ValueError, ("ops=3", "Expected a list of strings")),
    ("ops-callable", {"ops": {"fp32": [torch.mm]}}, ValueError, ("ops=[<built-in method mm", "a list of strings")),
    ("without-ops-dict", {"without_ops": {"mm": True}}, ValueError, ("without_ops={'mm': True}", "a list of strings")),
    ("op-twice", {"ops": {"fp32": ["mm"]}, "without_ops": ["mm"]}, ValueError, ("op='mm'", "at most once")),
    *((f"op-{name}", {"ops": {"fp32": [name]}}, ValueError, (f"op='{name}'", OP_EXPECTED)) for name in NOT_OPS),
    *((f"without-{name}", {"base": "CPU", "without_ops": [name]}, ValueError, (f"op='{name}'", OP_EXPECTED))
      for name in NOT_OPS),
]

SERIAL_ROWS = [
    *(row(f"from-dict-{name}", Policy.from_dict, data, raises=raises, names=names)
      for name, data, raises, names in _DICTS),
    *(row(f"from-file-{name}", Policy.from_file, FILES[name], raises=raises, names=names)
      for name, (_, raises, names) in POLICY_FILES.items()),
    row("from-file-missing", Policy.from_file, str(MISSING), raises=FileNotFoundError,
        names=(f"path='{MISSING}'", "no such file or directory", "Expected a readable TOML file")),
    row("from-file-directory", Policy.from_file, A_DIRECTORY, raises=IsADirectoryError,
        names=(f"path='{A_DIRECTORY}'", "is a directory", "Expected a readable TOML file")),
    row("from-file-path-int", Policy.from_file, 3, raises=TypeError, names=("path=3", "Expected a str or os.PathLike")),
    row("from-file-path-none", Policy.from_file, None, raises=TypeError, names=("path=None", "os.PathLike")),
]

_GOOD_STATE = dict(STATE_DICT)
SCALER_ROWS = [
    row("grad-scaler-device-unknown", mixprec.GradScaler, "tpu", raises=ValueError,
        names=("GradScaler device is invalid", "device='tpu'", "Expected a device type such as")),
    row("grad-scaler-device-int", mixprec.GradScaler, 0, raises=TypeError,
        names=("device=0", "or a torch.device")),
    row("grad-scaler-init-scale-str", mixprec.GradScaler, "cpu", init_scale="65536", raises=TypeError,
        names=("init_scale='65536'", "Expected a finite float > 0")),
    row("grad-scaler-init-scale-zero", mixprec.GradScaler, "cpu", init_scale=0.0, raises=ValueError,
        names=("init_scale=0.0", "Expected a finite float > 0")),
    row("grad-scaler-init-scale-inf", mixprec.GradScaler, "cpu", init_scale=float("inf"), raises=ValueError,
        names=("init_scale=inf", "Expected a finite float > 0")),
    row("grad-scaler-growth-factor-low", mixprec.GradScaler, "cpu", growth_factor=0.5, raises=ValueError,
        names=("growth_factor=0.5", "Expected a float > 1.0")),
    row("grad-scaler-backoff-factor-str", mixprec.GradScaler, "cpu", backoff_factor="0.5", raises=TypeError,
        names=("backoff_factor='0.5'", "Expected a float in (0, 1)")),
    row("grad-scaler-growth-interval-float", mixprec.GradScaler, "cpu", growth_interval=10.0, raises=TypeError,
        names=("growth_interval=10.0", "Expected an int > 0")),
    row("grad-scaler-enabled-str", mixprec.GradScaler, "cpu", enabled="False", raises=TypeError,
        names=("enabled='False'", "Expected True or False (or 1 or 0)")),
    row("grad-scaler-hysteresis-zero", mixprec.GradScaler, "cpu", hysteresis=0, raises=ValueError,
        names=("hysteresis=0", "Expected an int >= 1")),
    row("grad-scaler-min-above-max", mixprec.GradScaler, "cpu", min_scale=4.0, max_scale=2.0, raises=ValueError,
        names=("min_scale=4.0", "min_scale <= max_scale")),
    row("grad-scaler-allow-fp16-str", mixprec.GradScaler, "cpu", allow_fp16_grads="yes", raises=TypeError,
        names=("allow_fp16_grads='yes'", "Expected True or False")),
    row("cuda-amp-grad-scaler-init-scale", mixprec.cuda.amp.GradScaler, init_scale=None, raises=TypeError,
        names=("init_scale=None", "Expected a finite float > 0")),
    row("cuda-amp-grad-scaler-growth-interval", mixprec.cuda.amp.GradScaler, growth_interval=0, raises=ValueError,
        names=("growth_interval=0", "Expected an int > 0")),
    row("scale-str", mixprec.GradScaler.scale, SCALED, "loss", raises=ValueError,
        names=("outputs='loss'", "a tensor or nested lists/tuples/dicts of tensors")),
    row("scale-nested-int", mixprec.GradScaler.scale, SCALED, [torch.ones(()), 3], raises=ValueError,
        names=("outputs=3", "a tensor or nested lists/tuples/dicts of tensors")),
    row("unscale-before-scale", mixprec.GradScaler.unscale_, UNSCALED, OPT, raises=mixprec.ScalerStateError,
        names=("unscale_() called before scale()", "Call scaler.scale(loss).backward()")),
    row("unscale-optimizer-int", mixprec.GradScaler.unscale_, SCALED, 3, raises=TypeError,
        names=("optimizer=3", "Expected a torch.optim.Optimizer")),
    row("unscale-optimizer-params", mixprec.GradScaler.unscale_, SCALED, list(MODEL.parameters()), raises=TypeError,
        names=("optimizer=[Parameter", "Expected a torch.optim.Optimizer")),
    row("unscale-float16-grads", mixprec.GradScaler.unscale_, SCALED, HALF_OPT, raises=ValueError,
        names=("grad dtype=torch.float16", "allow_fp16_grads=True")),
    row("step-optimizer-str", mixprec.GradScaler.step, SCALED, "sgd", raises=TypeError,
        names=("optimizer='sgd'", "Expected a torch.optim.Optimizer")),
    row("step-float16-grads", mixprec.GradScaler.step, SCALED, HALF_OPT, raises=ValueError,
        names=("grad dtype=torch.float16", "allow_fp16_grads=True")),
    row("step-closure", mixprec.GradScaler.step, SCALED, OPT, closure=lambda: 0.0, raises=RuntimeError,
        names=("Closure use is not currently supported", "closure=<function")),
    row("step-before-scale", mixprec.GradScaler.step, UNSCALED, OPT, raises=mixprec.ScalerStateError,
        names=("step() called before scale()", "Call scaler.scale(loss).backward()")),
    row("update-new-scale-str", mixprec.GradScaler.update, SCALED, "2.0", raises=ValueError,
        names=("new_scale='2.0'", "a float or a one-element cpu tensor")),
    row("update-new-scale-vector", mixprec.GradScaler.update, SCALED, torch.ones(2), raises=ValueError,
        names=("new_scale=tensor([1., 1.])", "a float or a one-element cpu tensor")),
    row("update-without-step", mixprec.GradScaler.update, SCALED, raises=mixprec.ScalerStateError,
        names=("no inf checks recorded", "Call scaler.scale(loss).backward()")),
    row("set-growth-factor-str", mixprec.GradScaler.set_growth_factor, UNSCALED, "2", raises=TypeError,
        names=("growth_factor='2'", "Expected a float > 1.0")),
    row("set-backoff-factor-one", mixprec.GradScaler.set_backoff_factor, UNSCALED, 1.0, raises=ValueError,
        names=("backoff_factor=1.0", "Expected a float in (0, 1)")),
    row("set-growth-interval-negative", mixprec.GradScaler.set_growth_interval, UNSCALED, -5, raises=ValueError,
        names=("growth_interval=-5", "Expected an int > 0")),
    row("load-state-dict-str", mixprec.GradScaler.load_state_dict, SCALED, "state", raises=TypeError,
        names=("state_dict='state'", "Expected a dict from GradScaler.state_dict()")),
    row("load-state-dict-empty", mixprec.GradScaler.load_state_dict, SCALED, {}, raises=RuntimeError,
        names=("state dict is empty", "Expected the keys scale, growth_factor")),
    row("load-state-dict-incomplete", mixprec.GradScaler.load_state_dict, SCALED, {"scale": 2.0}, raises=ValueError,
        names=("missing=['growth_factor', 'backoff_factor', 'growth_interval', '_growth_tracker']",
               "Expected the keys scale, growth_factor, backoff_factor, growth_interval, _growth_tracker")),
    row("load-state-dict-scale-str", mixprec.GradScaler.load_state_dict, SCALED,
        {**_GOOD_STATE, "hysteresis": 3, "scale": "x"}, raises=TypeError,
        names=("scale='x'", "a float >= 0 (0.0 and inf are states a scaler reaches)")),
    row("load-state-dict-growth-factor", mixprec.GradScaler.load_state_dict, SCALED,
        {**_GOOD_STATE, "growth_factor": 0.9}, raises=ValueError, names=("growth_factor=0.9", "a float > 1.0")),
    row("load-state-dict-tracker", mixprec.GradScaler.load_state_dict, SCALED,
        {**_GOOD_STATE, "_growth_tracker": -1}, raises=ValueError, names=("_growth_tracker=-1", "an int >= 0")),
    missing_arguments("scale-record", mixprec.ScaleRecord, "step", "scale", "skipped"),
]

GRAPH_ROWS = [
    row("apply-policy-gm-module", mixprec.graph.apply_policy, MODEL, CPU, BF16, raises=TypeError,
        names=("gm=Linear(", "torch.export.export")),
    row("apply-policy-policy-name", mixprec.graph.apply_policy, GM, "CPU", BF16, raises=TypeError,
        names=("policy='CPU'", "Policy")),
    row("apply-policy-dtype-name", mixprec.graph.apply_policy, GM, CPU, "bfloat16", raises=TypeError,
        names=("dtype='bfloat16'", "torch.dtype")),
    row("apply-policy-dtype-float32", mixprec.graph.apply_policy, GM, CPU, F32, raises=ValueError,
        names=("dtype=torch.float32", LOW_CHOICES)),
    row("apply-policy-device-unknown", mixprec.graph.apply_policy, GM, CPU, BF16, device_type="tpu",
        raises=ValueError, names=("device_type='tpu'", DEVICE_CHOICES)),
    row("apply-policy-no-meta", mixprec.graph.apply_policy, GM_NO_META, CPU, BF16, raises=ValueError,
        names=("meta['val']", "torch.export.export")),
    row("apply-policy-banned", mixprec.graph.apply_policy, GM_BANNED, CUDA, F16, raises=RuntimeError,
        names=("binary_cross_entropy_with_logits", "graph node binary_cross_entropy")),
    row("cast-nodes-int", mixprec.graph.cast_nodes, 3, raises=TypeError, names=("gm=3", "torch.fx.GraphModule")),
]

DIAGNOSTICS_ROWS = [
    row("recorder-model-int", mixprec.diagnostics.Recorder, 3, raises=TypeError,
        names=("model=3", "Expected a torch.nn.Module")),
    row("recorder-keep-outputs-str", mixprec.diagnostics.Recorder, MODEL, keep_outputs="no", raises=TypeError,
        names=("keep_outputs='no'", "Expected True or False")),
    row("compare-reference-str", mixprec.diagnostics.compare, "run", RUN, BF16, raises=TypeError,
        names=("reference='run'", "Expected a mixprec.diagnostics.Run")),
    row("compare-low-float32", mixprec.diagnostics.compare, RUN, RUN, F32, raises=ValueError,
        names=("low=torch.float32", LOW_CHOICES)),
    row("compare-low-name", mixprec.diagnostics.compare, RUN, RUN, "bf16", raises=TypeError,
        names=("low='bf16'", LOW_CHOICES)),
    row("diagnose-target-model", mixprec.diagnostics.diagnose, MODEL, "cpu", BF16, raises=TypeError,
        names=("target=Linear(", "Expected a tuple (torch.nn.Module, tuple of inputs, callable or None)")),
    row("diagnose-target-inputs", mixprec.diagnostics.diagnose, (MODEL, GOOD_X, None), "cpu", BF16,
        raises=TypeError, names=("target=(Linear(", "tuple of inputs")),
    row("diagnose-device-unknown", mixprec.diagnostics.diagnose, TARGET, "tpu", BF16, raises=ValueError,
        names=("device_type='tpu'", DEVICE_CHOICES)),
    row("diagnose-dtype-float32", mixprec.diagnostics.diagnose, TARGET, "cpu", F32, raises=ValueError,
        names=("dtype=torch.float32", LOW_CHOICES)),
    row("diagnose-policy-name", mixprec.diagnostics.diagnose, TARGET, "cpu", BF16, "CPU", raises=TypeError,
        names=("policy='CPU'", "Expected a mixprec.Policy or None")),
    row("diagnose-model-fails-under-autocast", mixprec.diagnostics.diagnose, FAILING_TARGET, "cpu", BF16,
        raises=RuntimeError, names="planted failure under autocast"),
    row("run-once-target-none", mixprec.diagnostics.run_once, None, contextlib.nullcontext(), raises=TypeError,
        names=("target=None", "tuple of inputs")),
    row("run-once-region-str", mixprec.diagnostics.run_once, TARGET, "autocast", raises=TypeError,
        names=("region='autocast'", "Expected a context manager")),
    row("run-once-record-int", mixprec.diagnostics.run_once, TARGET, contextlib.nullcontext(), 1, raises=TypeError,
        names=("record=1", "Expected True or False")),
    row("diagnosis-worst-str", Diagnosis.worst, DIAGNOSIS, "10", raises=TypeError,
        names=("count='10'", "Expected an int >= 0")),
    row("diagnosis-worst-negative", Diagnosis.worst, DIAGNOSIS, -1, raises=ValueError,
        names=("count=-1", "Expected an int >= 0")),
    row("diagnosis-to-json-int", Diagnosis.to_json, DIAGNOSIS, 3, raises=TypeError,
        names=("target=3", "Expected a str")),
    missing_arguments("diagnosis-record", Diagnosis, "device", "dtype", "policy"),
    missing_arguments("op-record", mixprec.diagnostics.OpRecord, "index", "op", "module"),
    missing_arguments("op-report", mixprec.diagnostics.OpReport, "index", "phase", "op"),
    missing_arguments("run-record", Run, "records", "nonfinite", "grads"),
    missing_arguments("suggestion-record", mixprec.diagnostics.Suggestion, "code", "module", "fixes"),
]

INTEGRATION_ROWS = [
    row("lightning-dtype-name", MixprecPrecision, "bf16-mixed", raises=TypeError,
        names=("dtype='bf16-mixed'", LOW_CHOICES)),
    row("lightning-dtype-float32", MixprecPrecision, F32, raises=ValueError,
        names=("dtype=torch.float32", LOW_CHOICES)),
    row("lightning-dtype-list", MixprecPrecision, [BF16], raises=TypeError,
        names=("dtype=[torch.bfloat16]", LOW_CHOICES)),
    row("lightning-policy-name", MixprecPrecision, policy="CPU", raises=TypeError, names=("policy='CPU'", "Policy")),
    row("lightning-compute-unknown", MixprecPrecision, compute="fp8", raises=ValueError,
        names=("compute='fp8'", "Expected one of: auto, native, emulated")),
    row("lightning-connect-model-none", MixprecPrecision.connect, MixprecPrecision(), None, [], [], raises=TypeError,
        names=("MixprecPrecision.connect argument 'model'", "model=None", "torch.nn.modules.module.Module")),
    row("lightning-device-unknown", MixprecPrecision, device="gpu", raises=ValueError,
        names=("device_type='gpu'", DEVICE_CHOICES)),
    row("lightning-scaler-for-bfloat16", MixprecPrecision, scaler=SCALED, raises=ValueError,
        names=("scaler=GradScaler(device='cpu'", "Expected None")),
    row("lightning-scaler-str", MixprecPrecision, F16, scaler="dynamic", raises=TypeError,
        names=("scaler='dynamic'", "Expected None, a mixprec.GradScaler or a torch.amp.GradScaler")),
    row("cli-main-argv-str", mixprec.cli.main, "policy show cpu", raises=TypeError,
        names=("argv='policy show cpu'", "Expected None (sys.argv) or a list of str")),
    row("cli-main-argv-ints", mixprec.cli.main, [1, 2], raises=TypeError, names=("argv=[1, 2]", "a list of str")),
]

ROWS = [
    *AUTOCAST_ROWS, *QUERY_ROWS, *FP8_LAYER_ROWS, *INSTALL_ROWS, *MODULE_ROWS, *CUSTOM_ROWS, *CATEGORY_ROWS,
    *POLICY_ROWS, *SERIAL_ROWS, *SCALER_ROWS, *GRAPH_ROWS, *DIAGNOSTICS_ROWS, *INTEGRATION_ROWS,
]  # fmt: skip

# --- the state that must not change ----------------------------------------------------------------------

#: Every device type torch keeps autocast state for (mixprec's and any other it knows).
TORCH_DEVICES = [d for d in (*_devices.DEVICES, "privateuseone") if _devices.torch_knows(d)]


def _torch_nesting() -> int:
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


def snapshot() -> dict[str, object]:
    """torch's autocast state, mixprec's thread state, installation, kernels and the test's scalers."""
    state = _state.get()
    return {
        "torch autocast (enabled, dtype)": {
            d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in TORCH_DEVICES
        },
        "torch autocast cache enabled": torch.is_autocast_cache_enabled(),
        "torch autocast nesting": _torch_nesting(),
        "torch function modes": torch._C._len_torch_function_stack(),
        "torch dispatch modes": torch._C._len_torch_dispatch_stack(),
        "mixprec active settings": dict(state.active),
        "mixprec frames": list(state.frames),
        "mixprec module policies": list(state.module_policies),
        "mixprec cast cache": [(id(w), dtype) for w, dtype, _, _ in _cast.thread_cache().entries()],
        "mixprec installation": _install.current,
        "mixprec kernels": {d: _kernels.registered(d) for d in _devices.DEVICES},
        "scalers (optimizers, state_dict)": [(list(s._per_optimizer_states), s.state_dict()) for s in SCALERS],
    }


def assert_unchanged(before: dict[str, object], after: dict[str, object]) -> None:
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    assert not changed, f"state changed by the error (before, after): {changed}"


def assert_one_line(text: str, names: tuple[str, ...]) -> None:
    assert text and "\n" not in text, f"not one line: {text!r}"
    missing = [name for name in names if name not in text]
    assert not missing, f"{missing} not in: {text}"


CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "plain": contextlib.nullcontext,
    "in-region": lambda: mixprec.autocast("cpu", dtype=F16, cache_enabled=False),
    "installed": lambda: mixprec.install(LINEAR_FP32, compute="native"),
}


def _with_contexts(rows: list[Any]) -> list[Any]:
    out = []
    for param in rows:
        *values, plain_only = param.values
        for context in ["plain"] if plain_only else CONTEXTS:
            out.append(pytest.param(*values, context, id=f"{param.id}-{context}"))
    return out


@pytest.mark.parametrize(("target", "args", "kwargs", "raises", "names", "how", "context"), _with_contexts(ROWS))
def test_bad_input_gives_one_line_and_changes_nothing(target, args, kwargs, raises, names, how, context):
    with CONTEXTS[context]():
        warm = getattr(how, "warm", None)
        if warm is not None:
            warm(target, args, kwargs)
        before = snapshot()
        if issubclass(raises, Warning):
            with pytest.warns(raises) as record:
                how(target, args, kwargs)
            text = str(record[0].message)
        else:
            with pytest.raises(raises) as info:
                how(target, args, kwargs)
            assert type(info.value) is raises, f"{type(info.value).__name__} instead of {raises.__name__}"
            text = str(info.value)
        after = snapshot()
    assert_one_line(text, names)
    assert_unchanged(before, after)


def test_a_table_built_directly_may_name_ops_torch_lacks():
    """Policy(...) keeps names this torch lacks (the documented lists hold some, e.g. symeig): no error, and a
    region under such a policy runs and leaves nothing changed. with_ops / from_dict / from_file refuse them."""
    policy = Policy("old", {**dict.fromkeys(NOT_OPS, Category.FP32), "mm": Category.FP32})
    a = torch.randn(2, 2)
    with mixprec.autocast("cpu", policy=policy):  # first entry: registers the kernels the policy needs
        pass
    before = snapshot()
    with mixprec.autocast("cpu", policy=policy):
        assert torch.mm(a, a).dtype is F32
    assert policy.category("mylib::nothing") == "fp32"
    assert_unchanged(before, snapshot())


# --- the command line ------------------------------------------------------------------------------------


def cli(name: str, *argv: object, names: tuple[str, ...] | str) -> Any:
    return pytest.param([str(a) for a in argv], (names,) if isinstance(names, str) else names, id=_id(name))


_FILE_CLI = [
    cli(f"policy-show-{name}", "policy", "show", FILES[name],
        names=(f"policy file '{FILES[name]}' is not a policy", *names))
    for name, (_, _raises, names) in POLICY_FILES.items()
]

CLI_ROWS = [
    cli("no-command", names="missing command; expected one of: demo, doctor, policy"),
    cli("unknown-option", "--bogus", names="No such option: --bogus"),
    cli("demo-steps-not-int", "demo", "--steps", "many", names=("'--steps'", "valid integer", "'many'")),
    cli("demo-steps-negative", "demo", "--steps", "-3", names=("'--steps'", "greater than or equal to 1", "'-3'")),
    cli("demo-steps-float", "demo", "--steps=1.5", names=("'--steps'", "valid integer", "'1.5'")),
    cli("demo-device-index", "demo", "--device", "cuda:0", names=("unknown device 'cuda:0'", "expected one of: cpu")),
    cli("demo-out-is-a-file", "demo", "--steps", "1", "--out", A_FILE,
        names=(f"--out '{A_FILE}' is a file", "expected a directory")),
    cli("demo-extra-argument", "demo", "now", names="unexpected extra argument"),
    cli("doctor-dtype-float32", "doctor", f"{PLANTED}:build", "--dtype", "float32",
        names=("unknown dtype 'float32'", "expected one of: bfloat16, float16")),
    cli("doctor-device-empty", "doctor", f"{PLANTED}:build", "--device", "",
        names=("unknown device ''", "expected one of: cpu")),
    cli("doctor-out-is-a-file", "doctor", f"{PLANTED}:build", "--out", A_FILE,
        names=(f"--out '{A_FILE}' is a file", "expected a directory")),
    cli("doctor-policy-directory", "doctor", f"{PLANTED}:build", "--policy", A_DIRECTORY,
        names=f"--policy file '{A_DIRECTORY}' is not a file"),
    *(cli(f"doctor-policy-{name}", "doctor", f"{PLANTED}:build", "--policy", FILES[name],
          names=(f"--policy file '{FILES[name]}' is not a policy", *POLICY_FILES[name][2]))
      for name in ("empty", "syntax-error", "unknown-category", "op-aten::no_such_op")),
    cli("doctor-target-empty-name", "doctor", f"{PLANTED}:", names="must be path/to/file.py:callable"),
    cli("doctor-model-fails", "doctor", f"{TARGETS}:bad_inputs",
        names=(f"TARGET '{TARGETS}:bad_inputs' failed when run", "RuntimeError", "(3x5 and 4x4)")),
    cli("doctor-model-fails-under-autocast", "doctor", f"{TARGETS}:fails_under_autocast",
        names=("failed when run: RuntimeError: planted failure under autocast",)),
    cli("doctor-loss-fails", "doctor", f"{TARGETS}:bad_loss",
        names=("failed when run: AttributeError", "no_such_method")),
    cli("policy-no-subcommand", "policy", names="missing command; expected one of: show, diff, explain, layers"),
    cli("policy-unknown-subcommand", "policy", "list", names="No such command 'list'"),
    cli("policy-show-missing-argument", "policy", "show", names="Missing argument 'device'"),
    cli("policy-show-unknown", "policy", "show", "cpu0",
        names=("unknown policy 'cpu0'", "expected a TOML file or one of: CPU, CUDA, XPU")),
    cli("policy-show-missing-file", "policy", "show", MISSING, names=f"policy file '{MISSING}' does not exist"),
    cli("policy-show-directory", "policy", "show", A_DIRECTORY, names=f"policy file '{A_DIRECTORY}' is not a file"),
    *_FILE_CLI,
    cli("policy-diff-missing-argument", "policy", "diff", "CPU", names="Missing argument 'b'"),
    cli("policy-diff-extra-argument", "policy", "diff", "CPU", "CUDA", "XPU", names="unexpected extra argument"),
    cli("policy-diff-unknown-first", "policy", "diff", "gpu", "CPU", names=("unknown policy 'gpu'", "CPU, CUDA")),
    cli("policy-diff-bad-file", "policy", "diff", "CPU", FILES["unknown-key"],
        names=("is not a policy", "key='opps'")),
    cli("policy-explain-missing-argument", "policy", "explain", names="Missing argument 'op'"),
    *(cli(f"policy-explain-{name}", "policy", "explain", name,
          names=(f"cannot explain op '{name}'", f"op='{name}'", OP_EXPECTED)) for name in NOT_OPS),
    cli("policy-explain-empty-op", "policy", "explain", "", names=("cannot explain op ''", OP_EXPECTED)),
    cli("policy-explain-device-unknown", "policy", "explain", "mm", "--device", "tpu",
        names=("unknown device 'tpu'", "expected one of: cpu")),
    cli("policy-explain-dtype-float64", "policy", "explain", "mm", "--dtype", "float64",
        names=("unknown dtype 'float64'", "expected one of: bfloat16, float16")),
    cli("policy-layers-missing-argument", "policy", "layers", names="Missing argument 'TARGET'"),
    cli("policy-layers-no-callable", "policy", "layers", f"{PLANTED}:nothing", names="has no attribute 'nothing'"),
    cli("policy-layers-unknown-policy", "policy", "layers", f"{PLANTED}:build", "--policy", "FP9",
        names=("unknown policy 'FP9'", "FP8")),
    cli("policy-layers-no-fp8-ops", "policy", "layers", f"{PLANTED}:build", "--policy", "CPU",
        names=("Policy 'CPU' runs no op in fp8", "mixprec.policies.FP8")),
    cli("policy-layers-device-unknown", "policy", "layers", f"{PLANTED}:build", "--device", "tpu",
        names=("unknown device 'tpu'", "expected one of: cpu")),
]


@pytest.mark.parametrize(("argv", "names"), CLI_ROWS)
def test_bad_command_line_gives_one_line_and_exit_2(capsys, argv, names):
    before = snapshot()
    result = run_cli(capsys, *argv)
    after = snapshot()
    assert result.code == 2, (result.code, result.err)
    assert result.err.startswith("mixprec: error: ") and result.err.endswith("\n"), result.err
    assert "Traceback" not in result.out + result.err
    assert_one_line(result.err.removesuffix("\n"), names)
    assert_unchanged(before, after)


# --- the table covers the public API ---------------------------------------------------------------------

#: Public names that take any argument, so there is no bad input to try: exception and warning classes
#: (constructed with any message, as every exception).
EXEMPT = {mixprec.MixprecWarning, mixprec.AutocastDisabledWarning, mixprec.ScalerStateError}

NAMESPACES = {
    "mixprec": mixprec.__all__,
    "mixprec.policies": mixprec.policies.__all__,
    "mixprec.cpu.amp": mixprec.cpu.amp.__all__,
    "mixprec.cuda.amp": mixprec.cuda.amp.__all__,
    "mixprec.xpu.amp": mixprec.xpu.amp.__all__,
    "mixprec.graph": mixprec.graph.__all__,
    "mixprec.diagnostics": mixprec.diagnostics.__all__,
    "mixprec.scaler": mixprec.scaler.__all__,
    "mixprec.integrations.lightning": ["MixprecPrecision"],
    "mixprec.cli": mixprec.cli.__all__,
}


def _key(obj: object) -> object:
    """A callable's identity: a bound or class method by its function."""
    return getattr(obj, "__func__", obj)


def _takes_arguments(func: Callable[..., Any], drop_first: bool) -> bool:
    try:
        parameters = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return True
    return len(parameters) > int(drop_first)


def public_callables() -> dict[str, tuple[object, bool]]:
    """``{qualified name: (callable, takes arguments)}`` for every public callable and public method."""
    found: dict[str, tuple[object, bool]] = {}
    for namespace, names in NAMESPACES.items():
        module = importlib.import_module(namespace)
        for name in names:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType) or not callable(obj):
                continue
            found[f"{namespace}.{name}"] = (obj, _takes_arguments(obj, drop_first=False))
            if not isinstance(obj, type):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("mixprec"):
                    continue
                for attr, raw in vars(klass).items():
                    if attr.startswith("_") or not isinstance(raw, (types.FunctionType, classmethod, staticmethod)):
                        continue
                    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
                    drop_first = not isinstance(raw, staticmethod)
                    found[f"{namespace}.{name}.{attr}"] = (func, _takes_arguments(func, drop_first))
    return found


def test_every_public_callable_has_bad_input():
    covered = {_key(param.values[0]) for param in ROWS}
    missing = [
        name
        for name, (obj, takes_arguments) in sorted(public_callables().items())
        if takes_arguments and obj not in EXEMPT and _key(obj) not in covered
    ]
    assert not missing, f"public callables without bad-input rows in tests/test_bad_input.py: {missing}"
    assert not EXEMPT & covered, "an exempt name has rows: take it off EXEMPT"


def _commands(group: Any, prefix: list[str]) -> list[list[str]]:
    """Every command of the typer app, as the words that name it (``["policy", "show"]``)."""
    found = []
    for name, command in group.commands.items():
        sub = getattr(command, "commands", None)
        found += _commands(command, [*prefix, name]) if sub else [[*prefix, name]]
    return found


def test_every_command_has_bad_input():
    commands = _commands(typer.main.get_command(app), [])
    assert len(commands) >= 5, commands
    rows = [param.values[0] for param in CLI_ROWS]
    missing = [c for c in commands if not any(argv[: len(c)] == c for argv in rows)]
    assert not missing, f"commands without bad-input rows: {missing}"
