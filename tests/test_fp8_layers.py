"""Which layers run in fp8: ``choose_fp8_layers``, ``explain(model, example=...)`` and ``mixprec policy layers``."""

from __future__ import annotations

import copy
import pathlib
import pickle

import pytest
import torch

import mixprec
from _cli import run
from mixprec.engine import _fp8

FP8 = mixprec.policies.FP8
WIDE = 64  # min_features in these tests: layers of 64 and more features are "large"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
        self.router = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) + self.router(x).softmax(-1).sum(-1, keepdim=True)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 64)
        self.first = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.narrow = torch.nn.Linear(64, 32)
        self.odd = torch.nn.Linear(64, 72 - 2)
        self.lm_head = torch.nn.Linear(64, 96, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.first(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h) + self.narrow(h).sum() + self.odd(h).sum()


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


IDS = torch.arange(32).reshape(2, 16) % 96


def test_the_helper_keeps_out_ends_embeddings_routers_unaligned_and_small_layers():
    model = _model()
    with mixprec.choose_fp8_layers(model, min_features=WIDE) as layers:
        why = {c.path: c.reason for c in layers.choices}
        assert layers.fp8 == ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down")
        assert why["first"] == "the first or last linear layer"
        assert why["lm_head"] == "its weight is an embedding's (tied)"
        assert "router" in why["blocks.0.router"] and "router" in why["blocks.1.router"]
        assert "below min_features=64" in why["narrow"]
        assert "not multiples of 16" in why["odd"]
        assert all(c.reason == "fp8" for c in layers.choices if c.fp8)
        assert "blocks.0.up" in str(layers) and "float8_e4m3fn" in str(layers)
    assert all("forward" not in m.__dict__ for m in model.modules())  # remove() took every module policy off


def test_kept_layers_run_in_the_region_dtype_and_chosen_ones_in_fp8():
    model = _model()
    x = torch.randn(32, 64)
    with mixprec.choose_fp8_layers(model, min_features=WIDE), mixprec.autocast("cpu", policy=FP8):
        kept = model.first(x)
        chosen = model.blocks[0].up(x)
    with mixprec.autocast("cpu", policy=mixprec.policies.CUDA):
        native_like = model.first(x)
    assert kept.dtype is chosen.dtype is torch.bfloat16
    assert torch.equal(kept, native_like)
    layer = model.blocks[0].up
    assert torch.equal(chosen, _fp8.linear(x, layer.weight, layer.bias, FP8.fp8_recipe, torch.bfloat16))


def test_the_default_size_threshold_keeps_small_models_out_of_fp8_entirely():
    layers = mixprec.choose_fp8_layers(_model())
    assert layers.fp8 == ()
    layers.remove()
    big = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))
    with mixprec.choose_fp8_layers(big) as layers:
        assert layers.fp8 == ("1",) and layers.kept == ("0", "2")
    with mixprec.choose_fp8_layers(big, keep_first_and_last=False) as layers:
        assert layers.fp8 == ("0", "1", "2")


def test_keep_patterns_keep_layers_and_modules_out_and_one_that_matches_nothing_is_an_error():
    model = _model()
    with mixprec.choose_fp8_layers(model, min_features=WIDE, keep=["blocks.1", "*.0.down"]) as layers:
        assert layers.fp8 == ("blocks.0.up",)
        reasons = {c.path: c.reason for c in layers.choices}
        assert reasons["blocks.1.up"] == "kept by keep='blocks.1'"
        assert reasons["blocks.0.down"] == "kept by keep='*.0.down'"
    with pytest.raises(ValueError, match=r"keep pattern 'block.1' matches no module.*blocks.1"):
        mixprec.choose_fp8_layers(model, keep="block.1")
    with pytest.raises(ValueError, match="matches no module"):
        mixprec.choose_fp8_layers(model, keep=["lm_head", "*.attn"])
    assert all("forward" not in m.__dict__ for m in model.modules())  # a refused call sets nothing


