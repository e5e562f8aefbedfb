r"""Math answer equivalence with Hugging Face's math-verify (https://github.com/huggingface/Math-Verify).

Unlike ``gsm8k`` (exact match of a normalised number), math-verify parses LaTeX and plain
expressions into sympy and compares them symbolically, so ``\frac{1}{2}``, ``0.5`` and
``\boxed{\dfrac12}`` are one answer, and sets, intervals and matrices compare as such.

Semantics follow TRL's ``accuracy_reward`` (``trl/rewards/accuracy_rewards.py``): the gold is
parsed with math-verify's defaults (first match); the sample is parsed as LaTeX only, preferring a
``\boxed{}`` answer, without falling back to a bare number anywhere in the text. The score is
``correct_score`` when they are equivalent, else ``wrong_score``; a gold that cannot be parsed
gives ``None`` (the reward does not apply to that sample), so a bad dataset row is skipped rather
than punished.

math-verify bounds each parse and comparison with ``signal.alarm``, which works only in the main
thread. In a worker thread (``trainer.reward_workers > 0``) the timeouts are switched off, as
math-verify itself advises; a pathological expression can then take longer.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import math_verify  # the package (this module is unirl.rewards.mathverify, so the name does not shadow it)
from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig

from unirl.rewards.registry import register_reward

_SAMPLE_EXTRACTION = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
        ),
        boxed_match_priority=0,  # a \boxed{} answer wins over any other LaTeX in the text
        try_extract_without_anchor=False,
    )
]


@register_reward("math_verify", modality="text")
def math_verify_reward(
    samples: Sequence[str],
    *,
    answer: Sequence[str | int | float],
    correct_score: float = 1.0,
    wrong_score: float = 0.0,
    timeout_seconds: int = 5,
    **kwargs: Any,
) -> list[float | None]:
    r"""Symbolic math answer match (math-verify): correct_score if equivalent, else wrong_score; None if the gold is unparseable.

    ``answer`` is the per-sample gold, as LaTeX (``$\frac{1}{2}$``) or a plain number.

    >>> math_verify_reward([r"so $\boxed{\frac{1}{2}}$", r"$\boxed{0.4}$", "no idea"], answer=["$0.5$"] * 3)
    [1.0, 0.0, 0.0]
    >>> math_verify_reward(["$1$"], answer=["not math at all"])
    [None]
    """
    if len(answer) != len(samples):
        raise ValueError(f"math_verify: {len(samples)} samples but {len(answer)} gold answers")
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    scores: list[float | None] = []
    for sample, gold_text in zip(samples, answer):
        gold = math_verify.parse(str(gold_text), extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:
            scores.append(None)
            continue
        predicted = math_verify.parse(
            sample, extraction_config=_SAMPLE_EXTRACTION, extraction_mode="first_match", parsing_timeout=timeout
        )
        ok = math_verify.verify(gold, predicted, timeout_seconds=timeout)
        scores.append(float(correct_score) if ok else float(wrong_score))
    return scores
