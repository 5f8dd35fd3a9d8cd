"""The DDP comm hook that lets thinwire's optimizers run under PyTorch DDP.

Registered by :meth:`thinwire.optim.base.CommOptimizer.register_ddp`. While the
optimizer needs averaged gradients (LAMB always; 1-bit Adam / 1-bit LAMB during warmup)
the hook is DDP's own allreduce (divide by W, sum), with byte accounting. After the
freeze it sends nothing and hands each rank its local gradients: the optimizer then
exchanges the compressed momentum itself, in one collective per step.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations.

from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.allreduce import allreduce_hook

__all__ = ["OptimizerAwareHookState", "optimizer_aware_hook"]


class OptimizerAwareHookState:
    """Hook state: the optimizer whose stage decides whether gradients travel.

    Pickling drops the optimizer (and with it any process group); re-register the hook
    with :meth:`~thinwire.optim.base.CommOptimizer.register_ddp` after loading.
    """

    __slots__ = ("optimizer", "process_group")

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.process_group = optimizer.process_group

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizer = None
        self.process_group = None


def optimizer_aware_hook(
    state: OptimizerAwareHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    if state.optimizer is None or state.optimizer.needs_averaged_grads():
        return allreduce_hook(state.process_group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
