"""Optimizers that communicate: LAMB, 1-bit Adam, 1-bit LAMB.

Each is a ``torch.optim.Optimizer`` that averages what it needs across the ranks of the
process group itself (one fused collective per step), or runs under PyTorch DDP via
:meth:`~thinwire.optim.base.CommOptimizer.register_ddp`.
"""

from thinwire.optim.amp import GradScaler
from thinwire.optim.base import CommOptimizer
from thinwire.optim.freeze import AutoFreeze
from thinwire.optim.lamb import Lamb
from thinwire.optim.onebit_adam import OneBitAdam
from thinwire.optim.onebit_lamb import OneBitLamb

__all__ = ["AutoFreeze", "CommOptimizer", "GradScaler", "Lamb", "OneBitAdam", "OneBitLamb"]
