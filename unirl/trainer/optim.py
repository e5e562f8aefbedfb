"""The optimizer and learning-rate schedule of a trained model (the policy; a critic has its own).

One function each, so every trained model gets its optimizer and schedule the same way from its
``OptimConfig``.
"""

from __future__ import annotations

import math

import torch

from unirl.config.schema import OptimConfig

#: ``OptimConfig.lr_scheduler`` values: verl's ``lr_scheduler_type`` (constant, cosine) and TRL's
#: (transformers') ``linear``, the default of TRL's ``GRPOConfig``.
LR_SCHEDULERS = ("constant", "linear", "cosine")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, what: str = "model") -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"the {what} has no trainable parameters")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *,
                    total_steps: int | None = None) -> torch.optim.lr_scheduler.LRScheduler:
    """``cfg.lr_scheduler`` after a linear warm-up, over ``total_steps`` optimizer steps.

    A ``LambdaLR`` (its state, the step count, is saved with the checkpoint by Accelerate) whose
    factor of ``cfg.lr`` at optimizer step s is ``lr_factor(s, ...)``. ``total_steps`` is needed by
    ``linear``, ``cosine`` and ``warmup_ratio``; ``constant`` with ``warmup_steps`` works without it.
    """
    warmup = warmup_steps(cfg, total_steps)
    if cfg.lr_scheduler != "constant" and total_steps is None:
        raise ValueError(f"optim.lr_scheduler={cfg.lr_scheduler} needs the run's number of optimizer steps")
    total = total_steps if total_steps is not None else 0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, kind=cfg.lr_scheduler, warmup=warmup, total=total,
                                       min_ratio=cfg.min_lr_ratio))


def warmup_steps(cfg: OptimConfig, total_steps: int | None) -> int:
    """``cfg.warmup_steps``, or ``int(cfg.warmup_ratio * total_steps)`` (verl's rounding; TRL rounds up)."""
    if cfg.warmup_ratio > 0:
        if total_steps is None:
            raise ValueError("optim.warmup_ratio needs the run's number of optimizer steps")
        return int(cfg.warmup_ratio * total_steps)
    return cfg.warmup_steps


def lr_factor(step: int, *, kind: str, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The learning rate at optimizer step ``step`` (0-based) as a fraction of the peak.

    Warm-up (verl's ``get_constant/cosine_schedule_with_warmup``, transformers' schedules):
    ``step / warmup`` for ``step < warmup``, so the first step runs at 0. Then, with progress
    ``p = (step - warmup) / max(1, total - warmup)``:

    * ``constant``: 1.
    * ``linear``: ``min_ratio + (1 - min_ratio) * max(0, 1 - p)`` (transformers' linear decay at
      ``min_ratio=0``).
    * ``cosine``: ``max(min_ratio, min_ratio + (1 - min_ratio) * (1 + cos(pi p)) / 2)``, verl's
      half-cosine (``num_cycles=0.5``) down to ``min_lr_ratio``.
    """
    if kind not in LR_SCHEDULERS:
        raise ValueError(f"lr scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {kind!r}")
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * max(0.0, 1.0 - progress)
    return max(min_ratio, min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
