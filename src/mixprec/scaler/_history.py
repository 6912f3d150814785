"""The scaler's log: the scale after each update and whether a step was skipped.

Rows are written into a device buffer (no host sync per step; the buffer
doubles when full) and read back only when asked for.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """One ``update()``: its 1-based count, the scale it left, whether a step was skipped."""

    step: int
    scale: float
    skipped: bool


class History:
    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None
        self._count = 0

    def append(self, scale: torch.Tensor, skipped: torch.Tensor | bool) -> None:
        if self._rows is None or self._count == self._rows.shape[0]:
            grown = torch.empty((max(64, 2 * self._count), 2), dtype=torch.float32, device=scale.device)
            if self._rows is not None:
                grown[: self._count].copy_(self._rows)
            self._rows = grown
        row = self._rows[self._count]
        row[0].copy_(scale)
        if isinstance(skipped, torch.Tensor):
            row[1].copy_(skipped)
        else:
            row[1].fill_(float(skipped))
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def records(self) -> list[ScaleRecord]:
        """Every update, oldest first (one host sync)."""
        if self._rows is None:
            return []
        values = self._rows[: self._count].tolist()
        return [ScaleRecord(i + 1, scale, bool(skipped)) for i, (scale, skipped) in enumerate(values)]

    def events(self) -> list[ScaleRecord]:
        """Only the updates where the scale changed or a step was skipped."""
        out: list[ScaleRecord] = []
        previous: float | None = None
        for record in self.records():
            if record.skipped or (previous is not None and record.scale != previous):
                out.append(record)
            previous = record.scale
        return out
