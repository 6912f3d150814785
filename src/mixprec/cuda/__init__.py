"""The torch.cuda.amp namespace, as the AMP references name it."""

from mixprec.cuda import amp

__all__ = ["amp"]