def test_a_layer_under_the_users_own_module_policy_is_left_to_it():
    model = _model()
    with mixprec.set_module_policy(model.blocks[1], "fp32"):
        layers = mixprec.choose_fp8_layers(model, min_features=WIDE)
        assert layers.fp8 == ("blocks.0.up", "blocks.0.down")
        assert {c.path: c.reason for c in layers.choices}["blocks.1.up"].startswith(
            "under the module policy set on blocks.1 (fp32)"
        )
        layers.remove()


def test_explain_lists_each_call_site_with_its_format_and_reason():
    model = _model()
    with mixprec.choose_fp8_layers(model, min_features=WIDE):
        sites = mixprec.explain(model, "cpu", FP8, dtype=torch.bfloat16, example=(IDS,))
        unaligned = mixprec.explain(model, "cpu", FP8, dtype=torch.bfloat16, example=(IDS[:, :15],))
    by_module = {s.module: s for s in sites}
    assert [s.module for s in sites] == [
        "first", "blocks.0.up", "blocks.0.down", "blocks.0.router", "blocks.1.up", "blocks.1.down",
        "blocks.1.router", "lm_head", "narrow", "odd",
    ]  # fmt: skip
    assert (by_module["blocks.0.up"].runs_in, by_module["blocks.0.up"].reason) == ("float8_e4m3fn", "fp8 (tensorwise)")
    assert by_module["blocks.0.up"].shape == "32 x 64 x 128"
    assert (by_module["first"].runs_in, by_module["first"].reason) == ("bfloat16", "the first or last linear layer")
    assert by_module["lm_head"].reason == "its weight is an embedding's (tied)"
    assert "blocks.1.down" in str(sites) and "fp8 (tensorwise)" in str(sites)
    up = next(s for s in unaligned if s.module == "blocks.0.up")
    assert up.runs_in == "bfloat16" and up.reason == "fp8 cannot run it: its GEMM is 30 x 64 x 128, not multiples of 16"
    rowwise = mixprec.explain(model, "cpu", FP8.with_fp8_recipe(scaling="rowwise"), example=(IDS,))
    assert {s.reason for s in rowwise if s.module != "odd"} == {"fp8 (rowwise)"}  # no helper: every aligned call
    with mixprec.set_module_policy(model.blocks[0], "fp32"):
        off = mixprec.explain(model, "cpu", FP8, example=(IDS,))
    assert {s.reason for s in off if s.module.startswith("blocks.0.")} == {"autocast is off here"}
    assert {s.runs_in for s in off if s.module.startswith("blocks.0.")} == {"float32"}


def test_a_copy_of_the_model_keeps_the_layers_and_their_reasons():
    """``copy.deepcopy`` and pickling keep the module policies the helper set, and with them the reason each
    kept layer gives in ``explain`` (it was "policy FP8: lower_precision_fp" on a copy); ``remove()`` on the
    original leaves the copy as it was."""
    model = _model()
    layers = mixprec.choose_fp8_layers(model, min_features=WIDE)
    def sites(of: torch.nn.Module) -> dict[str, tuple[str, str]]:
        return {s.module: (s.runs_in, s.reason) for s in mixprec.explain(of, "cpu", FP8, example=(IDS,))}

    original = sites(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert sites(copied) == original
    assert original["first"] == ("bfloat16", "the first or last linear layer")
    copied = copy.deepcopy(model)
    layers.remove()
    assert mixprec.explain(model, "cpu", FP8, example=(IDS,))[0].runs_in == "float8_e4m3fn"
    assert sites(copied) == original


def test_hugging_face_gpt2_conv1d_layers_are_chosen_and_its_tied_head_kept():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    with mixprec.choose_fp8_layers(model, min_features=WIDE) as layers:
        kinds = {c.path: c.kind for c in layers.choices}
        assert kinds["transformer.h.0.mlp.c_fc"] == "Conv1D"
        assert layers.kept == ("transformer.h.0.attn.c_attn", "lm_head")
        assert "tied" in layers.choices[-1].reason
        sites = mixprec.explain(model, "cpu", FP8, example=(IDS,))
    fc = next(s for s in sites if s.module == "transformer.h.1.mlp.c_fc")
    assert (fc.op, fc.shape, fc.runs_in) == ("addmm", "32 x 64 x 256", "float8_e4m3fn")


def test_the_cli_lists_layers_and_call_sites(capsys, tmp_path):
    target = tmp_path / "net.py"
    target.write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))\n"
        "    return net, (torch.randn(16, 2048),)\n"
    )
    result = run(capsys, "policy", "layers", f"{target}:build")
    assert result.code == 0, result.err
    assert "Layers (choose_fp8_layers, policy FP8)" in result.out
    rows = [line.split() for line in result.out.splitlines() if line.startswith(("0 ", "1 ", "2 "))]
    assert [r[:2] for r in rows[3:]] == [["0", "linear"], ["1", "linear"], ["2", "linear"]]
    assert rows[4][-3:] == ["float8_e4m3fn", "fp8", "(tensorwise)"]
    assert rows[3][-7:] == ["bfloat16", "the", "first", "or", "last", "linear", "layer"]
    everything = run(capsys, "policy", "layers", f"{target}:build", "--no-choose", "--policy", "FP8")
    assert everything.code == 0 and everything.out.count("fp8 (tensorwise)") == 3
    bad = run(capsys, "policy", "layers", f"{target}:nothing")
    assert bad.code == 2 and "has no attribute 'nothing'" in bad.err


