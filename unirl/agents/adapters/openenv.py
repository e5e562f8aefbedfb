"""``openenv``: a session of an OpenEnv environment server (``openenv-core``, Meta's; TRL trains on them) as
an episode. Tested with openenv-core 0.3.0.

Each episode opens its own session (the server's WebSocket ``/ws``, through openenv-core's
``GenericEnvClient``: OpenEnv's HTTP ``/reset`` and ``/step`` make a fresh environment per request, so a
stateful episode lives in a session), resets it with the row's ``reset_keys`` columns as keyword
arguments (a seed, a level), sends each turn as the action ``{action_key: text}`` and shows the
observation's ``observation_key`` field (or, unset, the observation's fields as JSON). The server's
reward and ``done`` are the step's. The first observation follows the row's prompt (the instructions),
unless ``show_prompt`` is false.
The client is async: the episodes' round trips overlap.
"""

from __future__ import annotations

import json
from typing import Any

from unirl.agents.adapters import require
from unirl.agents.protocol import Episode, Step, register_environment

require("openenv")


@register_environment("openenv")
class OpenEnvEpisode(Episode):
    """A session of an OpenEnv environment server (reset / step over its WebSocket)."""

    def __init__(self, row: dict, *, base_url: str, action_key: str = "message", observation_key: str | None = None,
                 reset_keys: list[str] | None = None, show_prompt: bool = True, connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 60.0):
        if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"openenv: base_url must start with http:// or ws://, got {base_url!r}")
        missing = [k for k in reset_keys or [] if k not in row]
        if missing:
            raise ValueError(f"openenv: reset_keys {missing} are not columns of the row (columns: {sorted(row)})")
        self.reset_kwargs = {k: row[k] for k in reset_keys or []}
        self.prompt = row.get("prompt", "") if show_prompt else ""
        self.action_key, self.observation_key = action_key, observation_key
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=base_url, connect_timeout_s=connect_timeout_s,
                                       message_timeout_s=message_timeout_s)

    async def reset(self) -> str:
        result = await self.client.reset(**self.reset_kwargs)
        return f"{self.prompt}{self._text(result.observation)}"

    async def step(self, action: str) -> Step:
        result = await self.client.step({self.action_key: action})
        return Step(observation=self._text(result.observation), reward=result.reward, done=bool(result.done),
                    info=dict(result.observation.get("metadata") or {}))

    async def close(self) -> None:
        await self.client.close()

    def _text(self, observation: dict[str, Any]) -> str:
        if self.observation_key is not None:
            if self.observation_key not in observation:
                raise KeyError(f"the observation has no field {self.observation_key!r} (fields: {sorted(observation)})")
            return str(observation[self.observation_key])
        fields = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
        return json.dumps(fields)
