"""The tiny game (``configs/text/tiny_game.yaml``): walk along a line of cells 0..9 to a goal, one step a turn.

An episode starts at a cell with a goal elsewhere; the policy is shown ``at 3 goal 6`` and answers ``r``
(right) or ``l`` (left); the environment moves it and shows where it is now, until it stands on the
goal (reward ``goal_reward``, done) or the run's ``rollout.max_turns`` are spent. Any other answer is
a wasted turn (it stays). The state lives in the episode (its cell); the observation restates the goal
so that the best move depends on the last observation only, which a 2-layer character model can learn:

    at 3 goal 6\\n  r  at 4 goal 6\\n  r  at 5 goal 6\\n  r     (done, reward 1 on the third turn)

Rows (``unirl://tiny_game/train``, ``/test``) hold ``start`` and ``goal``; the model warm-started to
play it with a noisy policy is ``unirl/text/tiny_game.py``.
"""

from __future__ import annotations

from unirl.agents.protocol import Episode, Step, register_environment

CELLS = 10


def observation(cell: int, goal: int) -> str:
    return f"at {cell} goal {goal}\n"


def move(cell: int, action: str) -> int:
    """The cell after ``action`` (``r``: one right, ``l``: one left, at the ends or otherwise: stay)."""
    step = {"r": 1, "l": -1}.get(action.strip(), 0)
    return min(max(cell + step, 0), CELLS - 1)


@register_environment("walk")
class Walk(Episode):
    """Walk along a line of cells to a goal (the tiny game); a reward when it is reached."""

    def __init__(self, row: dict, *, goal_reward: float = 1.0, step_reward: float = 0.0):
        for key in ("start", "goal"):
            if not isinstance(row.get(key), int) or not 0 <= row[key] < CELLS:
                raise ValueError(f"walk: a row needs '{key}', a cell 0..{CELLS - 1}; got {row.get(key)!r}")
        self.cell, self.goal = row["start"], row["goal"]
        self.goal_reward, self.step_reward = goal_reward, step_reward

    def reset(self) -> str:
        return observation(self.cell, self.goal)

    def step(self, action: str) -> Step:
        self.cell = move(self.cell, action)
        if self.cell == self.goal:
            return Step(observation="", reward=self.goal_reward + self.step_reward, done=True)
        return Step(observation=observation(self.cell, self.goal), reward=self.step_reward)
