"""Tensors of a model that may be sharded with FSDP2 (``trainer.strategy: fsdp2``), read whole.

What the environments and the rollout engines need of a sharded model (is it sharded, its parameters
back in their shards, a tensor or the state dict gathered whole, in buckets) without depending on the
trainer, which applies the sharding (``unirl.trainer.backends.fsdp2``). Every gather is a collective: all
processes call these in the same order.
"""

from __future__ import annotations

from typing import Iterator

import torch


def fsdp_unit(model: torch.nn.Module):
    """The FSDP2 unit that holds ``model``'s top-level parameters: the model itself, or the model a PEFT
    wrapper wraps (``unirl.trainer.backends.fsdp2.shard`` shards that one, since ``generate`` calls it past the
    wrapper); None when the model is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else None
    return inner if isinstance(inner, FSDPModule) else None


def is_sharded(model: torch.nn.Module) -> bool:
    return fsdp_unit(model) is not None


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter back in its shard. FSDP2 leaves the root's parameters (the
    embeddings, the head) gathered after a forward, expecting a backward to follow; after a no-grad
    forward (old log-probs, evaluation) they would stay whole, and ``state_dict()`` would hand out
    whole tensors. A model that is not sharded is returned as it is."""
    unit = fsdp_unit(model)
    if unit is not None:
        unit.reshard()
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every process (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_state(model: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``model``'s state dict in buckets of about ``bucket_bytes`` (at least one tensor, and whole
    blocks: a bucket closes at the first block boundary past the size), each tensor gathered whole: at most one bucket of gathered tensors is alive when the caller drops each
    bucket before taking the next. Every process must iterate it to the end (each gather is a
    collective, in the state dict's order)."""
    from torch.distributed.fsdp import FSDPModule

    # A bucket ends only between blocks: an inference engine fuses a block's weights (vLLM's qkv_proj,
    # gate_up_proj), and a reload that sees part of a fused weight would leave the rest unset.
    root = fsdp_unit(model)
    blocks = [name + "." for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not root]
    bucket: list[tuple[str, torch.Tensor]] = []
    size, group = 0, None
    for name, tensor in resharded(model).state_dict().items():
        here = max((b for b in blocks if name.startswith(b)), key=len, default=name)  # its innermost unit
        if bucket and size >= bucket_bytes and here != group:
            yield bucket
            bucket, size = [], 0
        group = here
        whole = full(tensor.detach())
        bucket.append((name, whole))
        size += whole.numel() * whole.element_size()
    if bucket:
        yield bucket
