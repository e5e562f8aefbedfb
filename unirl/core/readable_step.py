"""One GRPO/PPO policy-gradient step in plain tensor code, to read top to bottom (CleanRL's ``ppo.py``
and nanochat's ``scripts/chat_rl.py`` are the models). The trainer does the same arithmetic through
``unirl.trainer`` and the registered losses; ``tests/test_readable_step.py`` holds the two equal.

What this simplifies, compared with the trainer:

* one micro-batch on one process: no gradient accumulation, no global normaliser, no column pieces;
* GRPO's group advantages with the group std (``algo.adv_scale: group``, unbiased std) only;
* per-token loss averaged over all trained tokens (``algo.loss_agg: token-mean``) only;
* the KL to the reference is k3 (Schulman's ``(r - 1) - log r`` with r = p_ref / p), unclamped;
* no rollout-correction weights, entropy bonus, GSPO, critic or KL in the reward.

Shapes: N = B*G samples (B prompts, G samples each), T response tokens.
"""

from __future__ import annotations

import torch


def grpo_step_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
                   rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *,
                   clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                   eps: float = 1e-6) -> torch.Tensor:
    """The loss of one GRPO/PPO step; ``loss.backward()`` gives the policy gradient.

    Args:
        logp: [N, T] log-probs of the sampled tokens under the policy being trained (with gradients).
        old_logp: [N, T] the same under the policy that sampled them (PPO's "old" policy).
        ref_logp: [N, T] the same under the frozen reference, or None without a KL penalty.
        rewards: [N] one scalar reward per sample.
        group_ids: [N] samples with the same id answer the same prompt.
        mask: [N, T] True on the trained (response) tokens.
    """
    mask = mask.bool()
    # 1. Group-relative advantages (DeepSeekMath, https://arxiv.org/abs/2402.03300): each reward
    #    minus its group's mean, divided by its group's std.
    adv = torch.zeros_like(rewards, dtype=torch.float32)  # [N]
    for g in group_ids.unique():
        members = group_ids == g
        r = rewards[members].float()
        std = r.std() if len(r) > 1 else torch.zeros(())
        adv[members] = (r - r.mean()) / (std + eps)
    adv = adv.unsqueeze(-1)  # [N, 1]: the same advantage on every token of a sample

    # 2. PPO's clipped surrogate (https://arxiv.org/abs/1707.06347) per token, with the ratio of the
    #    current to the old policy; clip_high > clip_low is DAPO's clip-higher.
    ratio = torch.exp(torch.where(mask, logp - old_logp.detach(), 0.0))  # [N, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # [N, T]: the pessimistic of the two

    # 3. The KL penalty to the reference, k3 (http://joschu.net/blog/kl-approx.html).
    if ref_logp is not None and kl_coef > 0:
        log_r = torch.where(mask, ref_logp.detach() - logp, 0.0)  # [N, T]
        kl = torch.expm1(log_r) - log_r
    else:
        kl = torch.zeros_like(per_token)

    # 4. Mean over every trained token of the batch (token-mean: DAPO's aggregation).
    count = mask.sum().clamp_min(1)
    policy = torch.where(mask, per_token, 0.0).sum() / count
    return policy + kl_coef * torch.where(mask, kl, 0.0).sum() / count
