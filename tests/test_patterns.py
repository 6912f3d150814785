"""Code written as users write it for torch.autocast, with mixprec swapped in: each test is a pattern that once
failed (issue 20), compared with native torch doing the same thing wherever torch has an answer.

Patterns whose failure showed only in a fresh process run in a subprocess (``_fresh``).
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import engine

BF16, F32 = torch.bfloat16, torch.float32
CPU = mixprec.policies.CPU
LINEAR_FP32 = CPU.with_ops(fp32=["linear"])
RELU_FP32 = CPU.with_ops(fp32=["relu"])


def _fresh(code: str) -> str:
    """Run ``code`` in a new Python process; its stdout (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


class CountCasts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------- torch.compile


def test_readme_region_inside_compiled_code_runs_on_its_first_call_in_a_fresh_process():
    out = _fresh(
        """
        import torch, mixprec
        from torch._dynamo.testing import CompileCounter
        lin = torch.nn.Linear(8, 8); x = torch.randn(4, 8)
        counts = []
        for make in (lambda: mixprec.autocast("cpu"), lambda: torch.autocast("cpu")):
            torch._dynamo.reset()
            counter = CompileCounter()
            @torch.compile(backend=counter, fullgraph=True)
            def f(x):
                with make():
                    return lin(x)
            dtypes = [f(x).dtype for _ in range(20)]
            counts.append((set(dtypes), counter.frame_count))
        print(counts)
        """
    )
    assert out == "[({torch.bfloat16}, 1), ({torch.bfloat16}, 1)]"  # one frame, as torch.autocast


def test_print_inside_a_compiled_region_keeps_the_region_from_the_first_call():
    out = _fresh(
        """
        import torch, mixprec
        lin = torch.nn.Linear(8, 8); x = torch.randn(4, 8)
        def body(x):
            y = lin(x)
            print("step", end=" ")  # a graph break inside the region
            return y, lin(y.float())
        def mine(x):
            with mixprec.autocast("cpu"):
                return body(x)
        def native(x):
            with torch.autocast("cpu"):
                return body(x)
        def mine_off(x):
            with mixprec.autocast("cpu"):
                with mixprec.autocast("cpu", enabled=False):
                    return body(x)
        def native_off(x):
            with torch.autocast("cpu"):
                with torch.autocast("cpu", enabled=False):
                    return body(x)
        for a, b in ((mine, native), (mine_off, native_off)):
            ca, cb = torch.compile(a, backend="aot_eager"), torch.compile(b, backend="aot_eager")
            for _ in range(3):
                ra, rb = ca(x), cb(x)
                assert [t.dtype for t in ra] == [t.dtype for t in rb], (a.__name__, ra, rb)
                assert all(torch.equal(s, t) for s, t in zip(ra, rb))
        print("ok")
        """
    )
    assert out.endswith("ok")


def test_a_graph_break_inside_a_policy_region_runs_the_region_as_eager_code_does():
    def fn(x):
        with mixprec.autocast("cpu", policy=RELU_FP32):
            y = torch.relu(LIN(x))
            print("", end="")
            return y, torch.relu(LIN(x)), LIN(x)

    eager = fn(X)
    compiled = torch.compile(fn, backend="aot_eager")
    for _ in range(3):
        got = compiled(X)
        assert [t.dtype for t in got] == [t.dtype for t in eager] == [F32, F32, BF16]
        assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True))


def test_compiled_hugging_face_gpt2_step_with_the_region_inside_equals_native():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 8))

    def step(make):
        def run(ids):
            with make():
                return model(ids, labels=ids).loss
        return run

    def losses(make, compiled):
        torch._dynamo.reset()
        model.zero_grad()
        loss = (torch.compile(step(make), backend="aot_eager") if compiled else step(make))(ids)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def same(a, b):
        return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))

    # Native compute is torch's: bit for bit with torch.autocast (the default, compute="auto", emulates on a
    # CPU without bf16 units, and is then checked against itself run eagerly).
    native = losses(lambda: torch.autocast("cpu"), True)
    assert same(losses(lambda: mixprec.autocast("cpu", compute="native"), True), native)
    assert same(losses(lambda: mixprec.autocast("cpu"), True), losses(lambda: mixprec.autocast("cpu"), False))


