"""Search-R1's exact-match reward against its formula re-typed here, on hand-written and random cases."""

from __future__ import annotations

import random
import re
import string

import pytest

from unirl.rewards import RewardError, load_reward


def reference_normalize(s):  # Search-R1 qa_em.normalize_answer, re-typed step by step
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def reference_em(solution, golds, format_score=0.0, score=1.0):
    matches = list(re.finditer(r"<answer>(.*?)</answer>", solution, re.DOTALL))
    if not matches:
        return 0
    answer = matches[-1].group(1).strip()
    golds = [golds] if isinstance(golds, str) else golds
    return score if any(reference_normalize(g) == reference_normalize(answer) for g in golds) else format_score


CASES = [
    ("<search>x</search>\n\n<information>Doc 1(Title: A) y</information>\n\n<answer> The Eiffel Tower! </answer>",
     ["eiffel tower"], 1.0),
    ("<answer>Paris</answer> then <answer>London</answer>", ["paris"], 0.0),  # the last answer counts
    ("no answer tag: Paris", ["Paris"], 0.0),
    ("<answer>an apple a day</answer>", ["Apple day"], 1.0),
    ("<answer>theatre</answer>", ["atre"], 0.0),  # articles removed as words only
    ("<answer>4,821</answer>", "4821", 1.0),
]


@pytest.mark.parametrize("sample, gold, expected", CASES)
def test_hand_written_cases(sample, gold, expected):
    assert load_reward("em")([sample], golden_answers=[gold]) == [expected]
    assert reference_em(sample, gold) == expected


@pytest.mark.parametrize("seed", range(4))
def test_against_the_reference_formula_on_random_strings(seed):
    rng = random.Random(seed)
    words = ["the", "a", "an", "Paris", "paris,", "New", "york", "THE", "theory", "!", "?", "  ", "x.y"]
    samples, golds = [], []
    for _ in range(200):
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        gold = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.3:
            gold.append(answer.upper())
        samples.append(f"think... <answer>{answer}</answer>" if rng.random() < 0.9 else answer)
        golds.append(gold)
    fn = load_reward("em", format_score=0.1)
    assert fn(samples, golden_answers=golds) == [reference_em(s, g, format_score=0.1) for s, g in zip(samples, golds)]


def test_gold_from_answer_column_and_bad_gold_named():
    assert load_reward("em")(["<answer>x</answer>"], answer=["X"]) == [1.0]
    with pytest.raises(RewardError, match="sample 0: gold answers must be"):
        load_reward("em")(["<answer>x</answer>"], golden_answers=[[1]])
