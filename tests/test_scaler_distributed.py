"""GradScaler across ranks: every rank agrees on found_inf, so all ranks skip together.

Two gloo ranks on the CPU, spawned with torch.multiprocessing, train a tiny
model under ``mixprec.autocast`` + ``mixprec.GradScaler`` wrapped in DDP, FSDP1
or FSDP2. At one step an inf is planted in rank 1's gradient only, *after* the
wrapper's own gradient reduction (DDP's all-reduce, FSDP's reduce-scatter), so
only the scaler's found_inf agreement can make rank 0 skip too. Each worker
writes its skip flags, scales, whether its local parameters moved, and the full
(gathered) parameters to a file; the parent compares the ranks.

The same runs with an optimizer on torch's older ``grad_scaler=`` contract (apex's
fused optimizers), which asks the scaler for the inf checks inside its own step.

The negative control turns agreement off (``process_group=False``): the same
plant then makes only rank 1 skip. DDP replicas diverge; under FSDP the gathered
parameters stay alike across ranks but the step is torn (rank 0's shard moved,
rank 1's did not).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import mixprec

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")

WORLD_SIZE = 2
STEPS = 4
PLANT_STEP = 1  # the step whose gradient gets an inf, on rank 1 only
PLANT_RANK = 1
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2  # short, so in STEPS steps the scale both backs off and grows
JOIN_TIMEOUT_S = 60.0  # the whole spawn; a hang fails the test instead of hanging CI
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)  # a mismatched collective raises in the worker


# ------------------------------------------------------------------ worker side
def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp1(model: nn.Module, use_orig_params: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    # On the CPU FSDP1 needs device_id=torch.device("cpu"): with device_id=None and a CPU module,
    # torch 2.13 raises "FSDP needs a non-CPU accelerator device, but no accelerator device is detected."
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params)


def _fsdp2(model: nn.Sequential) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


_WRAPPERS: dict[str, Callable[[nn.Sequential], nn.Module]] = {
    "ddp": _ddp,
    "ddp-grad-scaler-kwarg": _ddp,  # with _ApexStyleSGD
    "fsdp1": lambda model: _fsdp1(model, use_orig_params=False),  # the optimizer sees the sharded FlatParameter
    "fsdp1-orig-params": lambda model: _fsdp1(model, use_orig_params=True),  # views into it; some empty per rank
    "fsdp2": _fsdp2,
}


class _ApexStyleSGD(torch.optim.Optimizer):
    """SGD on the ``grad_scaler=`` contract: it gets the inf checks from the scaler and skips by itself."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> None:  # type: ignore[override]
        found_inf = sum(grad_scaler._check_inf_per_device(self).values())  # agreed across ranks
        inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
        if found_inf.item():
            return
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad * inv_scale, alpha=-group["lr"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own storage: the local shard of a DTensor, else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _plant_inf(optimizer: torch.optim.Optimizer) -> None:
    """Write an inf into the first element of this rank's first non-empty local gradient."""
    with torch.no_grad():
        for param in _params(optimizer):
            if param.grad is not None and _local(param.grad).numel() > 0:
                _local(param.grad).view(-1)[0] = float("inf")
                return
    raise AssertionError("no local gradient to plant an inf in")


def _local_snapshot(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_local(p).detach().clone() for p in _params(optimizer)]


def _full_params(case: str, model: nn.Module) -> list[torch.Tensor]:
    """Every parameter in full (gathered from the shards), as plain CPU tensors."""
    if case.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    if case == "fsdp2":
        return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    return [p.detach().clone() for p in model.parameters()]


def _train(case: str, agree: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _WRAPPERS[case](_model())
    optimizer_cls = _ApexStyleSGD if case.endswith("grad-scaler-kwarg") else torch.optim.SGD
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    options: dict[str, Any] = {} if agree else {"process_group": False}
    scaler = mixprec.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, **options)
    torch.manual_seed(1 + rank)  # different data per rank, as in data-parallel training
    record: dict[str, Any] = {"skipped": [], "scale": [], "local_moved": [], "params": [_full_params(case, model)]}
    for step in range(STEPS):
        x = torch.randn(4, 8)
        optimizer.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()  # DDP all-reduces, FSDP reduce-scatters, here
        if step == PLANT_STEP and rank == PLANT_RANK:
            _plant_inf(optimizer)
        if step == 0:
            grads = [p.grad for p in _params(optimizer) if p.grad is not None]
            record["grad_types"] = sorted({type(g).__name__ for g in grads})
            record["local_grad_numel"] = sum(_local(g).numel() for g in grads)
        before = _local_snapshot(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the grad_scaler= contract is deprecated in torch
            scaler.step(optimizer)
        scaler.update()
        after = _local_snapshot(optimizer)
        record["skipped"].append(scaler.last_step_skipped)
        record["scale"].append(scaler.get_scale())
        record["local_moved"].append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        record["params"].append(_full_params(case, model))
    return record


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _worker(rank: int, case: str, agree: bool, out_dir: str) -> None:
    interface = _loopback_interface()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # gloo's own sockets on loopback too
    torch.set_num_threads(1)
    # Rendezvous through a file, not a TCP port picked beforehand: no race for the port with other processes.
    rendezvous = f"file://{Path(out_dir) / 'rendezvous'}"
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        record = _train(case, agree)
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The record is saved and every rank passed the barrier: leave without the interpreter's teardown, where a
    # gloo thread still being destroyed can abort the process ("terminate called without an active exception",
    # SIGABRT; seen once on 2.15 with FSDP1) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ parent side
def _run(case: str, agree: bool, tmp_path: Path) -> list[dict[str, Any]]:
    """Train on WORLD_SIZE spawned ranks and return each rank's record; fail, never hang, on a timeout."""
    context = mp.start_processes(
        _worker,
        args=(case, agree, str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        # join() raises with the worker's traceback if a rank fails, after terminating the others.
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{case}: the {WORLD_SIZE} ranks did not finish within {JOIN_TIMEOUT_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _check_wrapping(case: str, records: list[dict[str, Any]]) -> None:
    """The wrapper did what the case claims: DTensor grads for FSDP2, sharded grads for FSDP1 and 2."""
    full_numel = sum(p.numel() for p in records[0]["params"][0])
    for rank, record in enumerate(records):
        assert record["grad_types"] == (["DTensor"] if case == "fsdp2" else ["Tensor"]), f"rank {rank}"
        if case.startswith("ddp"):
            assert record["local_grad_numel"] == full_numel, f"rank {rank}"
        else:
            assert 0 < record["local_grad_numel"] < full_numel, f"rank {rank}: gradients are not sharded"


SKIPS = [step == PLANT_STEP for step in range(STEPS)]


@pytest.mark.parametrize("case", ["ddp", "ddp-grad-scaler-kwarg", "fsdp1", "fsdp1-orig-params", "fsdp2"])
def test_inf_on_one_rank_makes_every_rank_skip(case: str, tmp_path: Path) -> None:
    records = _run(case, agree=True, tmp_path=tmp_path)
    _check_wrapping(case, records)
    for rank, record in enumerate(records):
        assert record["skipped"] == SKIPS, f"rank {rank}"
        assert record["local_moved"] == [not skip for skip in SKIPS], f"rank {rank}"
    # growth_interval=2: finite, inf (back off), finite, finite (grow); the same on both ranks.
    expected_scales = [INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE]
    assert records[0]["scale"] == records[1]["scale"] == expected_scales
    for step in range(STEPS + 1):
        assert _equal(records[0]["params"][step], records[1]["params"][step]), f"ranks differ after step {step - 1}"
    params = records[0]["params"]
    assert [not _equal(params[step], params[step + 1]) for step in range(STEPS)] == [not skip for skip in SKIPS]


@pytest.mark.parametrize("case", ["ddp", "ddp-grad-scaler-kwarg", "fsdp1", "fsdp2"])
def test_without_agreement_only_the_planted_rank_skips(case: str, tmp_path: Path) -> None:
    """Negative control, proving the test above can fail: process_group=False turns agreement off."""
    records = _run(case, agree=False, tmp_path=tmp_path)
    assert records[0]["skipped"] == [False] * STEPS, "rank 0 skipped, without an inf of its own"
    assert records[0]["local_moved"] == [True] * STEPS
    assert records[1]["skipped"] == SKIPS
    assert records[1]["local_moved"] == [not skip for skip in SKIPS]
    assert records[0]["scale"] != records[1]["scale"]
    before, after = records[0]["params"][PLANT_STEP], records[0]["params"][PLANT_STEP + 1]
    if case.startswith("ddp"):
        # Each rank holds a full replica: rank 0 stepped, rank 1 did not, and they stay apart.
        assert _equal(records[0]["params"][PLANT_STEP], records[1]["params"][PLANT_STEP])
        for step in range(PLANT_STEP + 1, STEPS + 1):
            assert not _equal(records[0]["params"][step], records[1]["params"][step]), f"after step {step - 1}"
    else:
        # The gathered parameters agree across ranks, but the step is torn: they moved although
        # rank 1 skipped, because rank 0 stepped its shard and rank 1 did not (local_moved above).
        for step in range(STEPS + 1):
            assert _equal(records[0]["params"][step], records[1]["params"][step])
        assert not _equal(before, after)
