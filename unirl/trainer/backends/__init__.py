"""Training backends: how a model is laid out over the processes and how its gradients, optimizer steps and
state move, behind one contract (``Backend``), chosen by ``trainer.strategy`` from a registry.

* ``ddp`` (``unirl/trainer/backends/ddp.py``): every process holds the whole model; Accelerate wraps it in
  DistributedDataParallel with several processes (gradients all-reduced in the last backward of a mini-batch).
* ``fsdp2`` (``unirl/trainer/backends/fsdp2.py``): unirl shards each transformer block with PyTorch's
  ``fully_shard``; each process keeps 1/N of the parameters, gradients and AdamW state.

The actor's and the critic's updates both go through ``hold_gradients`` / ``backward`` / ``clip_and_step``;
the weight sync and the export read ``full_state``; checkpoints save and load **named** objects through
``save_state`` / ``load_state`` (``unirl.trainer.checkpoints``). A new backend: a class with these methods,
``@register_backend("name")``, and ``trainer.strategy: name`` (docs/architecture.md; tests/test_backends.py
registers one). Nothing outside this package tests ``trainer.strategy``.
"""

from __future__ import annotations

from unirl.trainer.backends.base import BACKENDS, Backend, register_backend


def build_backend(accelerator, trainer_cfg) -> Backend:
    """The backend of ``trainer.strategy``, set up on ``accelerator``."""
    from unirl.trainer.backends import ddp, fsdp2  # noqa: F401 (register the shipped ones)

    return BACKENDS.get(trainer_cfg.strategy)(accelerator, trainer_cfg)


def check_backend(name: str, mixed_precision: str = "no") -> None:
    """Raise ``ValueError`` naming ``strategy`` unless ``name`` is a registered backend that takes
    ``mixed_precision`` (checked where the config loads)."""
    from unirl.trainer.backends import ddp, fsdp2  # noqa: F401

    if name not in BACKENDS:
        raise ValueError(f"trainer.strategy: {BACKENDS.unknown_message(name)}")
    refused = getattr(BACKENDS.get(name), "refuses_mixed_precision", {}).get(mixed_precision)
    if refused:
        raise ValueError(f"trainer.mixed_precision={mixed_precision} with trainer.strategy={name}: {refused}")


def uses_sharding(trainer_cfg) -> bool:
    """Whether ``trainer.strategy`` shards the models (settings that need whole models refuse it)."""
    from unirl.trainer.backends import ddp, fsdp2  # noqa: F401

    return getattr(BACKENDS.get(getattr(trainer_cfg, "strategy", "ddp")), "shards", False)


__all__ = ["BACKENDS", "Backend", "build_backend", "check_backend", "register_backend", "uses_sharding"]
