"""Every torch internal that differs between the releases mixprec supports, in one place.

mixprec's engine reaches into torch where torch has no public API: the dispatcher's Autocast
keys, dynamo's tracing state and guards, inductor's cache key, autograd's saved-tensor hooks.
Those move between releases. Each use lives here, names the torch source it relies on and the
releases it was checked on (the ``nox -s tests-X`` matrix, see ``docs/compatibility.md``), and
where a release cannot do what mixprec needs, the function refuses with an error that names the
release and the alternative, never a silent wrong result.

"Every supported release" below means checked on each release of ``TESTED`` (2.10.0, 2.11.0,
2.12.1, 2.13.0, 2.14.1, 2.15.0) by the tests that use it, which ``nox`` runs on each; where
releases differ, the text says which do what.

Nothing here runs at import time except the release check ``require_supported``, which
``import mixprec`` calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import shlex
import shutil
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from mixprec import _errors

# ---------------------------------------------------------------- the supported range

#: The supported releases: each minor release and the exact release the test matrix installs.
#: ``noxfile.py`` reads this table (without importing mixprec); keep it a literal.
TESTED: dict[str, str] = {
    "2.10": "2.10.0",
    "2.11": "2.11.0",
    "2.12": "2.12.1",
    "2.13": "2.13.0",
    "2.14": "2.14.1",
    "2.15": "2.15.0",
}
OLDEST = min(TESTED, key=lambda r: tuple(map(int, r.split("."))))
NEWEST = max(TESTED, key=lambda r: tuple(map(int, r.split("."))))


def parse(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string: ``"2.15.0+cu132"`` -> ``(2, 15)``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


#: The installed torch's ``(major, minor)``.
RELEASE: tuple[int, int] = parse(torch.__version__)


def release_name(release: tuple[int, int] = RELEASE) -> str:
    return f"{release[0]}.{release[1]}"


def at_least(major: int, minor: int) -> bool:
    return (major, minor) <= RELEASE


class UntestedTorchWarning(_errors.MixprecWarning):
    """The installed torch is newer than the releases mixprec was tested on."""


def require_supported(version: str = torch.__version__) -> None:
    """Refuse a torch older than the range; warn once about one newer than it (``import mixprec`` calls this)."""
    release = parse(version)
    supported = f"torch {OLDEST} to {NEWEST}"
    if release < parse(OLDEST):
        raise ImportError(
            _errors.message(
                f"mixprec does not support torch {version}",
                f"mixprec supports {supported}; it relies on torch internals that older releases lack",
                received={"torch": version},
                expected=f">= {OLDEST}",
                fix=f"pip install 'torch>={OLDEST}', or use an older mixprec.",
            )
        )
    if release > parse(NEWEST):
        import warnings

        warnings.warn(
            _errors.message(
                f"mixprec has not been tested on torch {version}",
                f"mixprec is tested on {supported}; it keeps working, and where this release's autocast "
                "kernels differ from the newest tested release's, the first region says so",
                received={"torch": version},
                fix=f"Report problems with this release; torch {TESTED[NEWEST]} is the newest tested.",
            ),
            UntestedTorchWarning,
            stacklevel=3,
        )


def table_release() -> str:
    """The tested release whose native autocast tables describe the installed torch: its own, or the
    newest tested one for a newer torch (the oldest is never needed: older releases are refused)."""
    return release_name(min(RELEASE, parse(NEWEST)))


# ---------------------------------------------------------------- tracing state
#
# Checked on 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0 (tests/test_compat.py).


def _tracing_context() -> Any:
    """torch/_guards.py ``TracingContext.try_get()``: set on the thread for the whole of a dynamo, AOTAutograd
    or export trace, on every supported release."""
    return torch._guards.TracingContext.try_get()


def _compiling_or_context() -> bool:
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


#: Whether a torch.compile or torch.export trace runs on this thread now, asked from anywhere: a dispatcher
#: kernel, a constant function, a hook. ``torch.compiler.is_compiling()`` (torch/compiler/__init__.py) answers
#: False inside a dispatcher kernel while dynamo propagates fake tensors on 2.10, 2.11 and 2.12 (it reads a
#: flag only dynamo's frame evaluation sets there); the tracing context is set then on every release. On 2.13
#: and later ``is_compiling`` answers True there and is the cheaper call (one per kernel call in eager code).
tracing: Callable[[], bool] = torch.compiler.is_compiling if at_least(2, 13) else _compiling_or_context

#: Whether torch.export traces now (torch/compiler/__init__.py, every supported release).
exporting: Callable[[], bool] = torch.compiler.is_exporting


def tracing_context() -> Any:
    """The trace's ``TracingContext`` (it carries dynamo's guards), or None outside a trace."""
    return _tracing_context()


# ---------------------------------------------------------------- dynamo


F = TypeVar("F", bound=Callable[..., Any])


def constant(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo (about a second at import).

    Dynamo runs a marked function eagerly and puts its result in the trace as a constant. The mark is the
    attribute ``_dynamo_marked_constant`` that torch/_dynamo/decorators.py ``assume_constant_result`` sets,
    on every supported release (tests/test_compile.py compares the marks).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


#: Whether dynamo hands a constant function a user-defined object as itself. 2.12 and later do, guarding the
#: frame on the object's identity (torch/_dynamo/variables/functions.py ``invoke_and_store_as_constant``); 2.10
#: and 2.11 accept Python constants only ("can't reconstruct arbitrary frozen dataclass instances" for a
#: Policy), so there the traced code passes ``id(obj)``, which dynamo guards the same way (``call_id``'s
#: ID_MATCH guard), and the constant function finds the object again through ``share``.
CONSTANT_TAKES_OBJECTS = at_least(2, 12)
_shared: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLE = "mixprec object"


def _share(obj: Any) -> None:
    if not torch.compiler.is_dynamo_compiling():  # one made while dynamo traces has no real object to find
        _shared[id(obj)] = obj


#: Make an object (a Policy, a Setting) findable by ``passed`` while it lives; called as each is made.
share: Callable[[Any], None] = (lambda obj: None) if CONSTANT_TAKES_OBJECTS else _share


def to_constant(obj: Any) -> Any:
    """In traced code: ``obj`` as a constant function's argument (itself, or a handle dynamo can pass)."""
    if CONSTANT_TAKES_OBJECTS or obj is None:
        return obj
    return (_HANDLE, id(obj))


