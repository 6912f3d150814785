"""fp8 training across ranks: DDP and FSDP2 on two gloo ranks, and delayed scaling's amaxes agreeing.

Two CPU ranks, spawned as in ``test_scaler_distributed``, train a small MLP under ``mixprec.policies.FP8``
with different data per rank. DDP and FSDP2 must keep the ranks' parameters equal and match a step computed
in one process from the two ranks' data (the mean of the two fp8 gradients). FSDP2 gathers each step's
weights into the same tensors and keeps their version counters, so this also checks that a weight's fp8
quantisation is not kept across an optimizer step there. Under delayed scaling with
``AmaxHistory(model, process_group="default")`` every rank holds the same history (the largest amax over
ranks); without a group (the negative control) the histories differ, as the data do.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import mixprec
from mixprec.engine import _amax
from test_scaler_distributed import _loopback_interface

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")

WORLD_SIZE = 2
STEPS = 3
JOIN_TIMEOUT_S = 90.0
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank + step)


def _policy(scaling: str) -> mixprec.Policy:
    return mixprec.policies.FP8.with_fp8_recipe(scaling=scaling, history=4)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, scaling: str) -> None:
    with mixprec.autocast("cpu", policy=_policy(scaling)):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def _train(case: str, scaling: str, agree: bool, resume: bool = False, evaluate: bool = False) -> dict[str, Any]:
    """``STEPS`` steps; with ``resume``, the last one in a model made again from the model, optimizer and amax
    histories saved before it (loaded before its first forward: FSDP2 has gathered nothing yet); with
    ``evaluate``, an evaluation after each step (``_evaluate``)."""
    if not resume:
        return _train_steps(case, scaling, agree, range(STEPS), None, evaluate)
    first = _train_steps(case, scaling, agree, range(STEPS - 1), None)
    mixprec.engine.reset()  # (as a new process: no history)
    return _train_steps(case, scaling, agree, range(STEPS - 1, STEPS), first)


def _evaluate(case: str, base: nn.Module, model: nn.Module, scaling: str) -> None:
    """An evaluation pass under inference_mode with data far larger than training's (from a generator of its own:
    rank 0's global RNG stays as in the plain run): under DDP on rank 0 alone, of the module DDP wraps (the usual
    pattern); under FSDP2 on every rank (its forward gathers the weights)."""
    if case == "ddp" and dist.get_rank() != 0:
        return
    with torch.inference_mode(), mixprec.autocast("cpu", policy=_policy(scaling)):
        (base if case == "ddp" else model)(torch.randn(16, 32, generator=torch.Generator().manual_seed(7)) * 1000)


def _train_steps(
    case: str, scaling: str, agree: bool, steps: range, start: dict[str, Any] | None, evaluate: bool = False
) -> dict[str, Any]:
    rank = dist.get_rank()
    base = _model()
    if case == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: nn.Module = DistributedDataParallel(base)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layer in base:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(base, mesh=mesh)
    history = mixprec.AmaxHistory(base, process_group="default" if agree else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if start is not None:
        base.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
        history.load_state_dict(start["amax"])
    for step in steps:
        _step(model, optimizer, _data(rank, step), scaling)
        if evaluate:
            _evaluate(case, base, model, scaling)
    return {"params": _full(model), "amax": history.state_dict(), "model": base.state_dict(),
            "optimizer": optimizer.state_dict()}  # fmt: skip


def _worker(
    rank: int, case: str, scaling: str, agree: bool, out_dir: str, resume: bool = False, evaluate: bool = False
) -> None:
    interface = _loopback_interface()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    rendezvous = f"file://{Path(out_dir) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    try:
        record = _train(case, scaling, agree, resume, evaluate)
        gc.collect()  # (the model is gone: so are the process groups its weights were given, _amax._group)
        left = torch.tensor(len(_amax._groups))
        torch.save({"params": record["params"], "amax": record["amax"], "groups_left": left},
                   Path(out_dir) / f"rank{rank}.pt")  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (see test_scaler_distributed: no interpreter teardown with gloo threads alive)


def _run(
    case: str, scaling: str, agree: bool, tmp_path: Path, resume: bool = False, evaluate: bool = False
) -> list[dict[str, Any]]:
    args = (case, scaling, agree, str(tmp_path), resume, evaluate)
    context = mp.start_processes(_worker, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{case}: the ranks did not finish within {JOIN_TIMEOUT_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]


def _reference(scaling: str) -> list[torch.Tensor]:
    """The data-parallel steps in one process: each rank's fp8 gradient on its own data, averaged."""
    mixprec.engine.reset()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD_SIZE):
            with mixprec.autocast("cpu", policy=_policy(scaling)):
                loss = model(_data(rank, step)).float().pow(2).mean()
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        for param, *per_rank in zip(model.parameters(), *grads, strict=True):
            param.grad = sum(per_rank) / WORLD_SIZE
        optimizer.step()
        optimizer.zero_grad()
    mixprec.engine.reset()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_fp8_data_parallel_training_matches_the_averaged_fp8_step(case: str, tmp_path: Path) -> None:
    records = _run(case, "tensorwise", agree=False, tmp_path=tmp_path)
    expected = _reference("tensorwise")
    for rank, record in enumerate(records):
        for ours, theirs in zip(record["params"], expected, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
    assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], records[1]["params"], strict=True))


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_delayed_amax_histories_agree_across_ranks_with_a_process_group(case: str, tmp_path: Path) -> None:
    """Under FSDP2 the sites are FSDP2's gathered weights, not the sharded parameters the model registers (which
    ``AmaxHistory`` is given): their group and their names are found through FSDP2."""
    records = _run(case, "delayed", agree=True, tmp_path=tmp_path)
    assert [int(r["groups_left"]) for r in records] == [0] * WORLD_SIZE  # (none kept by a freed weight's id)
    histories = [r["amax"] for r in records]
    assert sorted(histories[0]) == sorted(histories[1]) and histories[0]
    for key in histories[0]:  # (this step's pending amaxes are each rank's own until the next step reduces them)
        if not key.endswith(".amax_pending"):
            assert torch.equal(histories[0][key], histories[1][key]), key
    assert int(histories[0]["0.weight.amax_steps"]) == STEPS - 1
    assert all(torch.equal(a, b) for a, b in zip(records[0]["params"], records[1]["params"], strict=True))


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_without_a_process_group_delayed_histories_differ_between_ranks(case: str, tmp_path: Path) -> None:
    """Negative control for the test above: the ranks' data differ, so their own amaxes do."""
    records = _run(case, "delayed", agree=False, tmp_path=tmp_path)
    first, second = (r["amax"]["0.weight.amax_history"] for r in records)
    assert torch.equal(first[1], second[1])  # the weights are alike (DDP), so are their amaxes
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[2], second[2])  # inputs, gradients


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_delayed_training_resumes_from_saved_histories_across_ranks(case: str, tmp_path: Path) -> None:
    """A last step run in a model made again from what was saved before it, the histories loaded before its
    first forward (under FSDP2, before any gather made the weights its sites are keyed by), ends where the
    uninterrupted run ends: parameters and histories."""
    _ends_as_the_plain_run(case, tmp_path, resume=True)


def _ends_as_the_plain_run(case: str, tmp_path: Path, **variant: bool) -> None:
    """Delayed training with agreeing histories, plain and with ``variant`` (``_run``'s flags): the same
    parameters and histories on every rank."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "variant").mkdir()
    plain = _run(case, "delayed", agree=True, tmp_path=tmp_path / "plain")
    varied = _run(case, "delayed", agree=True, tmp_path=tmp_path / "variant", **variant)
    for a, b in zip(plain, varied, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert sorted(a["amax"]) == sorted(b["amax"]) and a["amax"]
        assert all(torch.equal(a["amax"][k], b["amax"][k]) for k in a["amax"]), (a["amax"], b["amax"])


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_an_evaluation_on_one_rank_or_all_waits_for_nothing_and_moves_no_history(case: str, tmp_path: Path) -> None:
    """An evaluation pass under inference_mode after each step, the last included: under DDP on rank 0 alone, which
    waited for ever (its first call after an optimizer step rolled the histories, a collective the other rank,
    done training, never joined), under FSDP2 on both ranks. Parameters and histories end as without it."""
    _ends_as_the_plain_run(case, tmp_path, evaluate=True)
