"""``MixprecPrecision``: Lightning's mixed precision under ``mixprec.autocast``.

``Trainer(precision="bf16-mixed")`` runs each step under ``torch.autocast``;
``Trainer(plugins=[MixprecPrecision(...)])`` runs it under ``mixprec.autocast``
with a policy and a compute choice, and float16 training scales the loss with
``mixprec.GradScaler``. Everything else (where the region opens, unscaling before
gradient clipping, skipping steps with non-finite gradients, the scaler's state in
checkpoints) is Lightning's ``MixedPrecision`` plugin, which this one extends.
Without the plugin, ``mixprec.install()`` gives the same regions mixprec's
behaviour. ``lightning`` is imported here only.

Examples:
    >>> import lightning as L
    >>> from mixprec.integrations.lightning import MixprecPrecision
    >>> plugin = MixprecPrecision(policy=mixprec.policies.CPU.with_ops(fp32=["linear"]))
    >>> trainer = L.Trainer(accelerator="cpu", plugins=[plugin], max_steps=1)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from mixprec import _autocast, _errors
from mixprec.engine import _devices
from mixprec.policies import Policy
from mixprec.scaler import GradScaler

_PRECISION: dict[torch.dtype, Literal["bf16-mixed", "16-mixed"]] = {
    torch.bfloat16: "bf16-mixed",
    torch.float16: "16-mixed",
}


class MixprecPrecision(MixedPrecision):  # type: ignore[misc]
    """Lightning precision plugin: each step under ``mixprec.autocast``.

    Args:
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        policy: The mixprec policy (the device's default if None).
        compute: ``"auto"``, ``"native"`` or ``"emulated"``, as for ``mixprec.autocast``.
        scaler: For float16, the loss scaler (a ``mixprec.GradScaler`` for the device if None).
            bfloat16 needs none and takes none.
        device: The autocast device type. None (the default) follows the trainer: the device type of the
            model once Lightning has moved it to its accelerator (``"cuda"`` on ``accelerator="gpu"``).
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        policy: Policy | None = None,
        compute: str = "auto",
        scaler: Any = None,
        device: str | None = None,
    ) -> None:
        if device is not None:
            _devices.spec(device)
        if not isinstance(dtype, torch.dtype) or dtype not in _PRECISION:
            raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
                _errors.message(
                    "MixprecPrecision: dtype is invalid",
                    "Lightning's mixed precision trains in bfloat16 or float16",
                    received={"dtype": dtype},
                    expected=["bfloat16", "float16"],
                )
            )
        # The same checks and errors as a region's (on the CPU until the trainer gives the device: ``connect``).
        _autocast.autocast(device or "cpu", dtype=dtype, policy=policy, compute=compute)
        bf16 = dtype is torch.bfloat16
        if scaler is not None and (bf16 or not isinstance(scaler, (GradScaler, torch.amp.GradScaler))):
            raise (ValueError if bf16 else TypeError)(
                _errors.message(
                    "MixprecPrecision: scaler is invalid",
                    "bfloat16 training needs no loss scaler" if bf16 else "float16 training scales the loss with it",
                    received={"scaler": scaler},
                    expected="None" if bf16 else "None, a mixprec.GradScaler or a torch.amp.GradScaler",
                )
            )
        self._scaler_made = scaler is None and dtype is torch.float16  # (remade for the device at ``connect``)
        if self._scaler_made:
            scaler = GradScaler(device or "cpu")
        super().__init__(_PRECISION[dtype], device, scaler)  # type: ignore[arg-type]  # (None until ``connect``)
        self.dtype, self.policy, self.compute = dtype, policy, compute

    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        """Lightning calls this once the model is on its accelerator: a plugin made with ``device=None`` takes
        the model's device type (and, for float16, a scaler for it)."""
        _errors.check_type("model", model, torch.nn.Module, what="MixprecPrecision.connect")
        if self.device is None:
            device = _device_type(model)
            _autocast.autocast(device, dtype=self.dtype, policy=self.policy, compute=self.compute)
            self.device = device
            if self._scaler_made:
                self.scaler = GradScaler(device)
        return super().connect(model, optimizers, lr_schedulers)

    def autocast_context_manager(self) -> _autocast.autocast:  # type: ignore[override]
        if self.device is None:
            raise RuntimeError(
                _errors.message(
                    "MixprecPrecision: no device yet",
                    "a plugin made with device=None takes the model's device when the Trainer sets it up, and "
                    "this region was asked for before",
                    fix="Pass the plugin to a Trainer, or give it device='cuda' (or 'cpu', ...).",
                )
            )
        # Lightning opens its regions without the cast cache; so does this plugin.
        return _autocast.autocast(
            self.device, dtype=self.dtype, cache_enabled=False, policy=self.policy, compute=self.compute
        )

    def __repr__(self) -> str:
        policy = "default" if self.policy is None else self.policy.name
        return (
            f"MixprecPrecision(dtype={self.dtype}, policy={policy}, compute={self.compute!r}, device={self.device!r})"
        )


def _device_type(model: Any) -> str:
    """The device type a model lives on: a LightningModule's ``device``, else its first parameter's, else the
    CPU (a model with no parameters or buffers)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device.type
    for tensor in (*model.parameters(), *model.buffers()):
        return str(tensor.device.type)
    return "cpu"
