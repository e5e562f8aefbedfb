"""The tiny search task's data (``configs/text/tiny_search.yaml``): made-up names with a one-digit
code each, the questions about them and the corpus that answers them, from a seed. Registered as
``unirl://tiny_search/train``, ``/test`` and ``/corpus``; the model warm-started for the task is
``unirl/text/tiny_search.py`` (which says why the task looks like this). Pure Python: ``unirl data
list`` imports it.
"""

from __future__ import annotations

import random

from unirl.data.paths import register_source

#: Names in the task: training questions, held-out questions (the corpus holds both).
TASK_SIZES = {"train": 32, "test": 16}

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _name(rng: random.Random) -> str:
    """A made-up four-letter name, consonant-vowel-consonant-vowel (``Bako``): 4,900 of them."""
    return "".join(rng.choice(s) for s in (_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS)).capitalize()


def distinct_names(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = _name(rng)
        if name not in out and name not in exclude:
            out.append(name)
    return out


def code(rng: random.Random) -> str:
    """A code: one digit, 2..9 (``Doc 1`` already shows a 1), so a guess is right 1 time in 8."""
    return str(rng.randint(2, 9))


def question(name: str) -> str:
    return f"{name}. What is its code?"


def passage(name: str, code: str) -> str:
    """A corpus row's ``contents``: title line, then text (Search-R1's corpus layout)."""
    return f"{name}\ncode {code}"


def task_codes(seed: int = 0) -> dict[str, dict[str, str]]:
    """``{"train": {name: code}, "test": {name: code}}``: distinct names, codes 10..99, from ``seed``."""
    rng = random.Random(seed)
    names = distinct_names(rng, sum(TASK_SIZES.values()))
    codes = {n: code(rng) for n in names}
    split = TASK_SIZES["train"]
    return {"train": {n: codes[n] for n in names[:split]}, "test": {n: codes[n] for n in names[split:]}}


def task_rows(part: str, seed: int = 0) -> list[dict]:
    """``unirl://tiny_search/{train,test}``: ``{"question", "answer"}`` rows; ``corpus``: ``{"id", "contents"}``
    rows of every task name (train and test)."""
    codes = task_codes(seed)
    if part == "corpus":
        every = {**codes["train"], **codes["test"]}
        return [{"id": str(i), "contents": passage(n, c)} for i, (n, c) in enumerate(every.items())]
    return [{"question": question(n), "answer": c} for n, c in codes[part].items()]


def _register(part: str, about: str) -> None:
    register_source(f"tiny_search/{part}", defaults={"seed": 0}, rows=True, about=about)(
        lambda seed: task_rows(part, seed))


_register("train", "'What is the code of NAME?' with the code as answer, 32 names (unirl/text/tiny_search_task.py)")
_register("test", "the same question about 16 other names, for evaluation (unirl/text/tiny_search_task.py)")
_register("corpus", "the search corpus of tiny_search's 48 names and codes, {id, contents} rows "
                    "(unirl/text/tiny_search_task.py)")
