"""``trainer.strategy: ddp`` (the default): the whole model on every process; with several processes
Accelerate wraps it in DistributedDataParallel, which all-reduces (averages) the gradients in the last
backward of each mini-batch (``Backend.hold_gradients`` holds the others back)."""

from __future__ import annotations

from unirl.trainer.backends.base import Backend, register_backend


@register_backend("ddp")
class DDPBackend(Backend):
    name = "ddp"
