"""mixprec.diagnostics: the recorder's module paths, source lines, dtypes and casts, against native autocast."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import mixprec
from _counting import CountCasts
from mixprec.diagnostics import CastCounter, Recorder, diagnose


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.inner(x)) * 2  # the recorded line


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Block())


def test_module_paths_are_named_modules():
    model, x = _model(), torch.randn(2, 4)
    with Recorder(model) as rec, mixprec.autocast("cpu", compute="native"):
        model(x)
    names = dict(model.named_modules())
    assert [r.module for r in rec.records] == ["0", "1.inner", "1", "1"]
    assert all(r.module in names for r in rec.records)


def test_source_is_the_users_line():
    model, x = _model(), torch.randn(2, 4)
    with Recorder(model) as rec, mixprec.autocast("cpu", compute="native"):
        model(x)
    lines, start = inspect.getsourcelines(Block.forward)
    line = start + next(i for i, text in enumerate(lines) if "the recorded line" in text)
    assert [r.source for r in rec.records[1:]] == [f"{__file__}:{line}"] * 3


def test_dtypes_and_casts_match_native():
    model, x = _model(), torch.randn(2, 4)
    with Recorder(model) as rec, mixprec.autocast("cpu", compute="native"):
        model(x)
    native = []
    hooks = [m.register_forward_hook(lambda m, i, o: native.append(o.dtype)) for m in model.modules()]
    with torch.autocast("cpu"):
        model(torch.randn(2, 4))
    for h in hooks:
        h.remove()
    assert rec.records[0].output_dtypes == [str(native[0]).removeprefix("torch.")]
    assert [r.casts for r in rec.records] == [3, 2, 0, 0]  # input, weight, bias; then weight, bias


class _SharedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        F = nn.functional
        return F.linear(x, self.weight), torch.mm(x, self.weight), F.linear(x, self.weight)


def test_a_weight_is_recorded_in_the_dtype_each_op_received_it():
    """The last linear gets the cached bfloat16 cast of the weight, not the float16 one the fp16-category mm made
    in between (only casts to the region's dtype are kept: the recorder once took any cast for the kept one)."""
    model, x = _SharedWeight(), torch.randn(8, 8)
    policy = mixprec.policies.CPU.with_ops(fp16=["mm"])
    with Recorder(model) as rec, mixprec.autocast("cpu", dtype=torch.bfloat16, policy=policy, compute="native"):
        model(x)
    assert [(r.op, r.input_dtypes, r.output_dtypes) for r in rec.records] == [
        ("torch.nn.functional.linear", ["bfloat16", "bfloat16"], ["bfloat16"]),
        ("torch.mm", ["float16", "float16"], ["float16"]),  # (torch's own name for it is torch.spmm)
        ("torch.nn.functional.linear", ["bfloat16", "bfloat16"], ["bfloat16"]),
    ]


def test_over_and_underflow_are_measured_in_the_dtype_the_op_returned():
    """An fp16-category op in a bfloat16 run returns float16, whose range is the narrow one: measured there."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    with torch.no_grad():
        layer.weight.mul_(1e-4)
        layer.bias.zero_()
    x = torch.randn(4, 64) * 1e-3
    policy = mixprec.policies.CPU.with_ops(fp16=["linear"])
    row = diagnose((layer, (x,), None), "cpu", torch.bfloat16, policy).rows[0]
    reference = layer(x).detach()
    flushed = float(((reference != 0) & (reference.half() == 0)).float().mean())
    assert row.output_dtypes == ["float16"] and flushed > 0.1
    assert (row.underflow_fraction, row.overflow_fraction) == (flushed, 0.0)


def test_cast_counter_matches_native_to_copy():
    model, x = _model(), torch.randn(2, 4)
    with CastCounter() as ours, mixprec.autocast("cpu", dtype=torch.float16, compute="native"):
        model(x)
    with CountCasts() as native, torch.autocast("cpu", dtype=torch.float16):
        model(x)
    assert ours.casts == native.casts == 5


def test_diagnose_healthy_model_has_small_errors():
    model = _model()
    diagnosis = diagnose((model, (torch.randn(8, 4),), lambda out: out.float().sum()), "cpu", torch.bfloat16)
    assert diagnosis.first is None and diagnosis.suggestion is None
    forward = [r for r in diagnosis.rows if r.phase == "forward"]
    assert all(r.max_rel_error is not None and r.max_rel_error < 2e-2 for r in forward)
    grads = {r.op for r in diagnosis.rows if r.phase == "backward"}
    assert grads == {f"grad of {n}" for n, _ in model.named_parameters()}


def test_gradient_rows_are_in_the_order_backward_made_them():
    """"The first row in execution order": the gradient rows follow backward (the last layer's first), not
    ``named_parameters`` (the first layer's first, which blamed the first layer for an overflow a later one
    made)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    diagnosis = diagnose((model, (torch.randn(8, 4),), lambda out: out.float().sum()), "cpu", torch.bfloat16)
    layers = [r.module for r in diagnosis.rows if r.phase == "backward"]
    assert list(dict.fromkeys(layers)) == ["4", "2", "0"] and len(layers) == 6


def test_dropout_masks_match_between_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    diagnosis = diagnose((model, (torch.randn(8, 16),), None), "cpu", torch.bfloat16)
    assert all(r.max_rel_error is not None and r.max_rel_error < 2e-2 for r in diagnosis.rows)


def test_an_in_place_op_that_overflows_is_named_the_first_to_make_an_inf():
    """The inputs' inf/NaN are counted as the op receives them: an in-place op writes its overflow into its
    input, and counted after the call it looked like an op that received infs, so a later op was named."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            h.mul_(1e5)  # overflows float16 here
            return torch.exp(h.float() * 0)

    torch.manual_seed(0)
    diagnosis = diagnose((InPlace(), (torch.randn(4, 8) * 3,), None), "cpu", torch.float16)
    assert diagnosis.first is not None and diagnosis.first.op == "torch.Tensor.mul_", diagnosis.first
    assert diagnosis.first.nonfinite_inputs == 0 and diagnosis.first.nonfinite_outputs > 0


def test_diagnose_runs_a_model_with_non_reentrant_checkpointing():
    """The doctor's inf/NaN counts run under no_grad: ``isfinite`` is composite, and under grad mode its ``abs``
    saved tensors inside a non-reentrant checkpoint, whose recompute then raised CheckpointError."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    diagnosis = diagnose((Checkpointed(), (torch.randn(4, 8),), lambda out: out.float().sum()), "cpu", torch.bfloat16)
    assert diagnosis.first is None and any(r.phase == "backward" for r in diagnosis.rows)


def test_diagnose_runs_a_model_that_writes_a_weights_view_under_no_grad():
    """A constraint written in place on part of a weight under no_grad (torch runs it): the recorder asked the
    view ``is_leaf``, which raises for such a view."""

    class Constrained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.lin.weight[:, 0].clamp_(-0.1, 0.1)
            return self.lin(x)

    torch.manual_seed(0)
    diagnosis = diagnose((Constrained(), (torch.rand(4, 8),), lambda out: out.sum()), "cpu", torch.float16)
    assert diagnosis.first is None


def test_an_overflow_in_loss_fn_is_named_there_and_the_suggestion_computes_the_loss_in_float32():
    """An op of ``loss_fn``'s own: the loss is counted with the outputs and gradients (an overflow there was
    reported as "fixes it" for a module policy the loss never runs under), the op is in module ``"(loss_fn)"``
    (it was in the model's ``""``), and the suggestion, which re-runs, is the loss in float32 (it was a module
    policy on the model, which left the inf)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.zero_()
    proj = torch.full((8, 8), 10.0)

    def loss_fn(out):
        return (out @ proj).square().mean()

    x = torch.rand(64, 8) + 1
    diagnosis = diagnose((model, (x,), loss_fn), "cpu", torch.float16)
    assert (diagnosis.nonfinite_reference, diagnosis.nonfinite_autocast) == (0, 1)
    assert diagnosis.first is not None and diagnosis.first.module == "(loss_fn)", diagnosis.first
    suggestion = diagnosis.suggestion
    assert suggestion is not None and suggestion.module == "(loss_fn)"
    assert (suggestion.fixes, suggestion.nonfinite_after) == (True, 0)
    with mixprec.autocast("cpu", dtype=torch.float16):  # the suggested code, as written, in the user's step
        output = model(x)
        scope = {"torch": torch, "loss_fn": loss_fn, "output": output}
        exec(suggestion.code, scope)
    assert scope["loss"].dtype is torch.float32 and bool(scope["loss"].isfinite())


def test_a_nan_sample_in_both_runs_does_not_hide_an_overflow_after_it():
    """One NaN sample in the batch reaches every op in both runs: the count alone ("its inputs held none") made
    no op the producer, so the doctor named the first layer, which only passed the NaN on, and its suggestion
    could never fix the run (the NaN stays under any policy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
        model[2].weight.fill_(2e3)  # (its output does not fit float16)
    x = torch.rand(4, 8) + 1
    x[0, 0] = float("nan")
    diagnosis = diagnose((model, (x,), None), "cpu", torch.float16)
    assert (diagnosis.nonfinite_reference, diagnosis.nonfinite_autocast) == (8, 32)
    assert diagnosis.first is not None and diagnosis.first.module == "2" and diagnosis.first.produced_nonfinite
    assert [r.produced_nonfinite for r in diagnosis.rows] == [False, False, True]
    suggestion = diagnosis.suggestion
    assert suggestion is not None and suggestion.module == "2"
    assert (suggestion.fixes, suggestion.nonfinite_after) == (True, 8)  # (float32's own: the NaN sample's row)


def test_an_overflow_written_by_indexed_assignment_is_named_there():
    """``h[:, 0] = big`` writes an inf into a float16 ``h``: ``__setitem__`` returns None, and the recorder, which
    kept calls with a floating output only, named the next op that read ``h``."""

    class Assigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h[:, 0] = x[:, 0] * 1e5  # (float32 here; 1e5 does not fit float16)
            return self.b(h)

    torch.manual_seed(0)
    diagnosis = diagnose((Assigns(), (torch.rand(4, 8) + 1,), None), "cpu", torch.float16)
    assert diagnosis.first is not None and diagnosis.first.op == "torch.Tensor.__setitem__", diagnosis.first
    assert diagnosis.first.produced_nonfinite


def test_a_mask_float32_holds_too_does_not_hide_a_gradient_overflow():
    """A causal ``-inf`` mask is inf/NaN in float32 too: the forward still counts as clean for the gradient rows
    (any inf/NaN in a forward row made every gradient row 'inherited', and the mask was named)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = x @ x.transpose(-1, -2) / 100
            scores = scores + torch.full((x.shape[0], x.shape[0]), float("-inf")).triu(1)
            return self.head(torch.softmax(scores.float(), -1) @ x)

    torch.manual_seed(0)
    target = (Masked(), (torch.rand(512, 8) * 10,), lambda out: (out.float() * 100).sum())
    diagnosis = diagnose(target, "cpu", torch.float16)  # (head.weight's gradient overflows float16)
    assert diagnosis.first is not None and diagnosis.first.op == "grad of head.weight", diagnosis.first
    assert diagnosis.suggestion is not None
    assert diagnosis.suggestion.code == 'mixprec.set_module_policy(model.head, "fp32")'


def test_the_suggested_code_reaches_the_module_whatever_its_name():
    """The suggestion is Python that runs: a ModuleDict's key by subscript (``model.blocks[1]`` for a key "1" was
    a KeyError), a name no attribute can spell through ``get_submodule`` (``model.attn-1`` was a syntax error)."""
    from mixprec.diagnostics._doctor import _code

    model = nn.Module()
    model.blocks = nn.ModuleDict({"1": nn.Linear(2, 2), "attn-1": nn.Sequential(nn.Linear(2, 2)), "for": nn.ReLU()})
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    model.add_module("class", nn.Linear(2, 2))
    assert _code(model, "blocks.1") == """mixprec.set_module_policy(model.blocks['1'], "fp32")"""
    for path in ("blocks.1", "blocks.attn-1.0", "blocks.for", "layers.0", "class", ""):
        code = _code(model, path)
        expression = code.removeprefix("mixprec.set_module_policy(").removesuffix(', "fp32")')
        assert eval(expression, {"model": model}) is model.get_submodule(path), code


def test_diagnose_leaves_the_model_as_it_found_it():
    """The doctor's runs move no buffer (BatchNorm's statistics), gradient, random generator or amax history:
    training after it is training without it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.2), nn.Linear(16, 4)).train()
    marker = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = marker
    buffers = [b.clone() for b in model.buffers()]
    x = torch.randn(8, 16, requires_grad=True)  # (an input that requires grad: its .grad is put back too)
    state = torch.get_rng_state()
    diagnose((model, (x,), lambda out: out.float().sum()), "cpu", torch.float16)
    assert x.grad is None
    assert model[0].weight.grad is marker and torch.equal(marker, torch.full_like(marker, 7.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert torch.equal(state, torch.get_rng_state())


def test_an_inf_float32_makes_too_is_not_blamed_on_autocast():
    """An op whose inf/NaN the float32 run makes as well did not produce it under autocast: when every inf/NaN
    is such, the doctor names where they appear but suggests no module policy (none can fix it) and says so."""

    class Log(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.lin(x) * 0)  # -inf in float32 as in float16

    torch.manual_seed(0)
    diagnosis = diagnose((Log(), (torch.randn(4, 8),), None), "cpu", torch.float16)
    assert diagnosis.nonfinite_reference == diagnosis.nonfinite_autocast > 0
    assert diagnosis.first is not None and not diagnosis.first.produced_nonfinite
    assert diagnosis.suggestion is None
