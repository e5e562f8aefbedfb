"""The advantages stage: rewards on tokens (with the KL in the reward), the configured estimator over
the global batch, and its figures (``adv/*``).

Shapes: N samples of this process, N_all of all processes, T tokens or trained steps.
"""

from __future__ import annotations

import torch

from unirl.core import (ADVANTAGE_ESTIMATORS, estimate_advantages, group_stats, kl_penalized_rewards, kl_step_rewards,
                        reverse_kl_advantages, stepwise_advantages, token_scores, turn_token_rewards)
from unirl.env import Rollout
from unirl.trainer.context import RunState, StepContext
from unirl.trainer.distributed import gather_rows


def compute_advantages(ctx: StepContext, state: RunState, rollout: Rollout) -> dict[str, float]:
    """Advantages from ``rollout.rewards`` [N]: [N] (the same for every token / step of a sample) or [N, T] for
    estimators that work per token (``reinforce++-baseline`` whitens over tokens), stored in
    ``rollout.advantages`` (and ``rollout.rewards``; ``gae``'s returns, the critic's target, in
    ``rollout.returns``).

    With several processes the rewards, group ids and masks of all of them are gathered and the
    advantages (and their statistics: FlowGRPO's batch std, REINFORCE++'s whitening) computed over
    the global batch; each process keeps its own rows.

    The estimators see the rewards on tokens (``token_rewards``: each score on its sample's last
    trained token, minus the KL penalty when it is in the reward) and, as ``rewards``, their row sums
    (the scores themselves without the KL penalty); ``gae`` also the critic's values."""
    algo, acc, rewards = ctx.algo, ctx.accelerator, rollout.rewards
    mask = ctx.env.actions.loss_mask(rollout).bool()  # [N, T]
    # Group ids made unique across processes: local ids renumbered 0..k-1, then offset by rank (one
    # process: its ids as they are, the estimators take any integers).
    rank, n = acc.process_index, len(rollout)
    token_rewards, step_rewards, kl_metrics = _token_rewards(ctx, state, rollout, rewards, mask)  # [N, T], [N, T] or None
    all_token_rewards = gather_rows(acc, token_rewards)  # [N_all, T_max]
    all_rewards = all_token_rewards.sum(-1)  # [N_all]: the scores exactly, without a KL penalty
    all_values = None if rollout.values is None else gather_rows(acc, rollout.values)  # [N_all, T_max]
    if acc.num_processes > 1:
        local_ids = torch.unique(rollout.group_ids, return_inverse=True)[1]  # [N]
        all_ids = gather_rows(acc, local_ids + rank * n)  # [N_all]
    else:
        all_ids = rollout.group_ids  # [N]
    all_mask = gather_rows(acc, mask)  # [N_all, T_max]
    settings = dict(scale=algo.adv_scale, eps=algo.adv_eps, unbiased=algo.adv_std == "unbiased")
    if step_rewards is not None:  # algo.kl_in_reward=per_step: each step's advantage from its own column
        adv, returns = stepwise_advantages(algo.adv_estimator, gather_rows(acc, step_rewards), all_ids, all_mask,
                                           **settings), None  # [N_all, T_max]
    else:
        adv, returns = estimate_advantages(algo.adv_estimator, all_rewards, all_ids, mask=all_mask, **settings,
                                           token_rewards=all_token_rewards, values=all_values, gamma=algo.gamma,
                                           lam=algo.lam)
    if algo.adv_clip is not None:
        adv = adv.clamp(-algo.adv_clip, algo.adv_clip)
    distill_figures = {}
    if ctx.distill is not None:  # on-policy distillation: the reverse KL per token, alone or added
        adv, distill_figures = _with_distillation(ctx, rollout, adv, all_mask)
    stats = group_stats(all_rewards, all_ids)
    per_token = adv if adv.ndim == 2 else adv.unsqueeze(-1).expand(all_mask.shape)  # [N_all, T_max]
    local = adv[rank * n:(rank + 1) * n]  # every process has N samples here (before any drop)
    rollout.advantages = local[:, : mask.shape[1]] if local.ndim == 2 else local
    if returns is not None:
        rollout.returns = returns[rank * n:(rank + 1) * n, : mask.shape[1]]
    # Every figure in one host transfer: the masked means as sums over the mask, no boolean indexing.
    masked = torch.where(all_mask, per_token, 0.0)  # [N_all, T_max]
    count = all_mask.sum().clamp_min(1)
    names = ["adv/mean", "adv/abs_mean", *(f"adv/{k}" for k in stats), *distill_figures]
    figures = torch.stack([masked.sum() / count, masked.abs().sum() / count, *(v.float() for v in stats.values()),
                           *(v.float() for v in distill_figures.values())])
    return {**dict(zip(names, figures.tolist())), **kl_metrics}


