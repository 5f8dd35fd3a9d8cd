"""The DDP comm hook that lets thinwire's optimizers run under PyTorch DDP.

Registered by :meth:`thinwire.optim.base.CommOptimizer.register_ddp`. While the
optimizer needs averaged gradients (LAMB always; 1-bit Adam / 1-bit LAMB during warmup)
the hook is DDP's own allreduce (divide by W, sum), in fp32 or, if asked, in fp16/bf16
(half the bytes), with byte accounting; DDP starts each bucket's exchange as soon as
its gradients are ready, so it overlaps the rest of the backward pass. After the freeze
it sends nothing and hands each rank its local gradients: the optimizer then exchanges
the compressed momentum itself, in one collective per step.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations.

from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.allreduce import average_bucket
from thinwire.compress.cast import cast_name

__all__ = ["OptimizerAwareHookState", "optimizer_aware_hook"]


class OptimizerAwareHookState:
    """Hook state: the optimizer whose stage decides whether gradients travel.

    Pickling drops the optimizer (and with it any process group); re-register the hook
    with :meth:`~thinwire.optim.base.CommOptimizer.register_ddp` after loading.
    """

    __slots__ = ("optimizer", "process_group", "wire_dtype")

    def __init__(self, optimizer: Any, wire_dtype: torch.dtype = torch.float32) -> None:
        self.optimizer = optimizer
        self.process_group = optimizer.process_group
        self.wire_dtype = wire_dtype

    def __getstate__(self) -> dict[str, Any]:
        return {"wire_dtype": str(self.wire_dtype).removeprefix("torch.")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizer = None
        self.process_group = None
        self.wire_dtype = getattr(torch, state.get("wire_dtype", "float32"))


def optimizer_aware_hook(
    state: OptimizerAwareHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    if state.optimizer is None or state.optimizer.needs_averaged_grads():
        wire = cast_name(state.wire_dtype)
        name = "ddp.allreduce" if wire == "fp32" else f"ddp.{wire}"
        return average_bucket(bucket.buffer(), state.process_group, state.wire_dtype, name)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
