r"""Exact-match QA reward: Search-R1's ``em`` (``verl/utils/reward_score/qa_em.py`` in
https://github.com/PeterGriffinJin/Search-R1, ``compute_score_em``).

- The answer is the last ``<answer>...</answer>`` of the trajectory, stripped. Search-R1 requires
  two matches because its solution string holds the prompt, whose instruction shows one example
  tag; unirl's samples are the response alone (its turns and observations), so one match is enough.
- Normalisation (SQuAD's, as Search-R1 uses it): lower case, punctuation removed, the articles
  a/an/the removed as words, whitespace collapsed.
- ``score`` (1.0) when the normalised answer equals any normalised gold answer, ``format_score``
  (Search-R1's default 0.0) when an answer was given but is wrong, 0 when there is none.

The gold comes from the dataset's ``golden_answers`` column (Search-R1's NQ/HotpotQA files: a list
of strings) or, failing that, its ``answer`` column (a string or a list).
"""

from __future__ import annotations

import re
import string
from typing import Any, Sequence

from unirl.rewards.registry import RewardError, register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(trajectory: str) -> str | None:
    """The last ``<answer>`` of a trajectory, stripped; None when there is none."""
    found = _ANSWER.findall(trajectory)
    return found[-1].strip() if found else None


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalize_answer(g) == normalized for g in golds)


@register_reward("em")
def em(samples: Sequence[str], *, golden_answers: Sequence[Any] | None = None, answer: Sequence[Any] | None = None,
       score: float = 1.0, format_score: float = 0.0, **kwargs) -> list[float]:
    """Search-R1's exact match of the last <answer> with any gold answer (SQuAD normalisation)."""
    golds = golden_answers if golden_answers is not None else answer
    if golds is None:
        raise RewardError("em needs the dataset's gold answers in a 'golden_answers' or 'answer' column")
    out = []
    for i, (sample, gold) in enumerate(zip(samples, golds)):
        gold = [gold] if isinstance(gold, str) else list(gold or [])
        if not gold or not all(isinstance(g, str) for g in gold):
            raise RewardError(f"em: sample {i}: gold answers must be a string or a list of strings, got {gold!r}")
        predicted = final_answer(sample)
        out.append(0.0 if predicted is None else (score if exact_match(predicted, gold) else format_score))
    return out
