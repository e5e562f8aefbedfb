"""Rewards on tokens, and the advantage estimators that read them: GAE (PPO with a critic) and plain
REINFORCE++ (discounted returns).

Legend: N = B*G samples, T tokens (text) or trained denoising steps (diffusion). ``mask`` [N, T]
marks the trained positions; in a multi-turn response it may have holes (observation tokens).

An outcome reward is one number a sample; PPO's estimators read it placed on the sample's last
trained position (verl's ``token_level_scores``), optionally with a per-token KL penalty against the
reference policy subtracted (verl's ``apply_kl_penalty``; Ziegler et al. 2019,
https://arxiv.org/abs/1909.08593). The estimators here follow the registry contract of
``unirl/core/advantages.py``.
"""

from __future__ import annotations

import torch

from unirl.core.advantages import ADVANTAGE_ESTIMATORS, check_mask, estimate_advantages, masked_whiten


def token_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's score on its last masked-in position, 0 elsewhere: [N] -> [N, T].

    A sample with no masked-in position (an empty response) gets its score in column 0, so every
    row still sums to its score exactly (adding zeros is exact): outcome estimators, which read the
    row sums, see the scores themselves.

    Args:
        scores: [N] floating-point scores.
        mask: [N, T] boolean or 0/1.
    """
    mask = check_mask(mask, scores.shape[0])
    positions = torch.arange(mask.shape[1], device=mask.device)  # [T]
    last = torch.where(mask, positions, -1).amax(dim=-1).clamp_min(0)  # [N]
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)  # [N, T]
    return out.scatter_(1, last.unsqueeze(-1).to(scores.device), scores.unsqueeze(-1))


def kl_penalized_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float | torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``apply_kl_penalty``: ``r_t = scores_t - beta * kl_t`` at masked-in positions.

    Args:
        scores: [N, T] token scores (``token_scores``).
        kl: [N, T] per-token KL estimates between the sampling (old) policy and the reference.
        mask: [N, T] boolean or 0/1; masked-out positions get no penalty.
        beta: the KL coefficient (from a controller, ``unirl.trainer.kl_control``).

    Returns:
        ``(rewards [N, T], sequence_kl [N])``: the penalised rewards and each sequence's masked mean
        KL (0 for a sequence without masked-in positions); the batch mean of ``sequence_kl`` is what
        verl logs as ``actor/reward_kl_penalty`` and feeds its adaptive controller.
    """
    mask = check_mask(mask, scores.shape[0])
    if kl.shape != scores.shape:
        raise ValueError(f"kl must have the shape of scores {tuple(scores.shape)}, got {tuple(kl.shape)}")
    kl = torch.where(mask, kl, 0.0)  # [N, T]
    sequence_kl = kl.sum(-1) / mask.sum(-1).clamp_min(1)  # [N]
    return scores - beta * kl, sequence_kl


def kl_step_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float | torch.Tensor
                    ) -> torch.Tensor:
    """The KL in the reward per denoising step: ``R_t = score - beta * kl_t`` on every trained step [N, T]
    (0 at masked-out ones), FlowGRPO's ``kl_reward`` (``scripts/train_sd3.py`` of May-June 2025, commit
    f37646f: ``rewards["avg"].unsqueeze(-1) - kl_reward * samples["kl"]``, the per-step KL of the sampling
    policy's step mean to the reference's from ``sd3_pipeline_with_logprob``). Each step's advantage then
    comes from its own column (``stepwise_advantages``), so a step that moved far from the reference loses
    advantage there and not at the other steps, where ``kl_penalized_rewards`` sums the KL over the trajectory.

    Args:
        scores: [N] the outcome scores.
        kl: [N, T] per-step KL between the sampling (old) policy and the reference.
        mask: [N, T] boolean or 0/1 trained steps.
        beta: the KL coefficient.
    """
    mask = check_mask(mask, scores.shape[0])
    if kl.shape != mask.shape:
        raise ValueError(f"kl must have the shape of mask {tuple(mask.shape)}, got {tuple(kl.shape)}")
    return torch.where(mask, scores.unsqueeze(-1) - beta * kl, 0.0)  # [N, T]