def passed(value: Any) -> Any:
    """In a constant function: the object ``to_constant`` passed. One made inside the trace has no real
    object behind it on these releases: refused, as dynamo's own limit on later ones is."""
    if not (isinstance(value, tuple) and len(value) == 2 and value[0] == _HANDLE):
        return value
    found = _shared.get(value[1])
    if found is None:
        raise RuntimeError(
            _errors.message(
                "mixprec got a policy made inside the compiled function",
                f"torch {release_name()}'s dynamo passes mixprec only objects made outside the traced code",
                fix="Build the policy outside the compiled function (e.g. at module level) and pass it in.",
            )
        )
    return found


def skip_code(code: types.CodeType) -> None:
    """Never compile ``code`` as a frame of its own (dynamo still inlines it): torch/_dynamo/eval_frame.py
    ``skip_code``, every supported release."""
    from torch._dynamo.eval_frame import skip_code as skip

    skip(code)


def without_dynamo(function: Any) -> Any:
    """``function`` with dynamo off for every frame it calls: ``torch.compiler.disable(recursive=True)``, every
    supported release. (A frame that dynamo runs eagerly still has dynamo compile the frames it calls.) Without
    dynamo loaded nothing compiles, and ``function`` is returned as it is (dynamo's import is not paid)."""
    if "torch._dynamo" not in sys.modules:
        return function
    return torch.compiler.disable(function, recursive=True)


