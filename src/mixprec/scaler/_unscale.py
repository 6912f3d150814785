"""Unscaling an optimizer's gradients and checking them for inf/NaN, with torch's fused kernel; and what an
optimizer handed to GradScaler must offer.

Kept apart from the per-iteration state machine in ``_grad_scaler``, which calls these.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mixprec import _errors
from mixprec.scaler import _distributed


def unscale_grads(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
    process_group: object | None,
) -> dict[torch.device, torch.Tensor]:
    """Multiply the optimizer's grads by ``inv_scale`` in place, grouped by device and dtype; return one
    found_inf flag per device (a copy of ``found_inf``, set where a grad held an inf or NaN), agreed across
    the ranks of ``process_group``."""
    grouped: defaultdict[torch.device, defaultdict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype is torch.float16:
                    raise ValueError(
                        _errors.message(
                            "GradScaler cannot unscale float16 gradients",
                            "unscaling them in float16 loses the range that loss scaling protects; "
                            "keep parameters (and so gradients) in float32 and let autocast choose op dtypes",
                            received={"grad dtype": param.grad.dtype},
                            fix="If float16 gradients are intended, pass GradScaler(..., allow_fp16_grads=True).",
                        )
                    )
                grad = _distributed.local(param.grad)
                if grad.is_sparse:
                    # A sparse gradient may hold duplicate indices whose sum overflows: coalesce first.
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grouped[grad.device][grad.dtype].append(grad)
        per_device: dict[torch.device, torch.Tensor] = {}
        for device, per_dtype in grouped.items():
            device_found_inf = found_inf.to(device, copy=True) if device != found_inf.device else found_inf.clone()
            device_inv_scale = inv_scale.to(device)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, device_found_inf, device_inv_scale)
            per_device[device] = device_found_inf
    if not per_device and _distributed.active(process_group):
        # No local grads on this rank (e.g. an empty FSDP shard): still join the all-reduce, as
        # torch's ShardedGradScaler does. Without ranks to agree with, torch records nothing and
        # step() raises.
        per_device[found_inf.device] = found_inf.clone()
    for device_found_inf in per_device.values():
        _distributed.agree(device_found_inf, process_group, via=found_inf.device)
    return per_device


def check_optimizer(method: str, optimizer: object, enabled: bool) -> None:
    """An enabled scaler needs the optimizer's param_groups and step(); a disabled one, as torch's, only step()."""
    if not callable(getattr(optimizer, "step", None)):
        why = "it has no step()"
    elif enabled and not hasattr(optimizer, "param_groups"):
        why = "it has no param_groups, which an enabled scaler unscales"
    else:
        return
    raise TypeError(
        _errors.message(
            f"GradScaler.{method}() cannot use this optimizer",
            why,
            received={"optimizer": optimizer},
            expected="a torch.optim.Optimizer" if enabled else "an optimizer (any object with a step() method)",
        )
    )


def has_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any of the optimizer's parameters has a gradient."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
