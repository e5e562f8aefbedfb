"""The tiny game's rows (``configs/text/tiny_game.yaml``): a start and a goal 1..4 cells apart on the
line of ``unirl/agents/walk.py``, every such pair. Registered as ``unirl://tiny_game/train`` and
``/test`` (the same pairs: the game has 60 of them; a held-out evaluation plays them greedily). The
words game of ``configs/text/smollm2_game.yaml`` (``unirl://walk_words/train``, ``/test``) plays a longer
line whose pairs are split in two, so its evaluation plays positions never trained on. Pure Python:
``unirl data list`` imports it."""

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


def words_rows(split: str, *, cells: int = 20, max_distance: int = 3, test_share: float = 0.3,
               seed: int = 0) -> list[dict]:
    """The words game's rows on a line of ``cells``: every start/goal pair 1..``max_distance`` apart, shuffled
    by ``seed`` and cut into a test share and the rest (``split`` ``test`` / ``train``: disjoint); the
    prompt is the episode's first observation (``walk.words_observation``)."""
    from unirl.agents.walk import words_observation

    pairs = [(s, g) for s in range(cells) for g in range(cells) if 0 < abs(s - g) <= max_distance]
    random.Random(seed).shuffle(pairs)
    cut = round(len(pairs) * test_share)
    chosen = pairs[:cut] if split == "test" else pairs[cut:]
    return [{"prompt": words_observation(s, g), "start": s, "goal": g, "cells": cells} for s, g in chosen]


for _split in ("train", "test"):
    register_source(f"walk_words/{_split}", defaults={"cells": 20, "max_distance": 3, "seed": 0}, rows=True,
                    about=f"the words walk game's {_split} start/goal pairs (disjoint from the "
                          f"{'test' if _split == 'train' else 'train'} ones; unirl/agents/tiny_game_task.py)")(
        lambda cells, max_distance, seed, _split=_split: words_rows(_split, cells=cells, max_distance=max_distance,
                                                                     seed=seed))


register_source("tiny_game/train", defaults={"seed": 0}, rows=True,
                about="the tiny game's 60 start/goal pairs on a line of 10 cells (unirl/agents/tiny_game_task.py)")(
    lambda seed: game_rows(seed))
register_source("tiny_game/test", defaults={"seed": 1}, rows=True,
                about="the same pairs, for a greedy evaluation (unirl/agents/tiny_game_task.py)")(
    lambda seed: game_rows(seed))
