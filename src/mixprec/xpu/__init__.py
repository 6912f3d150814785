"""The torch.xpu.amp namespace, as the AMP references name it."""

from mixprec.xpu import amp

__all__ = ["amp"]
