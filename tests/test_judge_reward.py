"""The judge rewards against a stub OpenAI-compatible server on 127.0.0.1.

The stub answers each chat completion by a marker in the prompt: ``[score=N]`` a reasoned answer
ending in ``Final Score: N``, ``[malformed]`` an answer without a score, ``[slow]`` after longer than
the client's timeout, ``[slow-once]`` / ``[busy-once]`` slowly / with a 503 on the first attempt
only, ``[broken]`` a 500 every time, ``[refused]`` a 400. It records every request, so the tests
check what was sent (the image as a PNG data URL with the run's pixels) and how often.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from unirl.rewards.judge import VLMJudge, parse_score
from unirl.rewards.llm_judge import LLMJudge
from unirl.rewards.loading import load_reward
from unirl.rewards.registry import RewardError
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet


class _Stub:
    def __init__(self):
        self.requests: list[dict] = []
        self.seen: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()


def _text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else next(p["text"] for p in content if p["type"] == "text")


@pytest.fixture
def stub():
    state = _Stub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = _text_of(body["messages"][-1])
            marker = re.search(r"\[([a-z-]+(?:=\S+?)?)\]", text).group(1)
            with state.lock:
                state.requests.append(body)
                state.seen[marker] = state.seen.get(marker, 0) + 1
                first = state.seen[marker] == 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            self.counted = True
            try:
                self._answer(marker, first)
            finally:
                self._done()

        def _done(self):
            """A request leaves the in-flight count before its answer is written: once the client has read
            the answer it may send its next request before this thread would get to a later decrement, and
            the stub would count a third request in flight under a limit of two."""
            if self.counted:
                self.counted = False
                with state.lock:
                    state.in_flight -= 1

        def _answer(self, marker: str, first: bool):
            if marker == "broken" or (marker == "busy-once" and first):
                return self._send(500 if marker == "broken" else 503, {"error": "not now"})
            if marker == "refused":
                return self._send(400, {"error": "bad request"})
            if marker == "slow" or (marker == "slow-once" and first):
                time.sleep(1.0)
            if marker.startswith("score="):
                content = f"The caption's objects are there. **Final Score:** {marker[6:]}"
            elif marker == "malformed":
                content = "It looks rather nice to me."
            else:
                content = "Fine. Final Score: 3"
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})

        def _send(self, code: int, payload: dict):
            raw = json.dumps(payload).encode()
            self._done()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def _images(n: int):
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(n)]


def test_scores_are_parsed_from_the_last_final_score():
    assert parse_score("Final Score: 2 ... on reflection, Final Score: 4.5") == 4.5
    assert parse_score("final score = 3") == 3.0 and parse_score("Score: 3") is None


def test_vlm_judge_sends_each_image_as_a_png_data_url_and_keeps_the_texts(stub):
    from PIL import Image

    images = _images(5)
    prompts = [f"a red cat [score={s}]" for s in (1, 2, 3, 4, 5)]
    judge = VLMJudge(url=stub.url, model="judge", concurrency=2, backoff=0)
    scores = judge(images, prompts=prompts)
    assert list(scores) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(t.endswith(f"**Final Score:** {s}") for t, s in zip(scores.texts, range(1, 6)))
    assert len(stub.requests) == 5 and stub.max_in_flight <= 2
    sent = {}
    for body in stub.requests:
        assert body["model"] == "judge" and body["temperature"] == 0.0
        parts = body["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        assert url.startswith("data:image/png;base64,")
        sent[_text_of(body["messages"][0])] = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    for image, prompt in zip(images, prompts):  # the very pixels, whatever order the requests came in
        text = next(t for t in sent if prompt in t)
        assert np.array_equal(sent[text], np.asarray(image))


def test_an_unparsable_answer_is_named_or_left_out(stub):
    prompts = ["a dog [score=4]", "a cat [malformed]"]
    with pytest.raises(RewardError, match=r"sample 1 \(prompt 'a cat \[malformed\]'\) has no 'Final Score: N'; "
                                          r"it answered 'It looks rather nice to me.'"):
        VLMJudge(url=stub.url, model="judge", backoff=0)(_images(2), prompts=prompts)
    scores = VLMJudge(url=stub.url, model="judge", on_unparsable="none", backoff=0)(_images(2), prompts=prompts)
    assert list(scores) == [4.0, None] and scores.texts[1] == "It looks rather nice to me."
    with pytest.raises(RewardError, match=r"a score 7 outside \[1, 5\]"):
        VLMJudge(url=stub.url, model="judge", backoff=0)(_images(1), prompts=["[score=7]"])


def test_slow_answers_time_out_and_are_retried(stub):
    judge = VLMJudge(url=stub.url, model="judge", timeout=0.3, retries=1, backoff=0)
    assert list(judge(_images(1), prompts=["a [slow-once]"])) == [3.0]  # the retry is answered in time
    assert stub.seen["slow-once"] == 2
    with pytest.raises(RewardError, match=r"failed 2 attempt\(s\) with a 0.3s timeout"):
        judge(_images(1), prompts=["a [slow]"])
    assert stub.seen["slow"] == 2


def test_server_errors_are_retried_and_client_errors_are_not(stub):
    judge = LLMJudge(url=stub.url + "/v1", model="judge", retries=2, backoff=0)
    assert list(judge(["4"], prompts=["2 + 2? [busy-once]"])) == [3.0] and stub.seen["busy-once"] == 2
    with pytest.raises(RewardError, match=r"failed 3 attempt\(s\).*HTTP 500"):
        judge(["4"], prompts=["2 + 2? [broken]"])
    assert stub.seen["broken"] == 3
    with pytest.raises(RewardError, match="answered HTTP 400"):
        judge(["4"], prompts=["2 + 2? [refused]"])
    assert stub.seen["refused"] == 1


def test_an_unreachable_judge_is_named():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = LLMJudge(url=f"http://127.0.0.1:{port}", model="judge", retries=1, backoff=0, timeout=2)
    with pytest.raises(RewardError, match=rf"judge http://127.0.0.1:{port}/v1/chat/completions failed 2 attempt"):
        judge(["4"], prompts=["2 + 2?"])


def test_llm_judge_through_a_runs_reward_set_keeps_the_judges_texts(stub):
    """A text run names it like any reward; its texts reach an evaluation that asks for them."""
    rewards = RewardSet([RewardConfig(name="llm_judge", kwargs={"url": stub.url, "model": "judge", "backoff": 0})])
    texts: dict[str, list[str]] = {}
    comps = rewards.components(["4", "5"], prompts=["2 + 2? [score=5]", "2 + 2? [score=1]"], columns={}, texts=texts)
    assert comps["llm_judge"].tolist() == [5.0, 1.0]
    assert texts["llm_judge"] == ["The caption's objects are there. **Final Score:** 5",
                                  "The caption's objects are there. **Final Score:** 1"]
    body = stub.requests[0]["messages"][0]["content"]
    assert "Question: 2 + 2? [score=" in body and "Response: " in body
    with pytest.raises(RewardError, match="model"):  # a required setting missing: named at load
        load_reward("llm_judge", url=stub.url)
