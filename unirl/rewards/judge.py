"""Judge rewards: a chat model behind any OpenAI-compatible endpoint scores each sample, 1 to 5 by default.

``vlm_judge`` (images, this file) sends the prompt and the image, as a ``data:image/png;base64`` URL, to a
vision-language model, UnifiedReward-style (https://arxiv.org/abs/2503.05236; FlowGRPO's
``unifiedreward`` reward queries a ``vllm serve`` of UnifiedReward-qwen-7b the same way): the judge
weighs the image's alignment with the prompt and its quality, reasons, and ends with
``Final Score: <1-5>``. ``llm_judge`` (text runs, ``unirl/rewards/llm_judge.py``) sends a rubric with the
question and the response to a language model. Both are a ``Judge``: one client
(``unirl/rewards/judge_client.py``: bounded concurrency, timeout, retries with backoff, a cache of answers),
one score parser, and the judge's texts returned with the scores (``ScoresWithText``), which evaluation
keeps in its samples.

The score (``score_format``): ``final_score``, the number after the answer's last ``Final Score:``
(markdown bold allowed); ``number``, the answer's first number ("4 out of 5" is 4); ``json``, the
field ``json_field`` of the first JSON object in the answer. An answer without one, or with one
outside ``[min_score, max_score]``, is unparsable, and ``on_unparsable`` says what it becomes:
``error`` (the default) stops the run with a ``RewardError`` naming the sample and quoting the
answer; ``none`` makes the reward "not apply" to that sample (None: left out of the reward's mean;
with several rewards the sample's total is the others'); ``min`` gives it ``min_score``, the rubric's
lowest, so that an answer which makes the judge babble is never worth more than the worst real one.
Never a silent 0: with ``none`` or ``min``, every step logs the fraction it happened to as
``reward/<name>/parse_failed``.

    rewards:
      - name: vlm_judge
        kwargs: {url: "http://127.0.0.1:8000", model: CodeGoat24/UnifiedReward-qwen-7b}
"""

from __future__ import annotations

import base64
import io
import json
import re
from typing import Any, Sequence

from unirl.rewards.judge_client import ChatClient
from unirl.rewards.registry import RewardError, ScoresWithText, register_reward

#: The image judge's instruction (UnifiedReward's point-score task, in our words): ``{prompt}`` is the caption.
IMAGE_TEMPLATE = (
    "You are shown an image generated from the caption below. Judge it on two things: how faithfully it "
    "shows what the caption asks for (every object, count, colour, position and attribute named), and its "
    "quality as an image (clear, detailed, natural, free of artefacts). Think through the caption's key "
    "elements one by one, then end your answer with one line of the form 'Final Score: N', N a number "
    "from 1 (poor) to 5 (excellent).\nCaption: {prompt}"
)

