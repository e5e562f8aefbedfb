r"""verl's Geometry3K reward (``verl/utils/reward_score/geo3k.py``): a boxed answer graded against the gold, plus
a small score for the think/boxed format.

``score = (1 - format_score) * accuracy + format_score * format``, ``format_score`` 0.1 as in verl, where

- ``format`` is 1 when the whole answer matches verl's ``<think>.*</think>.*\boxed\{.*\}.*`` (dot matches
  newlines), else 0;
- ``accuracy`` is 1 when the content of the answer's last ``\boxed{...}`` (braces balanced, as mathruler's
  ``extract_boxed_content``) equals the gold. verl grades with mathruler's ``grade_answer`` (a normalised string
  match, then a sympy comparison); unirl, without that package, compares the normalised strings (spaces,
  ``\left``/``\right``, ``\dfrac``/``\tfrac``, degree marks and a trailing ``.`` dropped) and then asks
  math-verify whether the two expressions are equal. Answers that only one of the two graders accepts can
  exist; the tests pin the common cases (``\frac{3}{2}`` = ``1.5``, ``2\sqrt{3}`` = ``2 \sqrt 3``).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Sequence

from unirl.rewards.registry import register_reward

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_DROP = (r"\left", r"\right", r"^\circ", r"^{\circ}", "°", r"\!", r"\,", r"\;", "$")


def boxed_content(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (nested braces kept), or None.

    >>> boxed_content(r"so \boxed{1} then \boxed{\frac{2}{3}} end"), boxed_content("no box")
    ('\\frac{2}{3}', None)
    """
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None  # unbalanced: no answer


def normalise(answer: str) -> str:
    for piece in _DROP:
        answer = answer.replace(piece, "")
    answer = answer.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    return "".join(answer.split()).rstrip(".")


def same_answer(predicted: str, gold: str) -> bool:
    """Normalised strings equal, else math-verify's symbolic equality (when installed)."""
    if normalise(predicted) == normalise(gold):
        return True
    try:
        import math_verify
    except ImportError:
        return False
    # math-verify's timeouts use signal.alarm, which works in the main thread only (unirl/rewards/mathverify.py)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = math_verify.parse(f"${normalise(gold)}$", parsing_timeout=timeout)
    predicted_parsed = math_verify.parse(f"${normalise(predicted)}$", parsing_timeout=timeout)
    return bool(gold_parsed and predicted_parsed and math_verify.verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


@register_reward("geo3k", modality="text")
def geo3k(samples: Sequence[str], *, answer: Sequence[Any], format_score: float = 0.1, **kwargs: Any) -> list[float]:
    r"""verl's geometry3k score: 0.9 for a correct last \boxed{} answer, 0.1 for the <think>...</think> ... \boxed{} format.

    >>> geo3k([r"<think>ok</think> \boxed{3}", r"\boxed{3}", r"<think></think> \boxed{4}"], answer=["3"] * 3)
    [1.0, 0.9, 0.1]
    """
    if len(answer) != len(samples):
        raise ValueError(f"geo3k: {len(samples)} samples but {len(answer)} gold answers")
    scores = []
    for sample, gold in zip(samples, answer):
        boxed = boxed_content(sample)
        correct = boxed is not None and same_answer(boxed, str(gold))
        formatted = _FORMAT.fullmatch(sample) is not None
        scores.append((1.0 - format_score) * float(correct) + format_score * float(formatted))
    return scores