@pytest.mark.parametrize("policy", [None, RELU_FP32], ids=["default", "policy"])
def test_mixprec_region_inside_a_frameworks_torch_autocast_compiles(policy):
    def fn(x):
        # torch.autocast: what Lightning and HF Trainer open around user code
        with torch.autocast("cpu"), mixprec.autocast("cpu", policy=policy):
            return torch.relu(LIN(x))

    expected = fn(X)
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(X)
    assert got.dtype is expected.dtype is (F32 if policy is not None else BF16)
    assert torch.equal(got, expected)


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        print("", end="")  # a graph break inside the module
        return self.lin(y)


@pytest.mark.parametrize("how", ["graph-break", "model.compile"])
@pytest.mark.parametrize("policy", ["fp32", LINEAR_FP32], ids=["fp32", "policy"])
def test_module_policy_under_compile_gives_the_eager_result(how, policy):
    torch.manual_seed(0)
    child = _Breaks() if how == "graph-break" else torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), child)
    mixprec.set_module_policy(model[1], policy)

    def run(x):
        with torch.autocast("cpu"):
            return model(x)

    eager = run(X)
    if how == "model.compile":
        model.compile(backend="aot_eager")
        compiled = run
    else:
        compiled = torch.compile(run, backend="aot_eager")
    for _ in range(3):
        got = compiled(X)
        assert got.dtype is eager.dtype is F32
        assert torch.equal(got, eager)


def test_a_module_policy_and_a_compiled_call_inside_it_follow_the_policy():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    handle = mixprec.set_module_policy(model[1], LINEAR_FP32)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    with torch.autocast("cpu"):
        assert compiled(X).dtype is F32
        handle.remove()
        assert compiled(X).dtype is BF16


def test_export_under_install_refuses_a_policy_it_would_drop():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cpu"):
                return self.lin(x)

    for strict in (False, True):
        refused = pytest.raises(RuntimeError, match=r"cannot be exported under mixprec\.install")
        with mixprec.install(LINEAR_FP32), refused:
            torch.export.export(Model(), (torch.randn(2, 4),), strict=strict)
    with mixprec.install():  # the default policies: nothing to drop
        program = torch.export.export(Model(), (torch.randn(2, 4),))
    assert program.module()(torch.randn(2, 4)).dtype is BF16


# ---------------------------------------------------------------- module policies, state and objects


def test_llama_kv_cache_and_generate_with_an_fp32_attention_module():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=100)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(1, 100, (1, 5))
    handle = mixprec.set_module_policy(model.model.layers[0].self_attn, "fp32")  # what mixprec doctor suggests
    with torch.no_grad(), mixprec.autocast("cpu"):
        out = model(ids)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.logits.dtype is BF16 and generated.shape == (1, 9)
    handle.remove()


class _Appends(torch.nn.Module):
    def forward(self, x, seen, extra, cache):
        seen.append(x.dtype)
        return x * 2, extra, cache


def test_module_policy_passes_non_tensor_arguments_through_untouched():
    module = _Appends()
    mixprec.set_module_policy(module, "fp32")
    seen: list[torch.dtype] = []
    generator = (i for i in range(3))
    cache = type("Cache", (), {"__iter__": lambda self: iter([torch.ones(1)])})()  # iterable, like a KV cache
    with mixprec.autocast("cpu"):
        y, extra, got_cache = module(torch.ones(2, dtype=BF16), seen, generator, cache=cache)
    assert seen == [F32] and y.dtype is F32  # the tensor cast, the list the caller's own (its append visible)
    assert extra is generator and got_cache is cache


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_under_torch_autocast_with_a_policy_module(reentrant):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    mixprec.set_module_policy(model[2], LINEAR_FP32)  # HF Trainer(bf16=True, gradient_checkpointing=True)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for use in (False, True):
        model.zero_grad()
        x.grad = None
        with torch.autocast("cpu"):
            y = checkpoint(model, x, use_reentrant=reentrant) if use else model(x)
        y.float().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in model.parameters())])
    assert y.dtype is F32
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class _Interrupts(torch.nn.Module):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error

    def forward(self, x):
        torch.mm(x, x)
        raise self.error()


