"""``gym``: a gymnasium environment as an episode, where its actions can be written as text. Tested with
gymnasium 1.4.0.

The environment (``env_id``: a registered gymnasium id, or ``module:Class`` registered on import) is made
per episode with ``env_kwargs`` and reset with the row's ``seed`` column (when present). Observations are
shown as text: ``env.render()`` with ``render_mode: ansi``, the observation itself when it is a string
(a ``Text`` space), ``str(observation)`` otherwise. Actions: a ``Text`` action space takes the turn as it
is (stripped); a ``Discrete(n)`` space takes the first integer in the turn; a turn with no valid action
wastes the turn (``invalid_reward``, the same observation again). Gymnasium's ``terminated`` is the
step's ``done``, its ``truncated`` the step's ``truncated``. The row's prompt (the instructions) comes
before the first observation.
"""

from __future__ import annotations

import re
from typing import Any

from unirl.agents.adapters import require
from unirl.agents.protocol import Episode, Step, register_environment

require("gymnasium")

_INTEGER = re.compile(r"-?\d+")


@register_environment("gym")
class GymEpisode(Episode):
    """A gymnasium environment with text or discrete actions, shown as text."""

    def __init__(self, row: dict, *, env_id: str, env_kwargs: dict[str, Any] | None = None, invalid_reward: float = 0.0):
        import gymnasium

        self.env = gymnasium.make(env_id, **(env_kwargs or {}))
        space = self.env.action_space
        self.text_actions = isinstance(space, gymnasium.spaces.Text)
        if not self.text_actions and not isinstance(space, gymnasium.spaces.Discrete):
            self.env.close()
            raise ValueError(f"gym: {env_id}'s action space is {space}; an action written as text needs a Text or a "
                             f"Discrete space")
        self.seed, self.prompt, self.invalid_reward = row.get("seed"), row.get("prompt", ""), invalid_reward
        self.last = ""

    def reset(self) -> str:
        observation, _ = self.env.reset(seed=self.seed)
        self.last = self._text(observation)
        return f"{self.prompt}{self.last}"

    def step(self, action: str) -> Step:
        parsed = self._action(action)
        if parsed is None:
            return Step(observation=f"invalid action {action.strip()[:40]!r}\n{self.last}", reward=self.invalid_reward)
        observation, reward, terminated, truncated, info = self.env.step(parsed)
        self.last = self._text(observation)
        return Step(observation=self.last, reward=float(reward), done=bool(terminated), truncated=bool(truncated),
                    info={k: v for k, v in info.items() if isinstance(v, (int, float, str, bool))})

    def close(self) -> None:
        self.env.close()

    def _action(self, text: str):
        space = self.env.action_space
        if self.text_actions:
            action = text.strip()
            return action if space.contains(action) else None
        match = _INTEGER.search(text)
        return int(match.group()) if match is not None and space.contains(int(match.group())) else None

    def _text(self, observation) -> str:
        if getattr(self.env, "render_mode", None) == "ansi":
            return str(self.env.render())
        return observation if isinstance(observation, str) else str(observation)