def skip_frame(reason: str) -> BaseException:
    """The exception that makes dynamo run the frame it traces eagerly: torch/_dynamo/exc.py ``SkipFrame``
    (every supported release)."""
    from torch._dynamo.exc import SkipFrame

    return SkipFrame(reason)


def current_translator() -> Any:
    """Dynamo's instruction translator for the frame being traced, or None: torch/_dynamo/symbolic_convert.py
    ``InstructionTranslator.current_tx`` (every supported release)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:
        return None


def translator_class() -> type:
    """torch/_dynamo/symbolic_convert.py ``InstructionTranslatorBase``; its instances have ``f_code``,
    ``parent``, ``instructions`` and ``instruction_pointer`` on every supported release."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    return InstructionTranslatorBase


#: The instructions that open a ``with`` statement on the value a call just made (3.10; 3.11-3.13).
WITH_OPCODES = ("SETUP_WITH", "BEFORE_WITH")


@functools.cache
def returns_torch_autocast() -> bool:
    """Whether dynamo takes a ``torch.autocast`` that a user class's ``__new__`` returns.

    Dynamo's polyfill that makes user-defined objects asks ``isinstance(obj, cls)`` of the result, which needs
    ``AutocastModeVariable.python_type`` (torch/_dynamo/variables/ctx_manager.py): 2.12 and later have it;
    on 2.10 and 2.11 dynamo refuses with "builtin isinstance() cannot determine type of argument", so mixprec
    keeps its own region object there (right everywhere, one more compiled frame at most).
    """
    from torch._dynamo.variables.ctx_manager import AutocastModeVariable

    return "python_type" in vars(AutocastModeVariable)


def allow_in_graph(function: Callable[..., Any]) -> None:
    """torch/_dynamo/decorators.py ``allow_in_graph`` (every supported release)."""
    import torch._dynamo

    torch._dynamo.allow_in_graph(function)


#: ``torch._C._are_functorch_transforms_active()``: whether a torch.func transform is running (its dynamic-layer
#: keys are in the thread's included set; 2.10 to 2.15 alike).
functorch_active: Callable[[], bool] = torch._C._are_functorch_transforms_active


def batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a batched tensor of a vmap: torch.func's, or the legacy one of
    ``autograd.grad(..., is_grads_batched=True)``, under which an autograd.Function's backward runs with no
    torch.func transform active (``functorch_active`` is False there)."""
    return bool(torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_legacy_batchedtensor(t))


def no_autograd_function() -> str | None:
    """Why a kernel cannot apply a custom autograd Function now, or None where it can:

    * a torch.func transform (grad, vmap, jacrev, ...) is running (``torch._C._are_functorch_transforms_active``):
      a Function goes to torch's ``custom_function_call`` then, which runs only at the transforms' own layer,
      above the Autocast keys;
    * forward-mode AD is on (``torch.autograd.forward_ad._current_level``, -1 outside ``dual_level``): a
      Function needs a ``jvp`` for dual inputs."""
    if functorch_active():
        return "a torch.func transform (grad, vmap, jacrev, ...)"
    if torch.autograd.forward_ad._current_level >= 0:
        return "forward-mode AD (torch.autograd.forward_ad)"
    return None


def dynamo_tracing() -> bool:
    """Whether dynamo is tracing the calling code (``torch.compiler.is_dynamo_compiling``). Code it traces must
    not call ``hash`` on a tuple: dynamo 2.10 to 2.12 cannot trace that builtin ("Failed to trace builtin
    operator"), so a Policy made there defers its hash (it is refused with mixprec's own error later)."""
    return bool(torch.compiler.is_dynamo_compiling())


def dynamo_loaded() -> bool:
    """Whether dynamo was imported (so that it may hold compiled frames)."""
    return "torch._dynamo" in sys.modules


def reset_dynamo() -> None:
    """Drop every compiled frame (``torch._dynamo.reset``), if dynamo was ever imported."""
    if dynamo_loaded():
        torch._dynamo.reset()


def add_global_guard(context: Any, check: Callable[[], bool], description: str) -> None:
    """Guard the frame being compiled on ``check()``: a lambda guard on dynamo's root guard manager, added
    through the tracing context as torch's own functorch-stack guard is (torch/_guards.py ``Guard``,
    torch/_dynamo/source.py ``GlobalStateSource``, torch/_dynamo/guards.py ``guard_manager.root.add_lambda_guard``).
    ``add_lambda_guard`` takes ``(fn, verbose_code_parts, user_stack)`` from 2.11 on, ``(fn,
    verbose_code_parts)`` on 2.10."""
    from torch._dynamo.source import GlobalStateSource

    def create(builder: Any, guard: Any) -> None:
        where = (guard.user_stack,) if at_least(2, 11) else ()
        builder.guard_manager.root.add_lambda_guard(lambda _: check(), [description], *where)

    context.guards_context.dynamo_guards.add(torch._guards.Guard(GlobalStateSource(), create))


def add_cleanup(translator: Any, hook: Callable[[], None]) -> None:
    """Run ``hook`` when the trace ``translator`` belongs to ends (``OutputGraph.add_cleanup_hook``)."""
    translator.output.add_cleanup_hook(hook)


# ---------------------------------------------------------------- inductor


class _SettingsPass:
    """A no-op post-grad pass whose ``uuid`` names mixprec's settings (and the pass it wraps).

    torch/_inductor/codecache.py keys its FX graph cache on a custom pass's ``uuid`` only for a
    ``CustomGraphPass``; for any other callable it bypasses the cache (every supported release). This pass is
    a plain callable on purpose: the AOTAutograd cache keys a graph on autocast's enabled flag and dtype only,
    so a graph traced under one policy must never be found under another, in this process or the next.
    """

    def __init__(self, key: tuple[Any, ...], inner: Any) -> None:
        self.key, self.inner = key, inner

    def __call__(self, graph: Any) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        inner = self.inner.uuid() if self.inner is not None and hasattr(self.inner, "uuid") else None
        return ("mixprec", repr(self.key), inner)


def key_inductor(key: tuple[Any, ...]) -> None:
    """Carry ``key`` into inductor's compile through ``config.post_grad_custom_pre_pass`` (torch/_inductor/
    config.py; a ``CustomGraphPassType`` on every supported release), keeping a pass the user set there."""
    import torch._inductor.config as config

    current = config.post_grad_custom_pre_pass
    inner = current.inner if isinstance(current, _SettingsPass) else current
    config.post_grad_custom_pre_pass = _SettingsPass(key, inner)


def keep_roundings() -> None:
    """Make inductor keep the roundings to bfloat16 and float16 in the graphs it compiles, emulated compute's
    (``_emulate._traced``, as a make_fx trace records them) and those of the ops that read their results.

    By default inductor elides a downcast that an upcast follows: its joint-graph pass folds ``x.to(low).float()``
    into ``x.float()``, and a fused kernel keeps low-precision values in float32. An emulated op's float16
    overflow then came out finite (the GradScaler never backed off) and its bfloat16 result float32's. Turned on
    the first time a trace records an emulated op, and left on for the process (a graph compiled later, such as
    a lazily compiled backward, needs it too): ``config.emulate_precision_casts`` (torch/_inductor/config.py,
    "emulate the eager numerics"), and the trace's own proxy mode, created before, which tags each low-precision
    op it records with the option on (``ProxyTorchDispatchMode.emulate_precision_casts``, torch/fx/experimental/
    proxy_tensor.py). The same names on every supported release. Outside a trace, or without inductor loaded,
    nothing."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None and not getattr(config, "emulate_precision_casts", True):
        if not _inductor_emulates_casts():
            _warn_roundings_lost()
            return
        config.emulate_precision_casts = True  # type: ignore[attr-defined]
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is not None and hasattr(mode, "emulate_precision_casts"):
        mode.emulate_precision_casts = True


def outside_modes() -> contextlib.AbstractContextManager[Any]:
    """Every dispatch mode set aside while the block runs (a trace's proxy, fake and functional modes, a user's
    logging mode): plain tensors made inside are neither recorded nor seen
    (``torch.utils._python_dispatch._disable_current_modes``, on every supported release)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()  # type: ignore[no-any-return]


@functools.cache
def _inductor_emulates_casts() -> bool:
    """Whether inductor keeps casts down under ``emulate_precision_casts``: from torch 2.13 on. torch 2.10's
    vectorised CPU code raises with it (``CppVecOverrides.to_dtype`` names its argument ``use_compute_dtypes``),
    and torch 2.11 and 2.12's joint-graph pass folds ``x.to(low).float()`` whatever it says
    (torch/_inductor/fx_passes/joint_graph.py reads the option from 2.13 on; measured on each release)."""
    return RELEASE >= (2, 13)


@functools.cache
def _warn_roundings_lost() -> None:
    import warnings

    warnings.warn(
        _errors.message(
            f"torch {torch.__version__}'s inductor cannot keep emulated compute's roundings",
            "its option that keeps casts down (emulate_precision_casts) fails or is ignored before torch 2.13, so "
            "a graph of emulated ops that inductor compiles folds a result's rounding into the cast up of the op "
            "that reads it: its results come closer to float32's than eager ones, and a float16 overflow can "
            "come out finite (other backends, such as aot_eager, keep the roundings)",
            received={"torch": torch.__version__},
            fix="Upgrade torch (2.13 and later keep them under inductor), compile with a backend other than "
            "inductor, or run the region with compute='native'.",
        ),
        stacklevel=3,
    )


# ---------------------------------------------------------------- dispatcher
#
# torch/csrc/utils/python_dispatch.cpp and torch/library.py; the same calls on every supported release.

#: ``torch._C._dispatch_get_registrations_for_dispatch_key(key)``: the ops with a kernel at ``key``.
registrations: Callable[[str], list[str]] = torch._C._dispatch_get_registrations_for_dispatch_key
#: ``torch._C._dispatch_keyset_full_after(key)``: the keys a kernel at ``key`` redispatches to.
keyset_after: Callable[[Any], Any] = torch._C._dispatch_keyset_full_after
#: ``torch._C._ExcludeDispatchKeyGuard(keyset)``: a context that leaves those keys out of dispatch.
ExcludeDispatchKeyGuard: Any = torch._C._ExcludeDispatchKeyGuard


def has_kernel(qualified: str, key: str) -> bool:
    """``torch._C._dispatch_has_kernel_for_dispatch_key``: whether the op ``aten::x.overload`` has a kernel at
    ``key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key))


def call_at_key(op: Any, key: str, args: Any, kwargs: Any) -> Any:
    """Run an overload's kernel at ``key`` itself (``OpOverload._op_dk``), without torch-function modes."""
    with torch._C.DisableTorchFunction():
        return op._op_dk(getattr(torch._C.DispatchKey, key), *args, **kwargs)


def resolve_overload(name: str, args: Any, kwargs: Any) -> str:
    """The overload name the dispatcher picks for ``name(*args, **kwargs)`` (``torch._C._jit_resolve_packet``)."""
    return str(torch._C._jit_resolve_packet(name, *args, **kwargs))


def dispatch_key(name: str) -> Any:
    """``torch._C.DispatchKey.<name>`` (``AutocastCPU``), or None where this build has no such key."""
    return getattr(torch._C.DispatchKey, name, None)


def backend_key(device_type: str) -> str | None:
    """``torch._C._dispatch_key_for_device``: the dispatch key name of a device type (``CPU``), or None."""
    try:
        return str(torch._C._dispatch_key_for_device(device_type))
    except RuntimeError:
        return None


def autocast_region_calls() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The calls make_fx records a ``torch.autocast`` region in traced code as (``torch.amp.autocast_mode``'s
    private ``_enter_autocast(device, dtype, enabled, cache)`` and ``_exit_autocast(entered)``, in every supported
    release; export records a ``wrap_with_autocast`` higher-order op instead)."""
    module = torch.amp.autocast_mode
    return module._enter_autocast, module._exit_autocast


def grad_mode_call() -> Callable[..., Any]:
    """The call make_fx records a ``torch.no_grad()`` / ``torch.enable_grad()`` block's entry and exit as:
    ``torch._C._set_grad_enabled(mode)`` (every supported release; export records a higher-order op instead)."""
    return torch._C._set_grad_enabled  # type: ignore[no-any-return]


_casts_reversed: list[bool] = []  # native_casts_reversed's answer, once asked


@constant  # (a compiled kernel's call: dynamo runs it eagerly, the build configuration is no op)
def native_casts_reversed() -> bool:
    """Whether torch's own autocast kernels cast an op's arguments last to first. They cast them in one C++ call's
    argument list (``op(cached_cast(dtype, args, device)...)``; a list argument's tensors first to last), whose
    order of evaluation is the compiler's: GCC and MSVC evaluate right to left, clang left to right. Autograd runs
    a later-made node first, so the order shows in the float32 sum of the gradients a tensor gets through more
    than two uses, two of them one op's casts. Read from torch's build configuration (its first line names the
    compiler); ``tests/test_kernels.py`` holds it to the order torch's kernels make their casts in."""
    if not _casts_reversed:
        lines = [line.strip(" -").lower() for line in torch.__config__.show().splitlines()[1:3]]
        _casts_reversed.append(not any("clang" in line for line in lines))
    return _casts_reversed[0]


def load_extension(name: str, source: str, directory: Path) -> Any:
    """``torch.utils.cpp_extension.load``: ``source`` built against this torch in ``directory`` (once) and
    imported. The C++ reaches these internals, present on every supported release and built by
    ``tests/test_fastpath.py`` on each: ``OperatorHandle::getComputedKernelForDispatchKey`` (the Python kernel
    below the C++ one), ``SavedTensorDefaultHooks::get_tls_state``, ``torch::autograd::get_current_graph_task_id``,
    ``THPVariable_Wrap`` and ``THPDtype``.

    Every load (a build, or only the import of one made before) passes torch's ``lock`` file in the build
    directory, and waits with no time limit while one is there; a process killed while it held one (SIGKILL,
    SIGTERM, a closed terminal: anything that skips its ``finally``) leaves it behind. So the load holds an OS
    lock of its own first (``_build_lock``), which dies with its process: holding it, no live process is loading
    there, and a ``lock`` file found is stale and removed. Where no OS lock can be had, a ``lock`` older than any
    build takes is removed instead. A load that fails or is interrupted forgets torch's record of the build
    (``cpp_extension.JIT_EXTENSION_VERSIONER``, a dict ``entries`` by name on every supported release), so that
    another load in the process builds again. A load that succeeds seals the library with its SHA-256; one whose
    seal is missing or wrong (cut short) is built again before anything imports it. A build with no compiler on
    PATH fails at once, saying so, instead of with ninja's last line."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    with _build_lock(directory) as alone:
        try:
            if alone or time.time() - lock.stat().st_mtime > 600:
                lock.unlink()
        except FileNotFoundError:
            pass
        library, seal = directory / f"{name}.so", directory / f"{name}.so.sha256"
        if alone and library.exists() and (not seal.exists() or seal.read_text().strip() != _digest(library)):
            # A library that no load saw whole (a disk that filled, a copy cut short): importing it can kill the
            # process (SIGBUS) or fail in every process after. Built again. (Only holding the OS lock: without
            # one, another process may be building here.)
            for made in directory.iterdir():
                if made.is_file() and made.name not in ("lock", "mixprec.lock"):
                    made.unlink()
        if not library.exists():
            compiler = cpp_extension.get_cxx_compiler()  # (CXX, else the platform's; "ccache g++" runs g++)
            if shutil.which(shlex.split(compiler)[0] if compiler.strip() else compiler) is None:
                raise RuntimeError(f"no C++ compiler: {compiler!r} (CXX, else torch's default) is not on PATH")
        try:
            module = cpp_extension.load(
                name, [source], extra_cflags=["-O2"], build_directory=str(directory), verbose=False
            )
        except BaseException:
            # torch counts a build as made before it runs (``JIT_EXTENSION_VERSIONER``): after one interrupted
            # (Ctrl-C), a load again in this process would build nothing and fail to import the library
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
            raise
        with contextlib.suppress(OSError):  # (a directory only read: the next load checks again)
            seal.write_text(_digest(library) + "\n")
        return module


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[bool]:
    """An exclusive ``fcntl.flock`` on ``directory/mixprec.lock`` while the block runs, waited for while another
    process holds it (the OS releases it when that process ends, however it ends). Yields whether it is held:
    False where the platform or the file system has no such lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    with open(directory / "mixprec.lock", "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError:  # a file system without flock
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def register_kernel(library: Any, name: str, kernel: Callable[..., Any], key: str) -> None:
    """``Library.impl(name, kernel, key, with_keyset=True)``: the kernel gets the dispatch keyset first, so it
    can redispatch below its key (torch/library.py; ``with_keyset`` on every supported release)."""
    library.impl(name, kernel, key, with_keyset=True)


def destroy_library(library: Any) -> None:
    """Remove every kernel a ``torch.library.Library`` registered (``Library._destroy``)."""
    library._destroy()


# ---------------------------------------------------------------- TorchScript

#: What ``torch.jit.script`` calls on a module (and on each submodule) before it compiles it, where the module
#: has it, to swap in a scriptable stand-in (``torch.jit._script.call_prepare_scriptable_func``, every supported
#: release): a module under a module policy has one that refuses, since TorchScript would compile the class's
#: forward and drop the policy.
SCRIPT_PREPARE = "__prepare_scriptable__"


# ---------------------------------------------------------------- FSDP2


def fsdp2_unsharded(model: torch.nn.Module) -> dict[int, torch.Tensor | None]:
    """``id(registered parameter) -> the unsharded parameter it computes with`` for each parameter ``fully_shard``
    manages in ``model`` (None until its first all-gather makes it; every later step gathers into it).
    FSDP2's private structures: a module's ``_get_fsdp_state()``, its parameter groups (a list where a release
    has ``_fsdp_param_groups``, else one ``_fsdp_param_group``) and each ``FSDPParam``'s ``sharded_param`` and
    ``_unsharded_param``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a build without torch.distributed)
        return {}
    out: dict[int, torch.Tensor | None] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [] if one is None else [one]
        for group in groups:
            for param in group.fsdp_params:
                out[id(param.sharded_param)] = getattr(param, "_unsharded_param", None)
    return out


# ---------------------------------------------------------------- autograd and checkpoint
#
# torch/utils/checkpoint.py's private structures, the same on every supported release.

#: ``torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing)``: the innermost saved-tensor hooks
#: (pack, unpack), or None.
top_saved_tensors_hooks: Callable[[bool], Any] = torch._C._autograd._top_saved_tensors_default_hooks
#: ``torch._C._current_graph_task_id()``: -1 outside backward.
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def in_reentrant_recompute() -> bool:
    """Whether the autograd node running now is the reentrant checkpoint's (``CheckpointFunctionBackward``), whose
    ``apply`` recomputes the checkpointed forward (``torch._C._current_autograd_node``, 2.10 to 2.15 alike)."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == "CheckpointFunctionBackward"


def register_optimizer_step_post_hook(hook: Callable[..., None]) -> Any:
    """``torch.optim.optimizer.register_optimizer_step_post_hook``: ``hook`` runs after every ``torch.optim``
    optimizer's ``step`` in the process (public, but not re-exported by ``torch.optim``; 2.10 to 2.15 alike)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook as register

    return register(hook)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm``: ``(a * scale_a) @ (b * scale_b)`` of fp8 operands, accumulated in float32, in
    ``out_dtype`` (private in every supported release; the same signature in 2.10 to 2.15). ``use_fast_accum``:
    on CUDA, without the accumulator's periodic promotion to float32 (no effect on CPU).

    On CPU the product is a float32 matmul of the fp8 values, then the scales: every fp8 value is exact in
    float32, so it is the same GEMM up to the order of float32 summation (``tests/test_fp8.py`` holds it to
    ``torch._scaled_mm`` where the CPU runs that). torch's CPU kernel is oneDNN's reference fp8 matmul,
    measured at 55 ms for 256 x 64 x 192 and 18 s for 1024^3 against 0.23 ms and 13 ms (torch 2.13, a Xeon
    with AMX-BF16); it takes one scale per tensor before 2.12, and an AVX2-only CPU has none at all.

    On CUDA, rowwise scales with a float32 output run only through cuBLAS 12.9+ on compute capability 9.0;
    elsewhere torch's CUTLASS kernel refuses any output but bfloat16 (float16 from 2.10 on some builds). A
    rowwise GEMM asked for float32 therefore runs with a bfloat16 output, cast up: the dtype asked for, with
    bfloat16's rounding of the product (the gradients of float32 weights under a rowwise recipe).

    The CPU product is a float32 matmul even inside an enabled CPU autocast region (a backward called there,
    where no autocast kernel has excluded the key): autocast would run it in the region's dtype."""
    if a.device.type == "cpu":
        # (a backward called inside a CPU region: keep the product float32)
        with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else contextlib.nullcontext():
            return (a.float() @ b.float() * scale_a * scale_b).to(out_dtype)
    if (scale_a.numel() != 1 or scale_b.numel() != 1) and out_dtype not in (torch.bfloat16, torch.float16):
        product = torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum
        )
        return product.to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def raw_op(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """What calling ``op`` calls (``OpOverload._op``): the same call less ``OpOverload.__call__``'s frame; ``op``
    itself where a release has no such attribute."""
    raw = getattr(op, "_op", None)
    return raw if callable(raw) else op


@functools.cache
def checkpoint_codes() -> dict[types.CodeType, str]:
    """The code of the Python frames that run a checkpointed forward, and what each runs: ``"forward"``
    (``CheckpointFunction.forward``, the reentrant checkpoint's forward: its local ``ctx``), ``"backward"``
    (``CheckpointFunction.backward``, its recompute: ``ctx``) and ``"unpack"`` (the non-reentrant checkpoint's
    unpack hook, made in ``_checkpoint_hook.__init__``, which runs its recompute: the ``_CheckpointFrame`` it
    closes over, ``frame``)."""
    from torch.utils.checkpoint import CheckpointFunction, _checkpoint_hook

    codes = {CheckpointFunction.forward.__code__: "forward", CheckpointFunction.backward.__code__: "backward"}
    for const in _checkpoint_hook.__init__.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "unpack_hook" and "frame" in const.co_freevars:
            codes[const] = "unpack"
    return codes


def checkpoint_frame_of(hook: Any) -> tuple[Any, bool] | None:
    """The ``_CheckpointFrame`` a non-reentrant checkpoint's saved-tensor hook closes over, and whether the hook is
    its recompute's (True) or its forward's (False); None for any other hook.

    The forward's pack hook closes over ``frame``; the recomputation hook over ``target_frame_ref`` (a weakref),
    and is wrapped in ``torch._dynamo.disable`` (``__wrapped__``).
    """
    while hasattr(hook, "__wrapped__"):
        hook = hook.__wrapped__
    code = getattr(hook, "__code__", None)
    if code is None or not hook.__closure__:
        return None
    for name, cell in zip(code.co_freevars, hook.__closure__, strict=False):
        if name == "frame":
            found, recomputing = cell.cell_contents, False
        elif name == "target_frame_ref":
            found, recomputing = cell.cell_contents(), True
        else:
            continue
        return (found, recomputing) if type(found).__name__ == "_CheckpointFrame" else None
    return None
