"""One-step arithmetic word problems, generated in code: ``unirl://arithmetic/train`` and ``/test``.

The task of ``configs/text/smollm2_math.yaml``: a small real model (SmolLM2-135M-Instruct) answers
some of these right at step 0 and almost never in GSM8K's strict ``#### N`` form, so GRPO has
something to find in both the arithmetic and the format. Each problem is one sentence of a person
having some things, then getting or losing some, and a question, e.g.

    Mia has 7 marbles. She buys 5 more marbles. How many marbles does Mia have now?

with a GSM8K-style answer (``7 + 5 = 12`` then ``#### 12``) that the ``gsm8k`` adapter reads.
Operands are 2..``max_operand``; a subtraction never goes below zero.

``rows(split, n, seed)`` is the same list on every machine (a seeded ``random.Random``): the first
``n`` distinct problems of the split's stream. A problem belongs to one split only, by a hash of its
question (one in ten is a test problem), so the held-out problems are never trained on.
"""

from __future__ import annotations

import functools
import hashlib
import random

from unirl.data.paths import register_source

NAMES = [("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
         ("Ivy", "She"), ("Max", "He"), ("Emma", "She"), ("Noah", "He"), ("Lily", "She"), ("Ben", "He"),
         ("Ella", "She"), ("Jack", "He"), ("Ruby", "She"), ("Omar", "He"), ("Nina", "She"), ("Raj", "He")]
THINGS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "coins",
          "balloons", "stamps", "candies", "toy cars", "flowers", "eggs", "crayons", "beads", "oranges"]
#: (verb phrase, sign): what happens to the things, and whether it adds or takes away.
GAINS = ["buys {b} more {t}", "finds {b} more {t}", "gets {b} more {t} from a friend", "picks {b} more {t}",
         "is given {b} more {t}", "wins {b} more {t}"]
LOSSES = ["gives away {b} {t}", "loses {b} {t}", "sells {b} {t}", "gives {b} {t} to a friend",
          "gives {b} {t} to a neighbour", "trades away {b} {t}"]
def problem(rng: random.Random, max_operand: int) -> dict:
    """One problem ``{"question", "answer"}`` drawn from ``rng``."""
    name, pronoun = rng.choice(NAMES)
    things = rng.choice(THINGS)
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    if rng.random() < 0.5:
        event, result, working = rng.choice(GAINS), a + b, f"{a} + {b} = {a + b}"
    else:
        a, b = max(a, b), min(a, b)  # never below zero
        event, result, working = rng.choice(LOSSES), a - b, f"{a} - {b} = {a - b}"
    question = (f"{name} has {a} {things}. {pronoun} {event.format(b=b, t=things)}. "
                f"How many {things} does {name} have now?")
    return {"question": question, "answer": f"{working}\n#### {result}"}


def split_of(question: str) -> str:
    """``test`` for one question in ten (by a stable hash of its text), ``train`` otherwise: the two
    splits never share a question, whatever their sizes and seeds."""
    return "test" if hashlib.sha256(question.encode()).digest()[0] % 10 == 0 else "train"


@functools.lru_cache(maxsize=8)
def rows(split: str, n: int, seed: int = 0, max_operand: int = 20) -> tuple[dict, ...]:
    """``n`` distinct problems of ``split`` (``train`` or ``test``) from a stream seeded by ``seed``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    seen, out, misses = set(), [], 0
    while misses < 10_000:  # draws in a row that found nothing new: the split is (nearly) exhausted
        row = problem(rng, max_operand)
        if row["question"] in seen or split_of(row["question"]) != split:
            misses += 1
            continue
        seen.add(row["question"])
        out.append(row)
        misses = 0
        if len(out) == n:
            return tuple(out)
    raise ValueError(f"arithmetic: only {len(out)} distinct {split} problems with max_operand={max_operand}, asked for {n}")


def gsm8k_flexible(samples, *, answer, **kwargs) -> list[float]:
    """verl's flexible GSM8K score (the last number in the answer, in any form): logged beside the
    strict score with weight 0 in ``smollm2_math.yaml``, so a run shows how much of its gain is the
    ``#### N`` format and how much the arithmetic."""
    from unirl.rewards.gsm8k import gsm8k

    return gsm8k(samples, answer=answer, method="flexible")


@register_source("arithmetic/train", defaults={"n": 5000, "seed": 0, "max_operand": 20}, rows=True,
                 about="one-step arithmetic word problems with GSM8K answers (unirl/text/arithmetic.py)")
def _train_rows(n: int, seed: int, max_operand: int) -> tuple[dict, ...]:
    return rows("train", n, seed, max_operand)


@register_source("arithmetic/test", defaults={"n": 200, "seed": 0, "max_operand": 20}, rows=True,
                 about="held-out arithmetic word problems, never in arithmetic/train (unirl/text/arithmetic.py)")
def _test_rows(n: int, seed: int, max_operand: int) -> tuple[dict, ...]:
    return rows("test", n, seed, max_operand)
