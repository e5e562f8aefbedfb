"""FlowGRPO's zero-advantage drop (``algo.drop_zero_adv``): samples whose advantage is zero at every
token / step teach nothing, so they leave the update (FlowGRPO's ``train_sd3.py`` filters them the same
way before its inner epochs).
"""

from __future__ import annotations

import torch

from unirl.env import Rollout
from unirl.trainer.context import RunState, StepContext
from unirl.trainer.distributed import sum_over_processes


def drop_zero_advantage(ctx: StepContext, state: RunState, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
    """Keep the samples with a non-zero advantage at some token/step, topped up with dropped ones (at
    random) until the kept count divides into the step's micro-batches per process (FlowGRPO: its
    per-process sampling batches), so the number of optimizer steps does not change and every
    micro-batch is equally full."""
    adv = rollout.advantages
    nonzero = adv.ne(0) if adv.ndim == 1 else adv.ne(0).any(dim=-1)  # [N]
    multiple = kept_multiple(ctx)
    count = int(nonzero.sum())
    target = count + (-count % multiple)
    acc = ctx.accelerator
    if target == 0 and sum_over_processes(acc, count) > 0:
        target = multiple  # other processes train: this one must take part in every optimizer step
    if target > count:
        dropped = (~nonzero).nonzero().squeeze(-1)
        generator = torch.Generator().manual_seed(ctx.cfg.seed * 6_151 + state.step)
        nonzero[dropped[torch.randperm(len(dropped), generator=generator)[: target - count]]] = True
    kept = nonzero.nonzero().squeeze(-1)
    total, kept_total = sum_over_processes(acc, len(rollout)), sum_over_processes(acc, len(kept))
    metrics = {"adv/dropped_frac": 1.0 - kept_total / total, "adv/kept": float(kept_total)}
    return rollout.select(kept), metrics


def kept_multiple(ctx: StepContext) -> int:
    """What the kept count is a multiple of: the micro-batches of a step (B*G / micro_batch_size), or
    the mini-batches when micro-batches are packed by tokens."""
    cfg = ctx.cfg
    if cfg.micro_batch_tokens is not None:
        return ctx.num_mini_batches()
    return cfg.prompts_per_step * cfg.group_size // cfg.micro_batch_size


class ZeroAdvantageWatch:
    """Says so when a run has stopped learning: every advantage of the step was 0 (GRPO: every group's
    samples got the same reward, e.g. all 0 once a policy has collapsed), so the policy gradient is 0.

    ``observe`` adds ``adv/zero_adv_steps`` to each step's figures (the steps in a row whose every
    advantage was 0) and prints one warning line when that streak reaches ``WARN_AFTER``: the run goes on
    (a streak can end by chance, and a KL or entropy term still trains), but no longer silently."""

    #: Steps in a row before the warning: one zero step is common early on (a hard batch, all wrong).
    WARN_AFTER = 5

    def __init__(self):
        self.streak = 0

    def observe(self, metrics: dict[str, float], step: int, say) -> None:
        """Count step ``step``'s figures (``adv/abs_mean``, absent when the estimator logs none) and warn
        with ``say`` (the main process's print) once per streak."""
        if "adv/abs_mean" not in metrics:
            return
        self.streak = self.streak + 1 if metrics["adv/abs_mean"] == 0.0 else 0
        metrics["adv/zero_adv_steps"] = float(self.streak)
        if self.streak == self.WARN_AFTER:
            say(f"unirl: warning: step {step}: every advantage has been 0 for {self.streak} steps in a row (each group's "
                f"samples got the same reward; reward/mean {metrics.get('reward/mean', float('nan')):.3f}), so the policy "
                f"gradient is 0 and the run has stopped learning. Check the reward and the samples; more samples a "
                f"group (trainer.group_size), dynamic sampling (algo.filter_groups.enabled) or a lower optim.lr can "
                f"help, and an asynchronous run should keep source.bypass_mode on (docs/async.md)")
