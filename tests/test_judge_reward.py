"""The judge rewards against a stub OpenAI-compatible server on 127.0.0.1.

The stub answers each chat completion by a marker in the prompt: ``[score=N]`` a reasoned answer
ending in ``Final Score: N``, ``[malformed]`` an answer without a score, ``[slow]`` after longer than
the client's timeout, ``[slow-once]`` / ``[busy-once]`` slowly / with a 503 on the first attempt
only, ``[broken]`` a 500 every time, ``[refused]`` a 400, ``[dribble]`` a chat completion one byte
every 0.1 s (a read never waits long, the answer never ends), ``[huge]`` a 64 MiB answer, ``[answer=X]``
the text X (URL-quoted). It records every request, so the tests check what was sent (the image as a PNG
data URL with the run's pixels) and how often.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import urllib.parse
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
            if marker in ("dribble", "huge"):
                return self._stream(marker)
            if marker == "slow" or (marker == "slow-once" and first):
                time.sleep(1.0)
            if marker.startswith("score="):
                content = f"The caption's objects are there. **Final Score:** {marker[6:]}"
            elif marker == "malformed":
                content = "It looks rather nice to me."
            elif marker.startswith("answer="):
                content = urllib.parse.unquote(marker[7:])
            else:
                content = "Fine. Final Score: 3"
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": content}}]})

        def _stream(self, marker: str):
            """An answer with no length, written until the client hangs up (or 64 MiB for ``huge``)."""
            self._done()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            chunk, sent = (b" ", 0) if marker == "dribble" else (b" " * 2**20, 0)
            try:
                self.wfile.write(b'{"choices": [{"message": {"role": "assistant", "content": "Final Score: 3"}}]')
                while marker == "dribble" or sent < 64 * 2**20:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    sent += len(chunk)
                    if marker == "dribble":
                        time.sleep(0.1)
                self.wfile.write(b"}")
            except (BrokenPipeError, ConnectionResetError):
                pass

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


def test_the_timeout_bounds_a_whole_dribbling_answer_not_each_read(stub):
    """Each read gets a byte within 0.1 s, so a per-read timeout never fires: the attempt must end at 0.5 s."""
    judge = LLMJudge(url=stub.url, model="judge", timeout=0.5, retries=1, backoff=0)
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(error=_raised(lambda: judge(["4"], prompts=["[dribble]"]))),
                              daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the judge was still reading a dribbling answer after 20 s"
    assert time.monotonic() - start < 5
    assert isinstance(outcome["error"], RewardError)
    assert re.search(r"failed 2 attempt\(s\).*no whole answer within the 0.5s timeout", str(outcome["error"]))
    assert stub.seen["dribble"] == 2


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return err
    return None


def test_an_answer_is_read_up_to_a_cap_not_whole(stub):
    import tracemalloc

    judge = LLMJudge(url=stub.url, model="judge", retries=0, max_tokens=512)
    tracemalloc.start()
    with pytest.raises(RewardError, match=r"answered more than 1081344 bytes \(1 MiB plus 64 per max_tokens\)"):
        judge(["4"], prompts=["[huge]"])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB held reading a 64 MiB answer"


@pytest.mark.parametrize("answer, fmt, expected", [
    ("Final Score: 1e308", "final_score", "a score 1e+308 outside"),  # read whole, not as 1
    ("Final Score: 1e999", "final_score", "a score inf outside"),
    ("1e1", "number", "a score 10 outside"),  # not 1
    ("On a scale of 1 to 5: 7", "number", "a score 7 outside"),  # the quoted scale is not the score
])
def test_numbers_are_read_whole_and_out_of_scale_ones_refused(stub, answer, fmt, expected):
    judge = LLMJudge(url=stub.url, model="judge", score_format=fmt, backoff=0)
    with pytest.raises(RewardError, match=re.escape(expected)):
        judge(["r"], prompts=[f"[answer={urllib.parse.quote(answer)}]"])
    floor = LLMJudge(url=stub.url, model="judge", score_format=fmt, backoff=0, on_unparsable="min", min_score=1)
    scores = floor(["r"], prompts=[f"[answer={urllib.parse.quote(answer)}]"])
    assert list(scores) == [1.0] and scores.failed == [True]


def test_a_quoted_scale_is_not_the_score():
    assert parse_score("On a scale of 1 to 5, I give it a 4.", "number") == 4.0
    assert parse_score("Scale 1-5. Score: 2", "number") == 2.0
    assert parse_score("from 1 to 10: 8/10", "number") == 8.0
    assert parse_score("I'd say 3 out of 5", "number") == 3.0
    assert parse_score("-2", "number") == -2.0 and parse_score("0.5", "number") == 0.5


def test_a_deeply_nested_json_answer_is_unparsable_not_a_crash(stub):
    deep = '{"score": ' * 100_000 + "5" + "}" * 100_000
    assert parse_score(deep, "json") is None
    judge = LLMJudge(url=stub.url, model="judge", score_format="json", on_unparsable="min", backoff=0)
    nested = urllib.parse.quote('{"a": ' * 5000 + "1" + "}" * 5000)
    scores = judge(["r"], prompts=[f"[answer={nested}]"])
    assert list(scores) == [1.0] and scores.failed == [True]


def test_a_rubric_with_json_braces_is_sent_as_written(stub):
    rubric = 'Grade {response} for {prompt}. Reply with JSON like {"score": N, "why": "..."}; {{literal}}'
    judge = LLMJudge(url=stub.url, model="judge", template=rubric, backoff=0)
    assert list(judge(["4"], prompts=["2 + 2? [score=5]"])) == [5.0]
    sent = stub.requests[-1]["messages"][0]["content"]
    assert sent == 'Grade 4 for 2 + 2? [score=5]. Reply with JSON like {"score": N, "why": "..."}; {literal}'
    with pytest.raises(RewardError, match=r"only \{prompt\} is filled in.*write \{\{ and \}\} for a literal brace"):
        VLMJudge(url=stub.url, model="judge", template="{prompt} {respose}")


def test_a_judge_stuck_past_the_rewards_timeout_leaves_the_process_free_to_exit(stub, tmp_path):
    """``rewards[0].timeout_s`` ends the call at 1 s; the judge's own timeout (60 s, 3 retries) is far off, and
    the requests still in flight must not hold the process's exit (a pool's threads are joined at exit)."""
    script = tmp_path / "stuck_judge.py"
    script.write_text(f"""
import time
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet

rewards = RewardSet([RewardConfig(name="llm_judge", timeout_s=1, kwargs=dict(
    url={stub.url!r}, model="judge", timeout=60, retries=3, concurrency=4))])
start = time.monotonic()
try:
    rewards.components(["a", "b", "c"], prompts=["[dribble]"] * 3, columns={{}})
except Exception as err:
    print(f"after {{time.monotonic() - start:.1f}} s: {{err}}", flush=True)
""")
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the process was still alive 30 s after its reward timed out at 1 s: {out[-2000:]}")
    assert proc.returncode == 0, out[-2000:]
    assert re.search(r"after 1\.\d s: reward 'llm_judge': no answer after 1 s \(its timeout_s\)", out), out[-2000:]
    assert stub.seen["dribble"] == 3
