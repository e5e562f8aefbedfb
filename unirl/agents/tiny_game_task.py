"""The tiny game's rows (``configs/text/tiny_game.yaml``): a start and a goal 1..4 cells apart on the
line of ``unirl/agents/walk.py``, every such pair. Registered as ``unirl://tiny_game/train`` and
``/test`` (the same pairs: the game has 60 of them; a held-out evaluation plays them greedily). Pure
Python: ``unirl data list`` imports it."""

from __future__ import annotations

import random

from unirl.data.paths import register_source

#: The farthest a goal is from its start: four turns reach it only if every move is right.
MAX_DISTANCE = 4
CELLS = 10


def pairs() -> list[tuple[int, int]]:
    return [(s, g) for s in range(CELLS) for g in range(CELLS) if 0 < abs(s - g) <= MAX_DISTANCE]


def game_rows(seed: int = 0) -> list[dict]:
    """``{"prompt", "start", "goal"}`` for every pair, shuffled by ``seed``; the prompt is the episode's
    first observation (the environment gives the same)."""
    rows = [{"prompt": f"at {s} goal {g}\n", "start": s, "goal": g} for s, g in pairs()]
    random.Random(seed).shuffle(rows)
    return rows


register_source("tiny_game/train", defaults={"seed": 0}, rows=True,
                about="the tiny game's 60 start/goal pairs on a line of 10 cells (unirl/agents/tiny_game_task.py)")(
    lambda seed: game_rows(seed))
register_source("tiny_game/test", defaults={"seed": 1}, rows=True,
                about="the same pairs, for a greedy evaluation (unirl/agents/tiny_game_task.py)")(
    lambda seed: game_rows(seed))
