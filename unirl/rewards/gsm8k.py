r"""GSM8K exact-match reward: verl's scoring (``strict``, ``flexible``) and a normalising variant.

``strict`` and ``flexible`` are verl's ``compute_score`` (``verl/utils/reward_score/gsm8k.py``,
checked against volcengine/verl b178a3c), case for case; ``tests/test_gsm8k_verl.py`` compares
them with verl's formula written independently:

- only the last 300 characters of the solution are searched (verl's speed-up), so an answer
  further back is not seen;
- ``strict``: the number captured by the last match of ``#### (\-?[0-9\.\,]+)``, commas removed.
  It needs "#### " (with one space) right before the number: "##### 12" matches (on its last
  four "#"), while "####12", "####  12" and "#### $12" give no answer;
- ``flexible``: the last match of ``(\-?[0-9\.\,]+)`` other than ".", as written: commas, a
  full stop and a "-" glued to a previous number stay ("1,000", "12.", "16-3" gives "-3"). When
  "." is the only match, verl's loop ends on it, so "." is the (never right) answer;
- the answer is compared with the gold as a string: "12.00", "012" and "12." are not "12".

The gold for these two is what verl's data preprocessing stores (``examples/data_preprocess/
gsm8k.py``): a bare answer as is (surrounding whitespace stripped), or, for a full GSM8K answer
ending in "#### 72", the number after its first "#### " with commas removed.

``strict_normalized`` and ``flexible_normalized`` are unirl's own, more forgiving extraction
(not verl's): the last ``####`` marker (exactly four "#", then optional spaces or tabs) or the
last number, over the whole solution, normalised on both sides: thousands commas, a leading "$"
and trailing decimal zeros are dropped and leading zeros stripped ("$1,000.50" -> "1000.5",
"012" -> "12"); a "-" is a sign only when it does not follow a word or a number. So "####12",
"#### 12.00", "#### $12" and "#### 012" all read 12, and "##### 12" reads nothing.

Every method scores ``correct_score`` when the answer equals the gold, ``format_score`` when an
answer was found but differs, and 0 when none was found (verl's ``score``, ``format_score``).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Sequence

from unirl.rewards.registry import register_reward

Method = Literal["strict", "flexible", "strict_normalized", "flexible_normalized"]
METHODS = ("strict", "flexible", "strict_normalized", "flexible_normalized")

# verl: the window it searches and its two patterns.
_VERL_WINDOW = 300
_VERL_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_VERL_MARKED = re.compile(r"#### (\-?[0-9\.\,]+)")

# unirl's normalising extraction: a number not glued to a word or another number: optional sign,
# optional "$", then an integer with correct thousands commas or plain digits, and an optional
# fraction; or ".5".
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>-)?\$?"
    r"(?:(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?|(?P<bare_frac>\.\d+))"
)
_MARKED = re.compile(r"(?<!#)####[ \t]*" + _NUMBER.pattern)


def extract_answer(text: str, method: Method = "strict") -> str | None:
    r"""The final answer of ``text`` by ``method`` (see the module doc), or None when there is none.

    >>> extract_answer("5 + 7 = <<5+7=12>>12 apples\n#### 12"), extract_answer("##### 1,250")
    ('12', '1250')
    >>> extract_answer("####12") is None, extract_answer("#### 12.00"), extract_answer("So it is 12.", "flexible")
    (True, '12.00', '12.')
    >>> extract_answer("#### 1,250", "flexible"), extract_answer("The end.", "flexible")
    ('1,250', '.')
    >>> extract_answer("####12", "strict_normalized"), extract_answer("She pays $1,250.50.", "flexible_normalized")
    ('12', '1250.5')
    """
    if method == "strict":
        found = _VERL_MARKED.findall(text[-_VERL_WINDOW:])
        return found[-1].replace(",", "") if found else None  # verl also drops "$", which cannot be captured
    if method == "flexible":
        found = _VERL_NUMBER.findall(text[-_VERL_WINDOW:])
        numbers = [number for number in found if number != "."]
        return numbers[-1] if numbers else ("." if found else None)
    if method == "strict_normalized":
        match = None
        for match in _MARKED.finditer(text):
            pass  # keep the last one
    elif method == "flexible_normalized":
        match = None
        for match in _NUMBER.finditer(text):
            pass  # keep the last one
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    return _normalise(match) if match else None


def gold_answer(answer_text: str | int | float, method: Method = "strict") -> str:
    """The gold answer ``method`` compares with, from a bare answer ("72") or a GSM8K answer ending in ``#### 72``.

    >>> gold_answer("... so 1,800 eggs.\\n#### 1,800"), gold_answer(" 72.0 "), gold_answer("72.0", "strict_normalized")
    ('1800', '72.0', '72')
    """
    text = str(answer_text).strip()
    if method in ("strict", "flexible"):
        if "####" not in text:
            return text
        match = _VERL_MARKED.search(text)  # verl's preprocessing takes the first "#### N"
        if match is None:
            raise ValueError(f"a GSM8K answer with '####' must have '#### N' (one space, a number), got {text[-80:]!r}")
        return match.group(1).replace(",", "")
    if "####" in text:
        gold = extract_answer(text, "strict_normalized")
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
    method: Method = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
    **kwargs: Any,
) -> list[float]:
    r"""GSM8K exact match: correct_score if right, format_score if an answer was found but wrong, else 0.

    ``answer`` is the per-sample gold: a bare number or a full GSM8K answer ending in ``#### N``.
    ``method`` is ``strict`` or ``flexible`` (verl's) or ``strict_normalized`` or
    ``flexible_normalized`` (unirl's normalising extraction); see the module doc.

    >>> gsm8k(["3 * 4 = <<3*4=12>>12\n#### 12", "#### 13", "It is 12.", "#### 12.00"], answer=["... #### 12"] + ["12"] * 3)
    [1.0, 0.0, 0.0, 0.0]
    >>> gsm8k(["#### 13", "It is 12", "It is 12."], answer=["12"] * 3, method="flexible", format_score=0.1)
    [0.1, 1.0, 0.1]
    >>> gsm8k(["#### 12.00", "It is 12."], answer=["12", "12"], method="flexible_normalized")
    [1.0, 1.0]
    """
    if len(answer) != len(samples):
        raise ValueError(f"gsm8k: {len(samples)} samples but {len(answer)} gold answers")
    scores = []
    for sample, gold in zip(samples, answer):
        predicted = extract_answer(sample, method)
        if predicted is None:
            scores.append(0.0)
        else:
            scores.append(float(correct_score) if predicted == gold_answer(gold, method) else float(format_score))
    return scores


def _normalise(match: re.Match) -> str:
    integer = (match["int"] or "0").replace(",", "").lstrip("0") or "0"
    fraction = (match["frac"] or match["bare_frac"] or "").rstrip("0").rstrip(".")  # ".50" -> ".5", ".00" -> ""
    number = integer + fraction
    return "-" + number if match["sign"] and number != "0" else number
