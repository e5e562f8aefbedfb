r"""GSM8K exact-match reward, with verl's semantics (``verl/utils/reward_score/gsm8k.py``).

The final answer is extracted from a solution in one of two ways:

- ``strict``: the number of the last ``#### N`` (the GSM8K answer format the prompt asks for): a
  marker of exactly four ``#`` then optional spaces and a number, as verl's regex
  ``#### (\-?[0-9\.\,]+)``; no such marker gives None (so "######5" is not an answer).
- ``flexible``: the last number anywhere in the text.

Numbers are normalised before comparison: thousands commas, a leading ``$`` and trailing zeros
after the decimal point are dropped ("1,000" -> "1000", "$5.00" -> "5", "2.50" -> "2.5"); the
sign and real decimals are kept. A ``-`` counts as a sign only when it does not follow a word or
a number, so "16-3" ends in 3, not -3.

The score is ``correct_score`` when the extracted answer equals the gold one, ``format_score``
when an answer was found but differs, and 0 when none was found. Unlike verl, the whole solution
is searched (verl keeps only the last 300 characters for speed).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Sequence

from rewards.registry import register_reward

# A number not glued to a word or another number: optional sign, optional "$", then either an
# integer with correct thousands commas or plain digits, and an optional fraction; or ".5".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-)?\$?"
    r"(?:(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?|(?P<bare_frac>\.\d+))"
)
_MARKED = re.compile(r"(?<!#)####[ \t]*" + _NUMBER.pattern)


def extract_answer(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    r"""The normalised final answer of ``text``, or None when there is none.

    >>> extract_answer("5 + 7 = <<5+7=12>>12 apples\n#### 12")
    '12'
    >>> extract_answer("She pays $1,250.50 in total.", method="flexible")
    '1250.5'
    >>> extract_answer("So the answer is 12.", method="strict") is None
    True
    """
    if method == "strict":
        match = None
        for match in _MARKED.finditer(text):
            pass  # keep the last one
    elif method == "flexible":
        match = None
        for match in _NUMBER.finditer(text):
            pass  # keep the last one
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    return _normalise(match) if match else None


def gold_answer(answer_text: str | int | float) -> str:
    """The normalised gold answer from a bare number ("72") or a GSM8K answer ending in ``#### 72``."""
    text = str(answer_text).strip()
    if "####" in text:
        gold = extract_answer(text, "strict")
    else:
        match = _NUMBER.fullmatch(text.removesuffix("."))
        gold = _normalise(match) if match else None
    if gold is None:
        raise ValueError(f"a GSM8K gold answer must be a number or end in '#### N', got {text[-80:]!r}")
    return gold


@register_reward("gsm8k", modality="text")
def gsm8k(
    samples: Sequence[str],
    *,
    answer: Sequence[str | int | float],
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
    **kwargs: Any,
) -> list[float]:
    r"""GSM8K exact match: correct_score if right, format_score if an answer was found but wrong, else 0.

    ``answer`` is the per-sample gold: a bare number or a full GSM8K answer ending in ``#### N``.

    >>> gsm8k(["3 * 4 = <<3*4=12>>12\n#### 12", "#### 13", "It is 12."], answer=["... #### 12", "12", "12"])
    [1.0, 0.0, 0.0]
    >>> gsm8k(["#### 13", "It is 12."], answer=["12", "12"], method="flexible", format_score=0.1)
    [0.1, 1.0]
    """
    if len(answer) != len(samples):
        raise ValueError(f"gsm8k: {len(samples)} samples but {len(answer)} gold answers")
    scores = []
    for sample, gold in zip(samples, answer):
        predicted = extract_answer(sample, method)
        if predicted is None:
            scores.append(0.0)
        else:
            scores.append(float(correct_score) if predicted == gold_answer(gold) else float(format_score))
    return scores


def _normalise(match: re.Match) -> str:
    integer = (match["int"] or "0").replace(",", "").lstrip("0") or "0"
    fraction = (match["frac"] or match["bare_frac"] or "").rstrip("0").rstrip(".")  # ".50" -> ".5", ".00" -> ""
    number = integer + fraction
    return "-" + number if match["sign"] and number != "0" else number
