"""The ``episode_return`` reward (what an environment's episode earned) and ``session_reward`` (what an agent
posted for its session, ``source.agent``), each as the sample's reward."""

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


@register_reward("session_reward")
def session_reward(samples: Sequence[str], *, session_reward: Sequence[float | None] | None = None, **kwargs) -> list[float]:
    """The reward your agent posted for the session (source.agent: POST /v1/sessions/{id}/reward)."""
    if session_reward is None:
        raise RewardError("session_reward reads the sessions an agent ends at the endpoint of source.agent; this run "
                          "has no source.agent.port: set it or use another reward")
    if any(r is None for r in session_reward):
        raise RewardError("session_reward: a session ended without a reward (post {\"reward\": number})")
    return [float(r) for r in session_reward]
