"""Running a model only to look at it: what the run changes, put back afterwards.

``explain(model, example=...)`` and the doctor run the user's model for real (its forward, the doctor's
backward too), which moves state that training will read next: BatchNorm's running statistics and other
buffers, the random generators (dropout), the parameters' ``.grad`` and fp8's delayed amax histories. A look
must change none of it, so that training after it is training without it::

    before: each buffer's tensor and a copy of its values, each parameter's .grad, the generators' states,
            the amax histories (engine._amax.preserved)
    after:  the same tensors back in their modules (a forward may have replaced one) with those values, the
            same .grad objects (the example inputs' too), the generators and histories as they were
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.engine import _amax


@contextlib.contextmanager
def untouched(model: torch.nn.Module, inputs: Any = ()) -> Iterator[None]:
    """Run the block with ``model``'s buffers, gradients, the random generators and the amax histories put back
    as they were after it, whatever it did to them (an exception included); and the ``.grad`` of the leaf tensors
    in ``inputs`` (example inputs that require grad, which a backward fills)."""
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items()
               if b is not None]  # fmt: skip
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = [(p, p.grad) for p in model.parameters()]
    leaves = torch.utils._pytree.tree_flatten(inputs)[0]
    grads += [(t, t.grad) for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda), _amax.preserved():
            yield
    finally:
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)
        for param, grad in grads:
            param.grad = grad