def test_explain_with_an_example_changes_nothing_training_sees():
    """Looking before training is free of side effects: ``explain(model, example=...)`` runs the forward, in the
    model's mode, but puts back BatchNorm's statistics (a buffer it replaces too), the random generators (dropout
    drew from them) and the delayed amax histories (no amax of the example, no roll, no new site), so the steps
    after it equal the steps without it."""
    delayed = FP8.with_fp8_recipe(scaling="delayed", history=2)
    gen = torch.Generator().manual_seed(1)
    xs, target = [torch.randn(16, 64, generator=gen) for _ in range(4)], torch.randn(16, 16, generator=gen)

    class Replacing(torch.nn.Module):  # a forward that replaces its buffer with a new tensor
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = self.calls + 1
            return x

    def train(look: bool, train_steps: int = 4):  # type: ignore[no-untyped-def]
        mixprec.engine.reset()
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Dropout(0.2), Replacing(),
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16),
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        seen = []
        for step, x in enumerate(xs[:train_steps]):
            if look and step in (0, 2):  # before training, and between steps (a history rolled already)
                mixprec.explain(net, "cpu", delayed, example=(x * 10,))
            with mixprec.autocast("cpu", policy=delayed):
                loss = torch.nn.functional.mse_loss(net(x).float(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(loss.detach())
        history = mixprec.AmaxHistory(net).state_dict()
        return seen, [b.clone() for b in net.buffers()], history, torch.rand(3)

    plain, looked = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], looked[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], looked[1], strict=True))
    assert plain[2].keys() == looked[2].keys() and all(torch.equal(plain[2][k], looked[2][k]) for k in plain[2])
    assert torch.equal(plain[3], looked[3])
    mixprec.engine.reset()


