"""Training parity with torch.amp on the GPU, bit for bit: a 2-layer GPT-2 and a transformer encoder, 20 steps.

Each case trains the same model from the same seed twice: with ``torch.autocast`` and ``torch.amp.GradScaler``
(native), and with ``mixprec.autocast`` and ``mixprec.GradScaler`` (default settings: torch's). The losses,
the final parameters and the scale after every step must be equal. The cases:

* float16 with a GradScaler and AdamW, with an inf planted in a gradient at two steps (the scaler skips them);
* float16 with a GradScaler and fused AdamW;
* float16 with a GradScaler and SGD with momentum;
* bfloat16 without a scaler, AdamW;

each also with every overload torch registers at the Autocast key given a mixprec kernel (``kernels``), so
that mixprec's Python kernels run every autocast op, not torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

import mixprec
from mixprec import engine
from mixprec.engine import _kernels, _tables

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

STEPS = 20
PLANTED = (4, 11)  # steps whose gradient gets an inf (cases with a scaler)


class Case(NamedTuple):
    dtype: torch.dtype
    scaler: bool
    optimizer: str  # "adamw", "fused_adamw", "sgd"
    planted: bool = False


CASES = {
    "fp16-scaler-adamw-planted-inf": Case(torch.float16, True, "adamw", planted=True),
    "fp16-scaler-fused-adamw": Case(torch.float16, True, "fused_adamw"),
    "fp16-scaler-sgd-momentum": Case(torch.float16, True, "sgd"),
    "bf16-adamw": Case(torch.bfloat16, False, "adamw"),
}


class Run(NamedTuple):
    losses: list[torch.Tensor]
    params: list[torch.Tensor]
    scales: list[float]


def _gpt2(device: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module, Any], torch.Tensor], list[Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config).to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (4, 32), generator=gen).to(device) for _ in range(STEPS)]
    return model, lambda m, ids: m(input_ids=ids, labels=ids).loss, batches


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def _encoder(device: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module, Any], torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    model = _Encoder().to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 16, 64, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
        for _ in range(STEPS)
    ]
    return model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), batches


MODELS = {"gpt2": _gpt2, "encoder": _encoder}


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, fused=name == "fused_adamw" or None)


@contextlib.contextmanager
def _every_native_op_as_mixprec_kernel(device: str) -> Iterator[None]:
    _kernels.register(_tables.autocast_key(device), device, frozenset(_tables.native(device)))  # type: ignore[arg-type]
    try:
        yield
    finally:
        engine.reset()


def _mixprec(case: Case, device: str) -> dict[str, Any]:
    """``mixprec.autocast``'s arguments: the defaults on the GPU; on a CPU (running these tests without a GPU)
    ``compute="native"``, since ``"auto"`` may emulate a dtype the CPU has no fast kernels for."""
    return {"dtype": case.dtype} if device == "cuda" else {"dtype": case.dtype, "compute": "native"}


def _train(model_name: str, case: Case, device: str, native: bool) -> Run:
    model, loss_of, batches = MODELS[model_name](device)
    optimizer = _optimizer(case.optimizer, model.parameters())
    scaler: Any = None
    if case.scaler:
        scaler = torch.amp.GradScaler(device) if native else mixprec.GradScaler(device)
    first = next(model.parameters())
    losses, scales = [], []
    arguments = {"dtype": case.dtype} if native else _mixprec(case, device)
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with (torch.autocast if native else mixprec.autocast)(device, **arguments):
            loss = loss_of(model, batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if case.planted and step in PLANTED:
            first.grad.view(-1)[0] = float("inf")
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            optimizer.step()
        losses.append(loss.detach().float().cpu())
    return Run(losses, [p.detach().cpu() for p in model.parameters()], scales)


def _differences(native: Run, ours: Run) -> list[str]:
    losses = enumerate(zip(native.losses, ours.losses, strict=True))
    params = enumerate(zip(native.params, ours.params, strict=True))
    found = [f"loss at step {i}" for i, (a, b) in losses if not torch.equal(a, b)]
    found += [f"parameter {i}" for i, (a, b) in params if not torch.equal(a, b)]
    if native.scales != ours.scales:
        found.append(f"scales {native.scales} vs {ours.scales}")
    return found


@pytest.mark.parametrize("kernels", [False, True], ids=["default", "kernels"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_training_matches_torch_amp_bit_for_bit(model_name, case, kernels, device, deterministic):
    native = _train(model_name, CASES[case], device, native=True)
    again = _train(model_name, CASES[case], device, native=True)
    assert not _differences(native, again), "native torch.amp is not reproducible here, so parity cannot be judged"
    forced = _every_native_op_as_mixprec_kernel(device) if kernels else contextlib.nullcontext()
    with forced:
        ours = _train(model_name, CASES[case], device, native=False)
    assert not _differences(native, ours), _differences(native, ours)
    if CASES[case].planted:  # the planted steps were skipped: the scale backed off there
        assert ours.scales[PLANTED[0]] < ours.scales[PLANTED[0] - 1]
    assert all(torch.isfinite(p).all() for p in ours.params)
