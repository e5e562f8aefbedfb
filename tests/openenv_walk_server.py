"""An OpenEnv environment server (openenv-core's ``create_fastapi_app`` under uvicorn) playing the walk game
of ``unirl/agents/walk.py``, for tests/test_agents_adapters.py: ``python tests/openenv_walk_server.py PORT``
prints ``ready`` once it listens. Reset takes ``start`` and ``goal``; the action is ``{"move": text}``;
the observation's ``text`` is what unirl's own walk shows."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State
from openenv.core.env_server.http_server import create_fastapi_app

from unirl.agents.walk import move, observation


class WalkAction(Action):
    move: str


class WalkObservation(Observation):
    text: str = ""


class WalkServerEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.cell = self.goal = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, start: int = 0, goal: int = 1,
              **kwargs: Any) -> WalkObservation:
        self.cell, self.goal, self._state = start, goal, State(step_count=0, episode_id=episode_id)
        return WalkObservation(text=observation(self.cell, self.goal))

    def step(self, action: WalkAction, timeout_s: Optional[float] = None, **kwargs: Any) -> WalkObservation:
        self._state.step_count += 1
        self.cell = move(self.cell, action.move)
        if self.cell == self.goal:
            return WalkObservation(text="", reward=1.0, done=True)
        return WalkObservation(text=observation(self.cell, self.goal), reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(WalkServerEnv, WalkAction, WalkObservation, max_concurrent_envs=512)

if __name__ == "__main__":
    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    server = uvicorn.Server(config)

    def announce():
        while not server.started:
            time.sleep(0.05)
        print("ready", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
