"""``rollout.environment``: the stateful environment a text run's episodes play (docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from unirl.config import FILE_SPEC
from unirl.config.schema import check_range


@dataclass
class EnvironmentConfig:
    """A stateful environment (unirl/agents/): each sample is an episode made from its data row, played
    over turns (the policy's text in, an observation and a reward out) within ``rollout.max_turns``,
    ``max_new_tokens`` per turn and ``max_total_tokens``; observations are masked out of the loss.
    Rewards: list ``episode_return`` in ``rewards`` (the sum of the episode's per-turn rewards)."""

    #: The environment: a registered name (``walk``, ``python_code``, ``gym``, ``openenv``, ``verifiers``),
    #: ``path/file.py:Name`` or ``package.module:Name`` (a class of episodes, or a function making one
    #: from a row). null: no environment (single-turn sampling, or ``rollout.tools``).
    name: Optional[str] = field(default=None, metadata=FILE_SPEC)
    #: Its settings, passed to it with each row; a misspelt one is an error.
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Seconds each call into an episode (making it, reset, a step, close) may take; past it the episode
    #: ends, one line names it, and it is counted in ``env/timeouts`` (as ``rollout.tool_timeout_s``).
    step_timeout_s: float = 30.0
    #: Calls into the episodes that run at once (as ``rollout.tool_concurrency``).
    concurrency: int = 32
    #: Discount between turns for the per-turn returns the token-reward estimators (``gae``,
    #: ``reinforce++``) read: turn k's tokens get ``r_k + d r_{k+1} + d^2 r_{k+2} ...``
    #: (``unirl.core.turns``); 1: the undiscounted return, which is what the outcome estimators (GRPO)
    #: read as the sample's reward.
    turn_discount: float = 1.0

    def __post_init__(self):
        check_range(self, "step_timeout_s", low=0, low_open=True)
        check_range(self, "concurrency", low=1)
        check_range(self, "turn_discount", low=0, high=1)