def stepwise_advantages(name: str, step_rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                        **kwargs) -> torch.Tensor:
    """The outcome estimator ``name`` (``grpo``, ``rloo``: one advantage a sample) applied to each column of
    ``step_rewards`` [N, T] on its own: ``A[:, t] = estimator(R[:, t])`` (group mean and std per step, as
    FlowGRPO's ``PerPromptStatTracker`` takes them over axis 0 of its [N, T] rewards). [N, T], 0 at
    masked-out steps. The steps of a group must be aligned (column t is the same noise level for every
    sample), which FlowGRPO's ``timestep_selection: first`` gives; ``kwargs`` are the estimator's (but ``mask``)."""
    mask = check_mask(mask, step_rewards.shape[0])
    columns = []
    for t in range(step_rewards.shape[1]):
        adv, _ = estimate_advantages(name, step_rewards[:, t], group_ids, mask=mask[:, t:t + 1], **kwargs)  # [N]
        if adv.ndim != 1:
            raise ValueError(f"the KL in the reward per step needs an outcome estimator (one advantage a sample: "
                             f"grpo, rloo), got {name!r}")
        columns.append(adv)
    return torch.where(mask, torch.stack(columns, dim=1), 0.0)  # [N, T]


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438), as
    verl's ``compute_gae_advantage_return``.

    Backwards over t, with ``V_next`` and ``A_next`` carried from the next masked-in position (0 after
    the last)::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    A masked-out position inside a response (a multi-turn observation token) neither takes a value
    nor passes one on: ``V_next`` and ``A_next`` skip over it unchanged, so the discount counts only
    trained positions. ``returns = A + V`` (the critic's target, the lambda-return) before the
    advantages are whitened over the masked-in positions of the whole input
    (``masked_whiten``: mean and Bessel-corrected variance, ``1e-8`` added). Pass the global batch
    to whiten over it.

    Special cases: ``gamma = lam = 1`` gives ``A_t = sum of rewards from t on - V_t``; ``lam = 0``
    the one-step TD error ``r_t + gamma * V_next - V_t``.

    Args:
        token_rewards: [N, T] rewards on tokens.
        values: [N, T] the critic's values at the same positions.
        mask: [N, T] boolean or 0/1.
        gamma: discount; lam: GAE's lambda.

    Returns:
        ``(advantages [N, T], returns [N, T])``, both 0 at masked-out positions.
    """
    mask = check_mask(mask, token_rewards.shape[0])
    if values.shape != token_rewards.shape or mask.shape != token_rewards.shape:
        raise ValueError(f"token_rewards, values and mask must have one shape [N, T], got "
                         f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    values = torch.where(mask, values, 0.0)  # [N, T]: junk at masked positions reaches nothing
    next_value = values.new_zeros(values.shape[0])  # [N]
    next_adv = values.new_zeros(values.shape[0])  # [N]
    raw = torch.zeros_like(values)  # [N, T]
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        adv = delta + gamma * lam * next_adv  # [N]
        keep = mask[:, t]  # [N]
        next_value = torch.where(keep, values[:, t], next_value)
        next_adv = torch.where(keep, adv, next_adv)
        raw[:, t] = torch.where(keep, adv, 0.0)
    returns = torch.where(mask, raw + values, 0.0)  # [N, T]
    return masked_whiten(raw, mask), returns


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` as verl's REINFORCE++ computes it: the running
    sum restarts (is set to 0) after every masked-out position, so rewards behind a hole or the end of
    a response do not flow back. [N, T], 0 at masked-out positions."""
    mask = check_mask(mask, token_rewards.shape[0])
    running = token_rewards.new_zeros(token_rewards.shape[0])  # [N]
    out = torch.zeros_like(token_rewards)  # [N, T]
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        out[:, t] = running
        running = torch.where(mask[:, t], running, 0.0)
    return torch.where(mask, out, 0.0)


def discounted_future_sum(values: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """``S_t = x_t + gamma * S_{t+1}`` over every column to the row's end, with ``x_t`` = ``values`` at
    masked-in positions and 0 elsewhere: Tinker's ``discounted_future_sum_vectorized``
    (``tinker_cookbook/rl/metrics.py``), which on-policy distillation runs over a whole multi-turn sample.
    Unlike ``discounted_returns`` the sum is carried *through* a masked-out position (an observation inside
    a multi-turn response adds nothing but still counts one discount step), so a turn's advantage sees the
    later turns'. [N, T], 0 at masked-out positions."""
    mask = check_mask(mask, values.shape[0])
    x = torch.where(mask, values, 0.0)  # [N, T]
    running = values.new_zeros(values.shape[0])  # [N]
    out = torch.zeros_like(values)  # [N, T]
    for t in reversed(range(values.shape[1])):
        running = x[:, t] + gamma * running
        out[:, t] = running
    return torch.where(mask, out, 0.0)


def _token_inputs(rewards: torch.Tensor, mask: torch.Tensor | None, token_rewards: torch.Tensor | None,
                  values: torch.Tensor | None):
    """The token estimators' inputs with their defaults: without ``mask`` each sample is one position;
    without ``token_rewards`` the rewards on each sample's last position; without ``values`` zeros."""
    squeeze = mask is None
    mask = torch.ones_like(rewards, dtype=torch.bool).unsqueeze(-1) if mask is None else check_mask(mask, rewards.shape[0])
    if token_rewards is None:
        token_rewards = token_scores(rewards, mask)
    if values is None:
        values = torch.zeros_like(token_rewards)
    return mask, token_rewards, values, squeeze


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's advantages from a critic: ``gae_advantages`` under the registry contract. ``group_ids``,
    ``scale``, ``eps`` and ``unbiased`` are ignored (no groups: the critic is the baseline). Without
    ``mask`` every sample is one position and [N] tensors come back."""
    mask, token_rewards, values, squeeze = _token_inputs(rewards, mask, token_rewards, values)
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
    return (advantages.squeeze(-1), returns.squeeze(-1)) if squeeze else (advantages, returns)


gae_estimator.reads_values = True  # the trainer builds a critic for it


@ADVANTAGE_ESTIMATORS.register("reinforce++")
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262) as verl's
    ``compute_reinforce_plus_plus_outcome_advantage``: ``discounted_returns`` of the token rewards,
    whitened over the masked-in positions (``masked_whiten``). No baseline but the whitening; the
    token rewards carry the KL penalty when it is in the reward. Only ``mask``, ``token_rewards`` and
    ``gamma`` are read (``rewards`` when there are no token rewards)."""
    mask, token_rewards, _, squeeze = _token_inputs(rewards, mask, token_rewards, None)
    advantages = masked_whiten(discounted_returns(token_rewards, mask, gamma=gamma), mask)
    return (advantages.squeeze(-1) if squeeze else advantages), None


# Its running sum restarts after every masked-out position (an observation): per-turn rewards are
# placed for it as returns, not as differences (``unirl.core.turns.turn_token_rewards``).
reinforce_pp_advantages.restarts_at_observations = True
