"""The torch.cpu.amp namespace, as the AMP references name it."""

from mixprec.cpu import amp

__all__ = ["amp"]
