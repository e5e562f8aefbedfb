"""The ``episode_return`` reward: what an environment's episode earned, as the sample's reward."""

from __future__ import annotations

from typing import Sequence

from unirl.rewards.registry import RewardError, register_reward


@register_reward("episode_return")
def episode_return(samples: Sequence[str], *, episode_return: Sequence[float] | None = None, **kwargs) -> list[float]:
    """The sum of the per-turn rewards the environment gave the episode (rollout.environment)."""
    if episode_return is None:
        raise RewardError("episode_return reads the episodes of rollout.environment (the episode_return column); "
                          "this run samples without an environment: set rollout.environment.name or use another reward")
    return [float(r) for r in episode_return]
