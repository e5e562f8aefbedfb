"""The OCR reward's target is FlowGRPO's ``prompt.split('"')[1]`` (flow_grpo/ocr.py, yifan123/flow_grpo ac4c86e).

FlowGRPO's rule is computed here independently and compared over a case list, with the expected
targets also written out by hand, and over every prompt of the shared OCR test split.
"""

from __future__ import annotations

import doctest

import pytest
from PIL import Image

pytest.importorskip("rapidocr", reason="the ocr reward's engine (pip install rapidocr onnxruntime)")
import unirl.rewards.ocr  # noqa: E402
from conftest import shared_data
from unirl.rewards.ocr import ocr, quoted_text


def flowgrpo_target(prompt: str) -> str:
    """FlowGRPO's ``OcrScorer.__call__``: ``prompt.split('"')[1]`` (IndexError without a quote)."""
    return prompt.split('"')[1]


# (prompt, target by hand)
CASES = [
    ('A sign that says "Open 24 Hours" at night', "Open 24 Hours"),
    ('A sign that says "Open 24 Hours', "Open 24 Hours"),  # one quote: everything after it
    ('"Open" at the start', "Open"),
    ('Only a leading quote: "', ""),  # one quote at the end: empty
    ('A poster: "SALE" in red, "50% off" below', "SALE"),  # 4 quotes: between the first two
    ('Three quotes: "a" and "b', "a"),
    ('Five: "x"y"z"w"', "x"),
    ('Empty: "" then "later"', ""),
    ('Newline "inside\nquotes" too', "inside\nquotes"),
    ("Single 'quotes' are not quotes: \"yes", "yes"),
]


@pytest.mark.parametrize("prompt, target", CASES)
def test_target_is_flowgrpo_split(prompt, target):
    assert flowgrpo_target(prompt) == target
    assert quoted_text(prompt) == target


@pytest.mark.parametrize("prompt", ["no quotes at all", "", "curly \u201cquotes\u201d are not ASCII quotes"])
def test_no_quote_does_not_apply(prompt):
    """A deliberate difference: FlowGRPO raises IndexError, unirl's reward does not apply (None)."""
    with pytest.raises(IndexError):
        flowgrpo_target(prompt)
    assert quoted_text(prompt) is None
    assert ocr([Image.new("RGB", (8, 8), "white")], prompts=[prompt]) == [None]  # no OCR run needed


def test_every_shared_ocr_prompt():
    prompts = [line for line in shared_data("ocr", "test.txt").read_text().splitlines() if line.strip()]
    assert len(prompts) == 1018 and all('"' in p for p in prompts)
    assert [quoted_text(p) for p in prompts] == [flowgrpo_target(p) for p in prompts]


def test_one_quote_prompt_is_scored_on_the_text_after_it():
    """End to end with real RapidOCR: the target of a one-quote prompt is what follows the quote."""
    from test_image_rewards import render

    prompts = ['A bakery sign reading "Fresh Bread', 'A bakery sign reading "Closed']
    image = render("Fresh Bread")
    own, other = ocr([image, image], prompts=prompts)
    assert own >= 0.9 and other <= 0.6, (own, other)


def test_ocr_doctests():
    result = doctest.testmod(unirl.rewards.ocr)
    assert result.attempted >= 5 and result.failed == 0
