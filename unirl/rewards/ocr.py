"""OCR reward for text rendering (FlowGRPO's ``ocr_score``, https://arxiv.org/abs/2505.05470).

The target is FlowGRPO's ``prompt.split('"')[1]`` (``flow_grpo/ocr.py``): the text between the
first and second double quote (its OCR prompts read ``... a sign that says "Open 24 Hours" ...``),
or everything after the quote when there is only one. The image is read with RapidOCR
(PP-OCR models in ONNX, shipped inside the ``rapidocr`` wheel, so it runs offline), and with
``target`` and ``recognised`` lowercased and stripped of spaces the score is

* 1 if the target is contained in the recognised text,
* 0 if nothing was recognised,
* ``1 - min(edit_distance, len(target)) / len(target)`` otherwise (Levenshtein distance).

Two deliberate differences from FlowGRPO, where these cases raise: a prompt with no double quote
gives None (the reward does not apply; FlowGRPO's ``split('"')[1]`` raises IndexError), and an
empty target (``""``, or a prompt ending in its only quote) scores 1 if anything was recognised
and 0 if nothing was (FlowGRPO divides by ``len(target) == 0``).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

# Optional dependencies (pip install rapidocr onnxruntime), imported here as registry.BUILTIN_MODULES
# asks: without them `ocr` is listed as unavailable with the package to install (`unirl rewards
# list`, `unirl train ... --dry-run`) instead of failing at the first score. rapidocr itself imports lazily.
import onnxruntime  # noqa: F401
import rapidocr  # noqa: F401

from unirl.rewards.registry import register_reward

_ENGINE = None
_ENGINE_LOCK = threading.Lock()


def quoted_text(prompt: str) -> str | None:
    """FlowGRPO's target ``prompt.split('"')[1]``, or None when the prompt has no double quote.

    >>> quoted_text('A shop sign reading "Open 24 Hours" at night, "Closed" below')
    'Open 24 Hours'
    >>> quoted_text('A sign reading "Open 24 Hours at night'), quoted_text('A sign reading ""')
    ('Open 24 Hours at night', '')
    >>> quoted_text("no quotes") is None
    True
    """
    return prompt.split('"')[1] if '"' in prompt else None


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1).

    >>> edit_distance("kitten", "sitting"), edit_distance("", "abc"), edit_distance("abc", "abc")
    (3, 3, 0)
    """
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_similarity(target: str, recognised: str) -> float:
    """FlowGRPO's score of ``recognised`` against ``target`` (lowercased, spaces removed).

    >>> ocr_similarity("Open 24 Hours", "OPEN 24 HOURS!"), ocr_similarity("Open", ""), ocr_similarity("abcd", "abxd")
    (1.0, 0.0, 0.75)
    """
    target = target.lower().replace(" ", "")
    recognised = recognised.lower().replace(" ", "")
    if not recognised:
        return 0.0
    if not target or target in recognised:
        return 1.0
    return 1.0 - min(edit_distance(recognised, target), len(target)) / len(target)


def _engine():
    """The RapidOCR engine, loaded once per process (thread-safe; onnxruntime sessions are reentrant)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            import logging

            from rapidocr import RapidOCR

            _ENGINE = RapidOCR()
            logging.getLogger("RapidOCR").setLevel(logging.ERROR)  # "detection result is empty" on every blank image
        return _ENGINE


def recognise(image) -> str:
    """All text RapidOCR finds in a PIL image, joined with spaces ('' when none)."""
    result = _engine()(image.convert("RGB"))
    return " ".join(result.txts) if getattr(result, "txts", None) else ""


@register_reward("ocr", modality="image", description="FlowGRPO: OCR edit-distance score of the prompt's quoted text")
def ocr(images: Sequence[Any], *, prompts: Sequence[str], **kwargs: Any) -> list[float | None]:
    """1 - normalised edit distance between the prompt's quoted text and RapidOCR's reading (see module doc)."""
    scores: list[float | None] = []
    for image, prompt in zip(images, prompts, strict=True):
        target = quoted_text(prompt)
        scores.append(None if target is None else ocr_similarity(target, recognise(image)))
    return scores
