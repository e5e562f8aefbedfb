"""The gsm8k reward's ``strict`` and ``flexible`` methods score exactly as verl's ``compute_score``.

verl's formula is written again here, from its source (``verl/utils/reward_score/gsm8k.py`` and
``examples/data_preprocess/gsm8k.py`` at volcengine/verl b178a3c), not imported from the project,
and compared case for case: on a hand-written list with the expected scores derived by hand, and
on every model solution in ``../shared/data/gsm8k/example_model_solutions.jsonl``.
"""

from __future__ import annotations

import json
import re

import pytest

from conftest import shared_data
from unirl.rewards.gsm8k import gsm8k

FORMAT = 0.1  # a format_score that is neither 0 nor 1, so "no answer" and "wrong answer" differ
MODELS = ("175b_finetuning", "175b_verification", "6b_finetuning", "6b_verification")


def verl_extract(solution: str, method: str) -> str | None:
    """verl's ``extract_solution``: the last 300 characters, then the last marked / last number."""
    solution = solution[-300:] if len(solution) > 300 else solution
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", solution)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = re.findall(r"(\-?[0-9\.\,]+)", solution)
    if not found:
        return None
    for final in reversed(found):  # verl's loop: when every match is invalid it ends on found[0]
        if final not in ("", "."):
            break
    return final


def verl_score(solution: str, ground_truth: str, method: str, format_score: float = FORMAT) -> float:
    """verl's ``compute_score`` with ``score=1``."""
    answer = verl_extract(solution, method)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth else format_score


def verl_gold(answer: str) -> str:
    """verl's GSM8K preprocessing: the number after the first ``#### ``, commas removed."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    assert match is not None, answer
    return match.group(0).split("#### ")[1].replace(",", "")


LONG_TAIL = "then 5 more. " * 30  # 390 characters, its last number is 5 and its last match "."

# (solution, gold, strict score, flexible score), by hand, with format_score 0.1.
CASES = [
    ("####12", "12", 0.0, 1.0),  # strict needs "#### " with the space; flexible finds 12
    ("#### 12.00", "12", FORMAT, FORMAT),  # "12.00" != "12": no numeric normalising
    ("#### $12", "12", 0.0, 1.0),  # "$" is not in the number class, so no strict match
    ("#### 012", "12", FORMAT, FORMAT),  # "012" != "12"
    ("##### 12", "12", 1.0, 1.0),  # the last four "#" and the space match
    ("###### 5", "5", 1.0, 1.0),
    ("######5", "5", 0.0, 1.0),  # no space after the #'s: no strict match
    ("####  12", "12", 0.0, 1.0),  # two spaces: "#### " is followed by a space, not a number
    ("####\t12", "12", 0.0, 1.0),
    ("#### 1,000", "1000", 1.0, FORMAT),  # strict drops commas; flexible keeps "1,000"
    ("#### 1,000", "1,000", FORMAT, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### .5", "0.5", FORMAT, FORMAT),
    ("#### 1.2.3", "1.2.3", 1.0, 1.0),
    ("#### 12, then 13", "12", 1.0, FORMAT),  # strict "12," -> "12"; flexible's last number is 13
    ("#### 12\nwait\n#### 13", "12", FORMAT, FORMAT),  # the last marker counts
    ("#### 13\nno: #### 12", "12", 1.0, 1.0),
    ("#### 12\n" + "a" * 300, "12", 0.0, 0.0),  # the only number lies before the last 300 characters
    ("#### 12\n" + LONG_TAIL, "12", 0.0, FORMAT),  # flexible sees only the tail's 5
    ("x" * 50 + "#### 12" + "y" * 293, "12", 1.0, 1.0),  # the marker starts the 300-character window
    ("x" * 50 + "#### 12" + "y" * 294, "12", 0.0, 1.0),  # one more: the window starts at "### 12"
    ("#### 1234" + "z" * 297, "1234", 0.0, FORMAT),  # the window cuts the number to "234"
    ("The answer is 12.", "12", 0.0, FORMAT),  # flexible captures "12." with its full stop
    ("16-12", "12", 0.0, FORMAT),  # flexible's last match is "-12"
    ("The end.", "12", 0.0, FORMAT),  # flexible: only "." matched, verl's loop ends on it: format score
    ("I do not know", "12", 0.0, 0.0),
    ("", "12", 0.0, 0.0),
    ("#### 12", " 12\n", 1.0, 1.0),  # a bare gold is stripped of whitespace
    ("#### 12", "Natalia sold 3 * 4 = <<3*4=12>>12.\n#### 12", 1.0, 1.0),  # a full GSM8K answer as gold
    ("#### 1,800", "so 16 - 3 - 4 = 9 eggs.\n#### 1,800", 1.0, FORMAT),  # gold "1800", commas removed
]


@pytest.mark.parametrize("solution, gold, strict, flexible", CASES)
def test_hand_cases_score_as_verl(solution, gold, strict, flexible):
    truth = verl_gold(gold) if "####" in gold else gold.strip()
    # The hand-derived scores are verl's ...
    assert (verl_score(solution, truth, "strict"), verl_score(solution, truth, "flexible")) == (strict, flexible)
    # ... and the project's.
    assert gsm8k([solution], answer=[gold], method="strict", format_score=FORMAT) == [strict]
    assert gsm8k([solution], answer=[gold], method="flexible", format_score=FORMAT) == [flexible]


def test_default_method_is_verl_strict():
    samples = ["#### 12", "####12", "#### 12.00", "##### 12", "It is 12."]
    assert gsm8k(samples, answer=["12"] * 5) == [verl_score(s, "12", "strict", 0.0) for s in samples] == [
        1.0, 0.0, 0.0, 1.0, 0.0
    ]


def model_solutions() -> list[tuple[str, str]]:
    """(solution, gold) for every model solution; the gold is the ground truth with its "A: N" line as "#### N"."""
    path = shared_data("gsm8k", "example_model_solutions.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = []
    for row in rows:
        gold = re.sub(r"^A: ", "#### ", row["ground_truth"], flags=re.M)
        pairs += [(row[model]["solution"], gold) for model in MODELS]
    return pairs


@pytest.mark.parametrize("method", ["strict", "flexible"])
@pytest.mark.parametrize("marker", ["A: ", "#### "], ids=["as-written", "answer-line-as-marker"])
def test_example_model_solutions_score_as_verl(method, marker):
    """Every solution, as written ("A: N" last line) and with its answer lines in GSM8K's "#### N" format."""
    pairs = model_solutions()
    samples = [re.sub(r"^A: ", marker, solution, flags=re.M) for solution, _ in pairs]
    golds = [gold for _, gold in pairs]
    ours = gsm8k(samples, answer=golds, method=method, format_score=FORMAT)
    theirs = [verl_score(s, verl_gold(g), method) for s, g in zip(samples, golds)]
    assert len(samples) == 4 * 1319
    disagree = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert disagree == [], f"{len(disagree)} of {len(samples)} differ from verl, e.g. {samples[disagree[0]][-120:]!r}"
    # The comparison is not vacuous: right and wrong answers both occur, except that no solution as
    # written has a "####" marker, so verl's strict scores every one 0.
    if marker == "A: " and method == "strict":
        assert set(theirs) == {0.0}
    else:
        assert {FORMAT, 1.0} <= set(theirs)
