"""Per-turn rewards of a multi-turn episode placed on its tokens, discounted over turns.

Legend: N samples (episodes), T response tokens. An episode's response is ``turn_1 obs_1 turn_2 ...
turn_K``: the generated tokens of each turn (trained) with the environment's observations between
them (masked out of the loss). Turn k ends on its last generated token, ``end_k``; the environment
answered that turn with the reward ``r_k`` (0 when it gave none).

The rule (``turn_token_rewards``):

1. The sample's reward ``R`` (what the outcome estimators, GRPO and the others, see: the reward set's
   weighted sum, which for an environment is usually its return ``sum_k r_k``) and the per-turn
   rewards need not agree: a format reward, a weight or DAPO's overlong penalty add to ``R`` only.
   The difference ``R - sum_k r_k`` is an outcome of the whole episode, earned by its last turn:
   ``r'_K = r_K + R - sum_k r_k``, ``r'_k = r_k`` otherwise.
2. Returns over turns with the turn discount ``gamma``:
   ``G_k = r'_k + gamma * G_{k+1}``, ``G_{K+1} = 0``.
3. Every generated token of turn k is to have the return ``G_k`` under the token estimator (with its
   own per-token discount ``algo.gamma = 1``). The two token-reward estimators sum token rewards
   differently across an observation, so the placement follows the estimator:

   * ``gae`` carries its sums over observation tokens (they hold no value and pass ``V_next`` and
     ``A_next`` on), so the reward on ``end_k`` is the difference ``x_k = G_k - G_{k+1}``
     (``= r'_k + (gamma - 1) G_{k+1}``): the sum from turn k on telescopes to ``G_k``;
   * ``reinforce++`` restarts its running sum after every observation token (verl's
     ``compute_reinforce_plus_plus_outcome_advantage``), so the reward on ``end_k`` is ``G_k`` itself.

   With ``gamma = 1`` and rewards only at the end (``r_k = 0`` for k < K) the ``gae`` placement is
   today's ``token_scores``: ``R`` on the last trained token. ``reinforce++`` gets ``R`` on every turn
   (today's multi-turn tool rollouts give the earlier turns 0: the restart stops the sum).
   The row sums of the ``gae`` placement are ``G_1``, the discounted return (``R`` at ``gamma = 1``),
   which is what the outcome estimators then read.

A sample without any turn end (an episode whose environment failed before its first turn) gets
``token_scores``: ``R`` on its last trained position.

References: per-turn rewards on the turn's last token as in SkyRL-gym's step rewards and RAGEN's
turn-level credit (arXiv 2504.20073); the estimators in ``unirl/core/returns.py``.
"""

from __future__ import annotations

import torch

from unirl.core.returns import token_scores


def turn_token_rewards(rewards: torch.Tensor, turn_rewards: torch.Tensor, turn_ends: torch.Tensor,
                       mask: torch.Tensor, *, gamma: torch.Tensor | float, carry: bool) -> torch.Tensor:
    """Token rewards [N, T] of the module's rule.

    Args:
        rewards: [N] each sample's reward ``R``.
        turn_rewards: [N, T] ``r_k`` on ``end_k``, 0 elsewhere.
        turn_ends: [N, T] boolean or 0/1, set on each turn's last generated token.
        mask: [N, T] the trained tokens (for the samples without a turn end).
        gamma: the turn discount, a float or [N].
        carry: True for an estimator that carries its sums across observation tokens (``gae``),
            False for one that restarts after them (``reinforce++``).
    """
    N, T = turn_rewards.shape
    if rewards.shape != (N,) or turn_ends.shape != (N, T) or mask.shape != (N, T):
        raise ValueError(f"rewards [N], turn_rewards, turn_ends and mask [N, T] expected, got {tuple(rewards.shape)}, "
                         f"{tuple(turn_rewards.shape)}, {tuple(turn_ends.shape)}, {tuple(mask.shape)}")
    ends = turn_ends.bool()  # [N, T]
    gamma = torch.as_tensor(gamma, dtype=rewards.dtype, device=rewards.device).expand(N)  # [N]
    positions = torch.arange(T, device=ends.device)  # [T]
    last = torch.where(ends, positions, -1).amax(-1)  # [N]: end_K, -1 without turns
    has_turns = last >= 0  # [N]
    rest = rewards - torch.where(ends, turn_rewards, 0.0).sum(-1)  # [N]: R - sum_k r_k
    at_last = torch.zeros_like(turn_rewards).scatter_(1, last.clamp_min(0).unsqueeze(-1), rest.unsqueeze(-1))
    earned = torch.where(ends, turn_rewards + at_last, 0.0)  # [N, T]: r'_k on end_k
    next_return = rewards.new_zeros(N)  # [N]: G_{k+1}
    out = torch.zeros_like(turn_rewards)  # [N, T]
    for t in reversed(range(T)):
        end = ends[:, t]  # [N]
        ret = earned[:, t] + gamma * next_return  # [N]: G_k where end_k = t
        out[:, t] = torch.where(end, ret - next_return if carry else ret, 0.0)
        next_return = torch.where(end, ret, next_return)
    return torch.where(has_turns.unsqueeze(-1), out, token_scores(rewards, mask))
