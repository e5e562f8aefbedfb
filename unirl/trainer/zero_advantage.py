"""FlowGRPO's zero-advantage drop (``algo.drop_zero_adv``): samples whose advantage is zero at every
token / step teach nothing, so they leave the update (FlowGRPO's ``train_sd3.py`` filters them the same
way before its inner epochs).
"""

from __future__ import annotations

import torch

from unirl.env import Rollout
from unirl.trainer.distributed import sum_over_processes


def drop_zero_advantage(trainer, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
    """Keep the samples with a non-zero advantage at some token/step, topped up with dropped ones (at
    random) until the kept count divides into the step's micro-batches per process (FlowGRPO: its
    per-process sampling batches), so the number of optimizer steps does not change and every
    micro-batch is equally full."""
    adv = rollout.advantages
    nonzero = adv.ne(0) if adv.ndim == 1 else adv.ne(0).any(dim=-1)  # [N]
    multiple = kept_multiple(trainer)
    count = int(nonzero.sum())
    target = count + (-count % multiple)
    if target == 0 and sum_over_processes(trainer.accelerator, count) > 0:
        target = multiple  # other processes train: this one must take part in every optimizer step
    if target > count:
        dropped = (~nonzero).nonzero().squeeze(-1)
        generator = torch.Generator().manual_seed(trainer.cfg.seed * 6_151 + trainer.step)
        nonzero[dropped[torch.randperm(len(dropped), generator=generator)[: target - count]]] = True
    kept = nonzero.nonzero().squeeze(-1)
    acc = trainer.accelerator
    total, kept_total = sum_over_processes(acc, len(rollout)), sum_over_processes(acc, len(kept))
    metrics = {"adv/dropped_frac": 1.0 - kept_total / total, "adv/kept": float(kept_total)}
    return rollout.select(kept), metrics


def kept_multiple(trainer) -> int:
    """What the kept count is a multiple of: the micro-batches of a step (B*G / micro_batch_size), or
    the mini-batches when micro-batches are packed by tokens."""
    cfg = trainer.cfg
    if cfg.micro_batch_tokens is not None:
        return trainer.num_mini_batches()
    return cfg.prompts_per_step * cfg.group_size // cfg.micro_batch_size