INTERRUPTS = [KeyboardInterrupt, SystemExit, GeneratorExit]


def _state_is_clean():
    from mixprec.engine import _state

    state = _state.get()
    return (not torch.is_autocast_enabled("cpu") and not state.frames and not state.active
            and not state.module_policies and mixprec.get_policy("cpu") is CPU)


@pytest.mark.parametrize("error", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("outer", ["torch", "mixprec", "none"])
@pytest.mark.parametrize("policy", ["fp32", LINEAR_FP32], ids=["fp32", "policy"])
def test_ctrl_c_inside_a_module_with_a_policy_restores_state(error, outer, policy):
    module = _Interrupts(error)
    handle = mixprec.set_module_policy(module, policy)
    regions = {"torch": lambda: torch.autocast("cpu"), "mixprec": lambda: mixprec.autocast("cpu"),
               "none": lambda: torch.autocast("cpu", enabled=False)}
    with pytest.raises(error), regions[outer]():
        module(torch.randn(2, 2))
    assert _state_is_clean()
    assert torch.nn.Linear(2, 2)(torch.randn(1, 2)).dtype is F32
    with mixprec.autocast("cpu"):  # a later region runs the default policy
        assert torch.nn.functional.linear(torch.randn(1, 2), torch.randn(2, 2)).dtype is BF16
    handle.remove()
    assert "forward" not in module.__dict__


def _raising_in(kind, error):
    """Enter a region of ``kind`` and raise ``error`` inside it."""
    if kind == "region":
        with mixprec.autocast("cpu"):
            raise error()
    if kind == "policy-region":
        with mixprec.autocast("cpu", policy=RELU_FP32):
            raise error()
    if kind == "decorator":
        mixprec.autocast("cpu")(lambda: (_ for _ in ()).throw(error()))()
    if kind == "autocast-module":
        mixprec.AutocastModule(_Interrupts(error), "cpu")(torch.randn(2, 2))
    if kind == "install":
        with mixprec.install(LINEAR_FP32), torch.autocast("cpu"):
            raise error()


@pytest.mark.parametrize("error", INTERRUPTS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("kind", ["region", "policy-region", "decorator", "autocast-module", "install"])
def test_interrupts_restore_every_region_kind(kind, error):
    with pytest.raises(error):
        _raising_in(kind, error)
    assert _state_is_clean() and mixprec.engine._installation.current is None


def test_a_generator_closed_inside_a_region_restores_it():
    def tokens():
        with mixprec.autocast("cpu", policy=RELU_FP32):
            while True:
                yield torch.relu(torch.randn(2)).dtype

    stream = tokens()
    assert next(stream) is F32
    stream.close()  # GeneratorExit inside the region
    assert _state_is_clean()


def test_torch_save_of_an_autocast_module_after_it_ran():
    module = mixprec.AutocastModule(torch.nn.Linear(4, 4), "cpu", policy=LINEAR_FP32)
    assert module(torch.randn(2, 4)).dtype is F32
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    assert again(torch.randn(2, 4)).dtype is F32 and again.region._policy == LINEAR_FP32
    region = mixprec.autocast("cpu", dtype=torch.float16, compute="emulated")
    with region:
        pass
    copied = pickle.loads(pickle.dumps(region))
    assert repr(copied) == repr(region)


def test_a_pickled_region_keeps_the_cache_flag_it_read_as_torch_autocast_does():
    # One object serves a call that read cache_enabled=None as False and a later call that passed False: its
    # pickle gave None, read again as True on loading (torch's region keeps the flag it read).
    before = torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_cache_enabled(False)
        mixprec.autocast("cpu")
        theirs = torch.autocast("cpu")
        torch.set_autocast_cache_enabled(True)
        region = mixprec.autocast("cpu", cache_enabled=False)
        for again in (pickle.loads(pickle.dumps(region)), copy.deepcopy(region)):
            assert again._cache_enabled is False
            with again:
                assert not torch.is_autocast_cache_enabled()
        assert pickle.loads(pickle.dumps(theirs))._cache_enabled is False
    finally:
        torch.set_autocast_cache_enabled(before)


def test_a_model_with_module_policies_pickles_and_deep_copies():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mixprec.set_module_policy(model[1], "fp32")
    for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with mixprec.autocast("cpu"):
            assert again(torch.randn(2, 4)).dtype is F32
        assert again[1].forward.module is again[1]


def test_softmax_with_an_explicit_dtype_under_emulated_compute():
    policy = CPU.with_ops(lower_precision_fp=["softmax"])
    x = torch.randn(3, 5)
    with torch.autocast("cpu"):
        native = torch.softmax(x.bfloat16(), -1, dtype=F32)
    for compute in ("native", "emulated", "auto"):
        with mixprec.autocast("cpu", policy=policy, compute=compute):
            got = torch.softmax(x, -1, dtype=F32)
        assert got.dtype is native.dtype is F32
        assert torch.equal(got, native)


def test_plain_torch_autocast_after_mixprec_casts_as_native():
    program = """
        import torch, mixprec
        from torch.utils._python_dispatch import TorchDispatchMode
        class Count(TorchDispatchMode):
            def __init__(self): super().__init__(); self.n = 0
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.n += func is torch.ops.aten._to_copy.default
                return func(*args, **(kwargs or {}))
        def run():
            torch.manual_seed(0)
            lin = torch.nn.Linear(16, 16); x = torch.randn(4, 16)
            with torch.autocast("cpu"), Count() as count:
                y = x
                for _ in range(8):
                    y = lin(y)
            y.float().sum().backward()
            return count.n, lin.weight.grad
        USE_MIXPREC
        n, grad = run()
        print(n, grad.double().sum().item())
    """
    native = _fresh(program.replace("USE_MIXPREC", "pass"))
    emulated = "with mixprec.autocast('cpu', dtype=torch.float16, compute='emulated'): torch.mm(torch.ones(2, 2), x)"
    after = _fresh(program.replace("USE_MIXPREC", "x = torch.ones(2, 2)\n        " + emulated))
    assert after == native and native.startswith("3 ")


def test_plain_torch_autocast_caches_as_native_in_this_process_too():
    with mixprec.autocast("cpu", dtype=torch.float16, compute="emulated"):
        pass  # every lower_precision_fp op now has a mixprec kernel
    lin = torch.nn.Linear(8, 8)
    with torch.autocast("cpu"), CountCasts() as count:
        y = X
        for _ in range(8):
            y = lin(y)
    assert count.casts == 3  # the input, the weight and the bias: once each
    engine.reset()


@pytest.mark.parametrize(
    ("op", "policy", "inputs", "expected"),
    [
        ("mm", CPU, (F32, torch.float64), "raises"),
        ("index_copy", mixprec.policies.CUDA, (BF16, F32), "raises"),
        ("index_copy", mixprec.policies.XPU, (BF16, F32), "raises"),
        (torch.norm, mixprec.policies.CUDA_DOCUMENTED, (BF16,), BF16),
    ],
    ids=["mm-f32-f64", "index_copy-cuda", "index_copy-xpu", "torch.norm-cuda-documented"],
)
def test_explain_says_what_running_the_op_gives(op, policy, inputs, expected):
    why = mixprec.explain(op, "cpu", policy, input_dtypes=inputs)
    assert ("raises" if why.raises is not None else why.runs_in) == expected, why


torch.manual_seed(0)
LIN = torch.nn.Linear(8, 8)
X = torch.randn(4, 8)
