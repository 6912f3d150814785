"""Dynamic loss scaling: GradScaler and its update rule."""

from mixprec.scaler._grad_scaler import GradScaler, ScalerStateError
from mixprec.scaler._history import ScaleRecord

__all__ = ["GradScaler", "ScaleRecord", "ScalerStateError"]