def _with_distillation(ctx: StepContext, rollout: Rollout, outcome: torch.Tensor, all_mask: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The advantages [N_all, T_max] of on-policy distillation (``unirl.core.distill``) over the global
    batch: ``-distill.coef`` times the reverse KL of each trained token (the trainer's old log-probs, the
    weights that sampled, minus the teacher's), alone or plus the ``outcome`` advantages ([N_all] or
    [N_all, T_max]; ``distill.mode``); and the figures ``distill/reverse_kl`` (token mean) and
    ``distill/reverse_kl_seq`` (per sample)."""
    d, acc = ctx.distill, ctx.accelerator
    width = rollout.old_logp.shape[1]  # the rollout's T: its loss mask's width
    student = gather_rows(acc, rollout.old_logp.float())  # [N_all, T_max]
    teacher = gather_rows(acc, rollout.teacher_logp[:, :width].float())  # [N_all, T_max]
    adv, figures = reverse_kl_advantages(student, teacher, all_mask, coef=d.coef, discount=d.discount)
    if d.mode == "added":
        adv = adv + (outcome if outcome.ndim == 2 else outcome.unsqueeze(-1))  # [N_all, T_max]
    return adv, {f"distill/{k}": v for k, v in figures.items()}


def _token_rewards(ctx: StepContext, state: RunState, rollout: Rollout, rewards: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Rewards on tokens [N, T]: each score on its sample's last trained token (verl's
    ``token_level_scores``), and with ``algo.use_kl_in_reward`` minus ``beta * KL`` on every trained
    token (verl's ``apply_kl_penalty``: KL between the old policy and the reference, by ``env.kl``).
    Beta comes from the controller (``unirl.trainer.kl_control``), which then updates on the global
    batch's mean per-sequence KL; logged ``actor/reward_kl_penalty`` (that KL) and
    ``actor/reward_kl_penalty_coeff`` (the beta used). With ``algo.kl_in_reward: per_step`` also the rewards
    per step [N, T], ``score - beta * KL_t`` (``kl_step_rewards``), else None."""
    scores = token_scores(rewards.float(), mask)  # [N, T]
    if "turn_ends" in rollout.tensors:  # an environment's episodes: each turn's reward on its turn (unirl.core.turns)
        t = {k: rollout.tensors[k].to(mask.device) for k in ("turn_rewards", "turn_ends", "turn_discount")}
        restart = getattr(ADVANTAGE_ESTIMATORS.get(ctx.algo.adv_estimator), "restarts_at_observations", False)
        scores = turn_token_rewards(rewards.float(), t["turn_rewards"][:, : mask.shape[1]], t["turn_ends"][:, : mask.shape[1]],
                                    mask, gamma=t["turn_discount"], carry=not restart)  # [N, T]
    kl_ctrl = state.kl_ctrl
    if kl_ctrl is None:
        return scores, None, {}
    kl = ctx.env.actions.kl(rollout.old, rollout.ref).float()  # [N, T]
    beta = kl_ctrl.value
    penalised, sequence_kl = kl_penalized_rewards(scores, kl[:, : mask.shape[1]], mask, beta)  # [N, T], [N]
    per_step = kl_step_rewards(rewards.float(), kl[:, : mask.shape[1]], mask, beta) if ctx.algo.kl_in_reward == "per_step" else None
    everyone = gather_rows(ctx.accelerator, sequence_kl)  # [N_all]
    current_kl = everyone.mean().item()
    kl_ctrl.update(current_kl, n=len(everyone))
    return penalised, per_step, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
