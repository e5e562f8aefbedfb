"""The optimizer and learning-rate schedule of a trained model (the policy; a critic has its own).

One function each, so every trained model gets its optimizer and schedule the same way from its
``OptimConfig``.
"""

from __future__ import annotations

import torch

from unirl.schema import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, what: str = "model") -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"the {what} has no trainable parameters")
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``cfg.warmup_steps`` optimizer steps, then constant."""
    warmup = cfg.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
