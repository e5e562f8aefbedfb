"""``llm_judge`` against a real model behind a real HTTP server on loopback, not a stub.

The server (``tests/chat_server.py``: FastAPI + uvicorn + transformers, one module-scoped process) serves
the tiny model trained on the addition table (``test_distill.sft_teacher``) at ``/v1/chat/completions``.
The rubric is the question itself (``{response}`` holds "3+4=?"), so the judge's answer is the model's
sum ("#### 7") and its score, by ``score_format: number``, the sum it computed: what the same model
answers greedily in this process. The model never writes JSON, which makes ``score_format: json`` a
judge answering nonsense. (The stub in ``test_judge_reward.py`` covers the HTTP failures: 5xx,
timeouts, refused connections.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet
from unirl.rewards.judge import parse_score
from unirl.rewards.llm_judge import LLMJudge
from unirl.rewards.registry import RewardError

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["3+4=?", "1+1=?", "2+2=?", "0+3=?", "4+4=?", "2+1=?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tests.test_distill import sft_teacher

    return sft_teacher()


@pytest.fixture(scope="module")
def server(model_dir):
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(REPO / "tests" / "chat_server.py"), str(model_dir), str(port)],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if process.poll() is not None:
                pytest.fail(f"the chat server exited: {process.stdout.read()[-2000:]}")
            try:
                _get(url + "/health")
                break
            except OSError:
                time.sleep(0.25)
        else:
            pytest.fail("the chat server did not answer /health within 60 s")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _greedy_answers(model_dir: Path, questions: list[str], max_tokens: int) -> list[str]:
    """What the served model answers, computed in this process without HTTP."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    answers = []
    for q in questions:
        ids = torch.tensor([tokenizer(q).input_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return answers


def test_scores_are_the_served_models_answers_and_repeats_come_from_the_cache(server, model_dir):
    judge = LLMJudge(url=server, model="tiny", template="{response}", score_format="number", min_score=0,
                     max_score=8, max_tokens=8, concurrency=3, on_unparsable="error")
    before = _get(server + "/stats")["completions"]
    scores = judge(QUESTIONS, prompts=["(unused)"] * len(QUESTIONS))
    expected = [parse_score(a, "number") for a in _greedy_answers(model_dir, QUESTIONS, 8)]
    assert list(scores) == expected and all(s is not None for s in expected)
    assert scores.failed == [False] * len(QUESTIONS) and all(t.startswith("####") for t in scores.texts)
    # the teacher knows the table: most scores are the true sums (a real model answered, not a canned reply)
    assert sum(s == eval(q[:-2]) for s, q in zip(scores, QUESTIONS)) >= 4  # noqa: S307 (our own "a+b")
    assert _get(server + "/stats")["completions"] - before == len(QUESTIONS)
    again = judge(list(reversed(QUESTIONS)), prompts=["(unused)"] * len(QUESTIONS))
    assert list(again) == list(reversed(expected))
    assert _get(server + "/stats")["completions"] - before == len(QUESTIONS)  # the server was not asked again
    assert judge.client.cache_hits == len(QUESTIONS) and judge.client.requests == len(QUESTIONS)


def test_a_judge_answering_nonsense_is_counted_never_a_silent_zero(server):
    rewards = RewardSet([RewardConfig(name="llm_judge", kwargs=dict(
        url=server, model="tiny", template="{response}", score_format="json", on_unparsable="min", min_score=1,
        max_score=5, max_tokens=6))])
    ids = torch.tensor([0, 0, 1])
    components = rewards.components(QUESTIONS[:3], prompts=["p"] * 3, columns={})
    total, metrics = rewards.combine(components, ids)
    # no JSON in "#### 7": each sample gets min_score, the rubric's lowest, and the step logs that it happened
    assert total.tolist() == [1.0, 1.0, 1.0]
    assert metrics["reward/llm_judge"] == 1.0 and metrics["reward/llm_judge/parse_failed"] == 1.0
    strict = LLMJudge(url=server, model="tiny", template="{response}", score_format="json", max_tokens=6)
    with pytest.raises(RewardError, match=r"sample 0 \(prompt 'p'\) has no JSON object with a number in 'score'; "
                                          r"it answered '####"):
        strict(QUESTIONS[:1], prompts=["p"])
    left_out = LLMJudge(url=server, model="tiny", template="{response}", score_format="json", max_tokens=6,
                        on_unparsable="none")
    assert list(left_out(QUESTIONS[:2], prompts=["p", "p"])) == [None, None]


def test_a_template_reads_dataset_columns_and_must_show_the_response():
    with pytest.raises(RewardError, match=r"no \{response\}"):
        LLMJudge(url="http://127.0.0.1:9", model="m", template="Rate {prompt}")
    judge = LLMJudge(url="http://127.0.0.1:9", model="m", template="{prompt} {response} gold: {answer}", retries=0)
    with pytest.raises(RewardError, match=r"reads \['answer'\], which the dataset has no column for"):
        judge(["x"], prompts=["q"])