def test_with_an_example_the_first_layers_are_every_one_reading_the_first_input():
    # q, k and v read the same normed input: all three are "first" in call order; registration order names q only.
    import importlib.util

    path = pathlib.Path(__file__).parent.parent / "examples" / "fp8_layers.py"
    spec = importlib.util.spec_from_file_location("_fp8_layers_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, inputs = example.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with mixprec.choose_fp8_layers(model, min_features=256) as by_registration:
        assert by_registration.kept == ("layers.0.q_proj", "lm_head")
    with mixprec.choose_fp8_layers(model, min_features=256, example=inputs) as by_calls:
        assert by_calls.kept == ("layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj", "lm_head")
        sites = mixprec.explain(model, "cpu", FP8, example=inputs)
        assert [s.runs_in for s in sites][:4] == ["bfloat16"] * 3 + ["float8_e4m3fn"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_with_an_example_a_sequential_chain_keeps_only_its_ends():
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    with mixprec.choose_fp8_layers(model, min_features=16, example=(torch.randn(8, 32),)) as layers:
        assert layers.kept == ("0", "3")
    with pytest.raises(TypeError, match="example"):
        mixprec.choose_fp8_layers(model, example=torch.randn(8, 32))


def _fp8_weights(model, *inputs):
    """The shapes of the weights that ran fp8 GEMMs in one forward under FP8."""
    seen = []

    def observe(call):
        if isinstance(call, _fp8.Fp8Call):
            seen.append(tuple(call.weight.shape))

    _fp8.observers.append(observe)
    try:
        with mixprec.autocast("cpu", policy=FP8):
            model(*inputs)
    finally:
        _fp8.observers.remove(observe)
    return seen


class _Attending(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mid = torch.nn.Linear(32, 32)
        self.mha = torch.nn.MultiheadAttention(32, 2, batch_first=True)

    def forward(self, x):
        x = self.mid(x)
        return self.mha(x, x, x)[0]


def test_a_multihead_attention_is_one_layer_kept_whole_and_explain_lists_its_projections():
    torch.manual_seed(0)
    model, x = _Attending(), torch.randn(2, 8, 32)
    with mixprec.choose_fp8_layers(model, min_features=16) as layers:
        assert [(c.path, c.kind, c.fp8) for c in layers.choices] == [
            ("mid", "Linear", False), ("mha", "MultiheadAttention", False)]
        assert _fp8_weights(model, x) == []  # its out_proj's forward never runs: the policy is on the attention
        sites = mixprec.explain(model, "cpu", FP8, example=(x,))
        assert [(s.module, s.op, s.runs_in) for s in sites] == [("mid", "linear", "bfloat16")] + [
            ("mha", "linear", "bfloat16")] * 2
    with mixprec.choose_fp8_layers(model, min_features=16, keep_first_and_last=False):
        assert sorted(_fp8_weights(model, x)) == [(32, 32), (32, 32), (96, 32)]
        assert [s.runs_in for s in mixprec.explain(model, "cpu", FP8, example=(x,))] == ["float8_e4m3fn"] * 3


def test_a_module_under_two_paths_gets_one_decision():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
    model.head = torch.nn.Linear(32, 32)
    model.alias = model.layers[1]  # registered after head: not the last layer
    model.forward = lambda x: model.head(torch.nn.Sequential(*model.layers)(x))
    x = torch.randn(16, 32)
    with mixprec.choose_fp8_layers(model, min_features=16) as layers:
        assert layers.kept == ("layers.0", "head")
        assert len(_fp8_weights(model, x)) == 3
    with mixprec.choose_fp8_layers(model, min_features=16, keep=["alias"]) as layers:
        assert layers.kept == ("layers.0", "layers.1", "head", "alias")
        assert len(_fp8_weights(model, x)) == 2


def test_explain_gives_a_model_only_its_own_kept_reasons():
    make = lambda: torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))  # noqa: E731
    chosen, other = make(), make()
    with mixprec.choose_fp8_layers(chosen, min_features=16):
        sites = mixprec.explain(other, "cpu", FP8, example=(torch.randn(16, 32),))
    assert [s.runs_in for s in sites] == ["float8_e4m3fn"] * 4


class _CrossAttending(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(64, 2)

    def forward(self, query, memory):
        return self.mha(query, memory, memory, need_weights=False)[0]


@pytest.mark.parametrize(("queries", "memories"), [(16, 8), (8, 16)])
def test_explain_lists_a_cross_attention_as_torch_runs_it(queries, memories):
    """A key that is the value but not the query: torch projects the query by the packed weight's first third
    and the key by the rest, two linears of their own sizes (explain listed one packed linear of the query)."""
    torch.manual_seed(0)
    model, query, memory = _CrossAttending(), torch.randn(queries, 1, 64), torch.randn(memories, 1, 64)
    sites = mixprec.explain(model, "cpu", FP8, example=(query, memory))
    in_fp8 = sorted(tuple(int(n) for n in s.shape.split(" x ")) for s in sites if s.runs_in == "float8_e4m3fn")
    assert [(m, n) for m, _, n in in_fp8] == sorted((m, n) for m, n in (
        (queries, 64), (memories, 128), (queries, 64)) if m % 16 == 0)  # fmt: skip
    assert len(sites) == 3 and sorted((n, k) for n, k in _fp8_weights(model, query, memory)) == sorted(
        (n, 64) for _, _, n in in_fp8)


class _Keywords(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.weight, self.bias = torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        if self.how == "linear":
            return torch.nn.functional.linear(input=x, weight=self.weight, bias=self.bias)
        if self.how == "matmul":
            return torch.matmul(x, other=self.weight)
        if self.how == "method":
            return x.matmul(other=self.weight)
        if self.how == "mm":
            return torch.mm(x, mat2=self.weight)
        return torch.addmm(self.bias, x, mat2=self.weight)


@pytest.mark.parametrize("how", ["linear", "matmul", "method", "mm", "addmm"])
def test_explain_reads_a_call_whose_arguments_are_named(how):
    model, x = _Keywords(how), torch.randn(16, 32)
    assert len(_fp8_weights(model, x)) == 1
    (site,) = mixprec.explain(model, "cpu", FP8, example=(x,))
    assert (site.runs_in, site.reason, site.shape) == ("float8_e4m3fn", "fp8 (tensorwise)", "16 x 32 x 32")


class _Two(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16, dtype=dtype)

    def forward(self, x):
        return self.lin(x), torch.mm(x, self.lin.weight.t().to(x.dtype))


@pytest.mark.parametrize(
    ("policy", "dtype", "input_dtype"),
    [
        (mixprec.policies.CPU, torch.float64, torch.float64),
        (mixprec.policies.CPU.with_ops(promote=["mm", "linear"]), torch.float32, torch.bfloat16),
        (FP8, torch.float64, torch.float64),
    ],
    ids=["float64", "promote", "fp8-float64"],
)
def test_explain_says_the_dtype_each_call_ran_in(policy, dtype, input_dtype):
    """'runs in' came from the table: a float64 call (autocast leaves float64 alone) was listed as bfloat16, and so
    was a promote linear of a bfloat16 input and a float32 weight, which runs in float32."""
    model, x = _Two(dtype), torch.randn(4, 16, dtype=input_dtype)
    with mixprec.autocast("cpu", policy=policy):
        ran = [str(t.dtype).removeprefix("torch.") for t in model(x)]
    assert [s.runs_in for s in mixprec.explain(model, "cpu", policy, example=(x,))] == ran


class _Residual(torch.nn.Module):
    def __init__(self, in_place):
        super().__init__()
        self.in_place = in_place
        self.inp, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.in_place:
                h += block(h)
            else:
                h = h + block(h)
        return self.out(h)


@pytest.mark.parametrize("in_place", [False, True], ids=["new-tensors", "in-place"])
def test_with_an_example_a_residual_stream_updated_in_place_keeps_only_the_ends(in_place):
    """``h += block(h)``: every block reads the memory the last layer reads, at an older version; all of them
    were kept out as 'last'."""
    model = _Residual(in_place)
    with mixprec.choose_fp8_layers(model, min_features=16, example=(torch.randn(16, 32),)) as layers:
        assert layers.kept == ("inp", "out")


def test_explain_lists_an_unbatched_self_attention_as_three_in_projections():
    """torch unsqueezes an unbatched query, key and value one by one, so they are no longer one tensor and it
    projects them by three linears (explain listed one packed linear)."""
    torch.manual_seed(0)
    model, x = _CrossAttending(), torch.randn(16, 64)
    sites = mixprec.explain(model, "cpu", FP8, example=(x, x))
    assert [(s.op, s.shape) for s in sites] == [("linear", "16 x 64 x 64")] * 4
    assert sorted(_fp8_weights(model, x, x)) == [(64, 64)] * 4
