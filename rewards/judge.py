"""Judge rewards: a chat model behind any OpenAI-compatible endpoint scores each sample from 1 to 5.

``vlm_judge`` (images) sends the prompt and the image, as a ``data:image/png;base64`` URL, to a
vision-language model, UnifiedReward-style (https://arxiv.org/abs/2503.05236; FlowGRPO's
``unifiedreward`` reward queries a ``vllm serve`` of UnifiedReward-qwen-7b the same way): the judge
weighs the image's alignment with the prompt and its quality, reasons, and ends with
``Final Score: <1-5>``. ``llm_judge`` (text runs) sends the question and the response to a language
model with the same answer format. Both use ``rewards/judge_client.py`` (bounded concurrency,
timeout, retries with backoff) and return the judge's texts with the scores (``ScoresWithText``),
which evaluation keeps in its samples.

The score is the number after the last ``Final Score:`` (markdown bold allowed), as the judge wrote
it (1 to 5; the group-relative advantage does not care for the scale). An answer without one, or
with one outside ``[min_score, max_score]``, is a ``RewardError`` naming the sample and quoting the
answer; ``on_unparsable: none`` makes it "does not apply" (None) for that sample instead.

    rewards:
      - name: vlm_judge
        kwargs: {url: "http://127.0.0.1:8000", model: CodeGoat24/UnifiedReward-qwen-7b}
"""

from __future__ import annotations

import base64
import io
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

#: The text judge's instruction: ``{prompt}`` is the question, ``{response}`` the answer judged.
TEXT_TEMPLATE = (
    "You are shown a question and a response to it. Judge the response: is it correct, does it answer "
    "what was asked, is it clear? Explain briefly, then end your answer with one line of the form "
    "'Final Score: N', N a number from 1 (poor) to 5 (excellent).\nQuestion: {prompt}\nResponse: {response}"
)

_SCORE = re.compile(r"final\s+score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_score(answer: str) -> float | None:
    """The number after the judge's last ``Final Score:``, or None when there is none.

    >>> parse_score("The cat is red. Final Score: 4"), parse_score("**Final Score:** 3.5"), parse_score("great!")
    (4.0, 3.5, None)
    """
    found = _SCORE.findall(answer)
    return float(found[-1]) if found else None


def image_data_url(image: Any) -> str:
    """A PIL image (or HxWx3 uint8 array) as a ``data:image/png;base64,...`` URL (PNG: the exact pixels)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        import numpy as np

        image = Image.fromarray(np.asarray(image))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class _Judge:
    """What both judges share: the client, the template, and turning answers into checked scores."""

    default_template = ""

    def __init__(self, *, url: str, model: str, template: str | None = None, min_score: float = 1.0,
                 max_score: float = 5.0, on_unparsable: str = "error", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 1.0, concurrency: int = 8, max_tokens: int = 512, temperature: float = 0.0,
                 api_key_env: str | None = None):
        if on_unparsable not in ("error", "none"):
            raise RewardError(f"{type(self).__name__}: on_unparsable must be 'error' or 'none', got {on_unparsable!r}")
        if not min_score < max_score:
            raise RewardError(f"{type(self).__name__}: min_score must be below max_score, got {min_score}, {max_score}")
        self.template = template if template is not None else self.default_template
        self.min_score, self.max_score, self.on_unparsable = float(min_score), float(max_score), on_unparsable
        self.client = ChatClient(url, model, timeout=timeout, retries=retries, backoff=backoff, concurrency=concurrency,
                                 max_tokens=max_tokens, temperature=temperature, api_key_env=api_key_env)

    def _scores(self, answers: list[str], prompts: Sequence[str]) -> ScoresWithText:
        scores = []
        for i, answer in enumerate(answers):
            score = parse_score(answer)
            if score is None or not self.min_score <= score <= self.max_score:
                if self.on_unparsable == "none":
                    scores.append(None)
                    continue
                what = "no 'Final Score: N'" if score is None else f"a score {score:g} outside [{self.min_score:g}, {self.max_score:g}]"
                raise RewardError(f"{type(self).__name__}: the judge's answer for sample {i} (prompt {prompts[i][:120]!r}) "
                                  f"has {what}; it answered {answer[:300]!r}")
            scores.append(score)
        return ScoresWithText(scores, answers)


@register_reward("vlm_judge", modality="image")
class VLMJudge(_Judge):
    """A vision-language model behind an OpenAI-compatible endpoint scores prompt alignment and quality, 1 to 5."""

    default_template = IMAGE_TEMPLATE

    def __call__(self, samples: Sequence[Any], *, prompts: Sequence[str], **columns: Any) -> ScoresWithText:
        conversations = [[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url(image)}},
            {"type": "text", "text": self.template.format(prompt=prompt)},
        ]}] for image, prompt in zip(samples, prompts)]
        return self._scores(self.client.ask_all(conversations), prompts)


@register_reward("llm_judge", modality="text")
class LLMJudge(_Judge):
    """A language model behind an OpenAI-compatible endpoint scores each response to its prompt, 1 to 5."""

    default_template = TEXT_TEMPLATE

    def __call__(self, samples: Sequence[str], *, prompts: Sequence[str], **columns: Any) -> ScoresWithText:
        conversations = [[{"role": "user", "content": self.template.format(prompt=prompt, response=response)}]
                         for response, prompt in zip(samples, prompts)]
        return self._scores(self.client.ask_all(conversations), prompts)
