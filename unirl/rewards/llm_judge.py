"""``llm_judge``: a language model behind an OpenAI-compatible ``/v1/chat/completions`` scores each text
response to its prompt against a rubric (LLM-as-judge; a generative reward model).

The rubric (``template``) is a string with ``{prompt}`` and ``{response}`` (and any dataset column by
name, e.g. ``{answer}`` for a reference answer), sent as one user message. The judge's answer is parsed
by ``score_format`` (``final_score``, ``number`` or ``json`` with ``json_field``), and an unparsable one
becomes what ``on_unparsable`` says, counted in ``reward/llm_judge/parse_failed`` (``unirl/rewards/judge.py``).
Requests go out ``concurrency`` at a time (the server batches them), with a ``timeout``, ``retries``
with exponential ``backoff`` and a cache of answers keyed by the request (model, rubric with prompt and
response, sampling settings): the client the image judge uses (``unirl/rewards/judge_client.py``).

    rewards:
      - name: llm_judge
        kwargs: {url: "http://127.0.0.1:8000", model: Qwen/Qwen2.5-7B-Instruct, on_unparsable: min}

Serve the judge with ``vllm serve MODEL`` (or any OpenAI-compatible server); a config that judges with
SmolLM2-135M-Instruct is ``configs/text/smollm2_judge.yaml``.
"""

from __future__ import annotations

import string
from typing import Any, Sequence

from unirl.rewards.judge import Judge
from unirl.rewards.registry import RewardError, ScoresWithText, register_reward

#: The default rubric: ``{prompt}`` is the question, ``{response}`` the answer judged.
TEXT_TEMPLATE = (
    "You are shown a question and a response to it. Judge the response: is it correct, does it answer "
    "what was asked, is it clear? Explain briefly, then end your answer with one line of the form "
    "'Final Score: N', N a number from 1 (poor) to 5 (excellent).\nQuestion: {prompt}\nResponse: {response}"
)


@register_reward("llm_judge", modality="text")
class LLMJudge(Judge):
    """A language model behind an OpenAI-compatible endpoint scores each response to its prompt by a rubric, 1 to 5."""

    default_template = TEXT_TEMPLATE

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
        if "response" not in self.fields:
            raise RewardError(f"llm_judge: the template has no {{response}}, so the judge would never see the answer "
                              f"it scores; fields found: {sorted(self.fields) or 'none'}")

    def __call__(self, samples: Sequence[str], *, prompts: Sequence[str], **columns: Any) -> ScoresWithText:
        missing = self.fields - {"prompt", "response"} - set(columns)
        if missing:
            raise RewardError(f"llm_judge: the template reads {sorted(missing)}, which the dataset has no column for "
                              f"(columns: {sorted(columns) or 'none'})")
        conversations = [[{"role": "user", "content": self.template.format(
            prompt=prompt, response=response, **{k: columns[k][i] for k in self.fields if k in columns})}]
            for i, (response, prompt) in enumerate(zip(samples, prompts))]
        return self.judge(conversations, prompts)