_SCORE = re.compile(r"final\s+score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
SCORE_FORMATS = ("final_score", "number", "json")
UNPARSABLE = ("error", "none", "min")


def parse_score(answer: str, score_format: str = "final_score", json_field: str = "score") -> float | None:
    """The judge's score in ``answer`` by ``score_format`` (module docstring), or None when there is none.

    >>> parse_score("The cat is red. Final Score: 4"), parse_score("**Final Score:** 3.5"), parse_score("great!")
    (4.0, 3.5, None)
    >>> parse_score(" 4.", "number"), parse_score("I'd say 4 out of 5", "number"), parse_score("#### 7", "number")
    (4.0, 4.0, 7.0)
    >>> parse_score('Sure: {"reason": "right", "score": 5}', "json"), parse_score('{"score": "high"}', "json")
    (5.0, None)
    """
    if score_format == "final_score":
        found = _SCORE.findall(answer)
        return float(found[-1]) if found else None
    if score_format == "number":
        match = _NUMBER.search(answer)
        return float(match.group(0)) if match else None
    value = _first_json_object(answer).get(json_field)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _first_json_object(answer: str) -> dict:
    """The first ``{...}`` in ``answer`` that parses as a JSON object (a fenced block's too), else {}."""
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(answer) if c == "{"):
        try:
            value, _ = decoder.raw_decode(answer, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def image_data_url(image: Any) -> str:
    """A PIL image (or HxWx3 uint8 array) as a ``data:image/png;base64,...`` URL (PNG: the exact pixels)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        import numpy as np

        image = Image.fromarray(np.asarray(image))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class Judge:
    """What every judge shares: the client, the template, and turning answers into checked scores (module
    docstring). A judge builds its conversations and calls ``judge(conversations, prompts)``."""

    default_template = ""

    def __init__(self, *, url: str, model: str, template: str | None = None, min_score: float = 1.0,
                 max_score: float = 5.0, score_format: str = "final_score", json_field: str = "score",
                 on_unparsable: str = "error", timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 concurrency: int = 8, max_tokens: int = 512, temperature: float = 0.0,
                 api_key_env: str | None = None, cache_size: int = 4096):
        name = type(self).__name__
        if on_unparsable not in UNPARSABLE:
            raise RewardError(f"{name}: on_unparsable must be one of {', '.join(UNPARSABLE)}, got {on_unparsable!r}")
        if score_format not in SCORE_FORMATS:
            raise RewardError(f"{name}: score_format must be one of {', '.join(SCORE_FORMATS)}, got {score_format!r}")
        if not min_score < max_score:
            raise RewardError(f"{name}: min_score must be below max_score, got {min_score}, {max_score}")
        self.template = template if template is not None else self.default_template
        self.min_score, self.max_score, self.on_unparsable = float(min_score), float(max_score), on_unparsable
        self.score_format, self.json_field = score_format, json_field
        self.client = ChatClient(url, model, timeout=timeout, retries=retries, backoff=backoff, concurrency=concurrency,
                                 max_tokens=max_tokens, temperature=temperature, api_key_env=api_key_env,
                                 cache_size=cache_size)

    def judge(self, conversations: list[list[dict]], prompts: Sequence[str]) -> ScoresWithText:
        """Ask the judge about every conversation and parse each answer's score."""
        return self._scores(self.client.ask_all(conversations), prompts)

    def _scores(self, answers: list[str], prompts: Sequence[str]) -> ScoresWithText:
        scores, failed = [], []
        for i, answer in enumerate(answers):
            score = parse_score(answer, self.score_format, self.json_field)
            bad = score is None or not self.min_score <= score <= self.max_score
            failed.append(bad)
            if bad and self.on_unparsable == "error":
                what = (self._expected() if score is None
                        else f"a score {score:g} outside [{self.min_score:g}, {self.max_score:g}]")
                raise RewardError(f"{type(self).__name__}: the judge's answer for sample {i} (prompt {prompts[i][:120]!r}) "
                                  f"has {what}; it answered {answer[:300]!r} (on_unparsable: none or min goes on)")
            scores.append(score if not bad else None if self.on_unparsable == "none" else self.min_score)
        return ScoresWithText(scores, answers, failed=failed)

    def _expected(self) -> str:
        return {"final_score": "no 'Final Score: N'", "number": "no number",
                "json": f"no JSON object with a number in {self.json_field!r}"}[self.score_format]


@register_reward("vlm_judge", modality="image")
class VLMJudge(Judge):
    """A vision-language model behind an OpenAI-compatible endpoint scores prompt alignment and quality, 1 to 5."""

    default_template = IMAGE_TEMPLATE

    def __call__(self, samples: Sequence[Any], *, prompts: Sequence[str], **columns: Any) -> ScoresWithText:
        conversations = [[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(image)}},
            {"type": "text", "text": self.template.format(prompt=prompt)},
        ]}] for image, prompt in zip(samples, prompts)]
        return self.judge(conversations, prompts)
