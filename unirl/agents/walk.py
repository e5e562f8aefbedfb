"""The tiny game (``configs/text/tiny_game.yaml``): walk along a line of cells 0..9 to a goal, one step a turn.

An episode starts at a cell with a goal elsewhere; the policy is shown ``at 3 goal 6`` and answers ``r``
(right) or ``l`` (left); the environment moves it and shows where it is now, until it stands on the
goal (reward ``goal_reward``, done) or the run's ``rollout.max_turns`` are spent. Any other answer is
a wasted turn (it stays). The state lives in the episode (its cell); the observation restates the goal
so that the best move depends on the last observation only, which a 2-layer character model can learn:

    at 3 goal 6\\n  r  at 4 goal 6\\n  r  at 5 goal 6\\n  r     (done, reward 1 on the third turn)

Rows (``unirl://tiny_game/train``, ``/test``) hold ``start`` and ``goal``; the model warm-started to
play it with a noisy policy is ``unirl/text/tiny_game.py``.

``style="words"`` is the same game for an instruct model (``configs/text/smollm2_game.yaml``): each
observation is a sentence asking for one word, and an answer that names one direction (``left`` or
``right``, anywhere in it, not both) moves; rows (``unirl://walk_words/train``, ``/test``) may give a longer
line in ``cells``.
"""

from __future__ import annotations

import re

from unirl.agents.protocol import Episode, Step, register_environment

CELLS = 10
STYLES = ("terse", "words")


def observation(cell: int, goal: int) -> str:
    return f"at {cell} goal {goal}\n"


def words_observation(cell: int, goal: int) -> str:
    """The ``words`` style's observation: the same facts as a question an instruct model answers in a word
    (the wording a 135M instruct model answered with a direction most often, among five tried)."""
    return (f"Position {cell}, target {goal}. Left goes down, right goes up. To reach the target, should I go "
            f"left or right? Reply with one word.")


def words_action(action: str) -> str:
    """``r`` or ``l`` for an answer naming exactly one of ``right`` / ``left`` as a word (any case), else ``""``
    (a wasted turn: an answer naming both, or neither, does not move).

    >>> words_action("To reach the target, you should go Right."), words_action("left or right?"), words_action("up")
    ('r', '', '')
    """
    named = set(re.findall(r"[a-z]+", action.lower())) & {"left", "right"}
    return named.pop()[0] if len(named) == 1 else ""


def move(cell: int, action: str, cells: int = CELLS) -> int:
    """The cell after ``action`` (``r``: one right, ``l``: one left, at the ends or otherwise: stay)."""
    step = {"r": 1, "l": -1}.get(action.strip(), 0)
    return min(max(cell + step, 0), cells - 1)


@register_environment("walk")
class Walk(Episode):
    """Walk along a line of cells to a goal (the tiny game); a reward when it is reached."""

    def __init__(self, row: dict, *, goal_reward: float = 1.0, step_reward: float = 0.0, style: str = "terse",
                 slack: int | None = None):
        """``slack``: the episode is cut (truncated, no reward) after the goal's distance plus ``slack`` turns,
        so only moves that read the position pay (with ``rollout.max_turns`` alone, a fixed sequence such as
        "right, then left four times" reaches every goal on the left); None: ``rollout.max_turns`` only."""
        if style not in STYLES:
            raise ValueError(f"walk: style is one of {', '.join(STYLES)}; got {style!r}")
        if slack is not None and (not isinstance(slack, int) or slack < 0):
            raise ValueError(f"walk: slack is a number of turns >= 0 (or null); got {slack!r}")
        self.cells = row.get("cells", CELLS)
        if not isinstance(self.cells, int) or self.cells < 2:
            raise ValueError(f"walk: a row's 'cells' is the line's length, an int >= 2; got {self.cells!r}")
        for key in ("start", "goal"):
            if not isinstance(row.get(key), int) or not 0 <= row[key] < self.cells:
                raise ValueError(f"walk: a row needs '{key}', a cell 0..{self.cells - 1}; got {row.get(key)!r}")
        self.cell, self.goal = row["start"], row["goal"]
        self.goal_reward, self.step_reward = goal_reward, step_reward
        self.words = style == "words"
        self.turns_left = None if slack is None else abs(self.goal - self.cell) + slack

    def observe(self) -> str:
        return (words_observation if self.words else observation)(self.cell, self.goal)

    def reset(self) -> str:
        return self.observe()

    def step(self, action: str) -> Step:
        self.cell = move(self.cell, words_action(action) if self.words else action, self.cells)
        if self.cell == self.goal:
            return Step(observation="", reward=self.goal_reward + self.step_reward, done=True)
        if self.turns_left is not None:
            self.turns_left -= 1
            if self.turns_left <= 0:
                return Step(observation="", reward=self.step_reward, truncated=True)
        return Step(observation=self.observe(), reward=self.step_reward)
