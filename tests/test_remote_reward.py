"""Remote rewards end to end on 127.0.0.1: ``serve-reward`` in a subprocess (the real command) and in
a thread, scores equal to local scoring for a text and an image reward, the health endpoint, and
the clear errors for a stopped server, a server that never answers, and one that answers garbage.
(Load, batching and the full queue: test_reward_server_load.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from unirl.rewards.loading import load_reward
from unirl.rewards.registry import RewardError
from unirl.rewards.scoring import score_batch
from unirl.rewards.remote import RemoteReward, make_server
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet

from machine import repo_env

REPO = Path(__file__).resolve().parents[1]

IMAGE_REWARD = '''
def redness(samples, *, prompts, weight=1.0, **kwargs):
    """Mean red minus mean green, in [-1, 1], times weight."""
    import numpy as np

    out = []
    for img in samples:
        px = np.asarray(img.convert("RGB"), dtype=np.float64)  # [H, W, 3]
        out.append(weight * float((px[..., 0] - px[..., 1]).mean()) / 255.0)
    return out

def picky(samples, *, prompts, **kwargs):
    return [1.0 / (p != "bad prompt") for p in prompts]
'''


@pytest.fixture
def served():
    """Start ``make_server`` in a thread; yield a function (spec, kwargs) -> url; stop them all."""
    servers = []

    def start(spec, kwargs=None):
        server = make_server(spec, "127.0.0.1", 0, kwargs)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_serve_reward_command_end_to_end_text():
    """The real command in a subprocess, on a free port, used through a RewardSet like a run does."""
    env = repo_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "serve-reward", "gsm8k", "--port", "0",
         "--kwargs", '{"method": "flexible"}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
    )
    try:
        line = proc.stdout.readline()  # "serving reward 'gsm8k' at http://127.0.0.1:PORT"
        assert line.startswith("serving reward 'gsm8k' at http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].strip()
        samples = ["#### 12", "so 12", "it is 13", "nothing"]
        columns = {"answer": ["12", "12", "12", "12"]}
        prompts = ["q0", "q0", "q1", "q1"]
        local = score_batch(load_reward("gsm8k", method="flexible"), samples, name="gsm8k", prompts=prompts, **columns)
        assert local == [1.0, 1.0, 0.0, 0.0]
        rs = RewardSet([RewardConfig(url, kwargs={"timeout": 10})])
        comp = rs.components(samples, prompts=prompts, columns=columns)
        assert comp[rs.names[0]].tolist() == local
        assert RemoteReward(url).info() == {
            "name": "gsm8k", "modality": "text",
            "description": "GSM8K exact match: correct_score if right, format_score if an answer was found but wrong, else 0."}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_image_reward_over_http_equals_local(served, tmp_path):
    from PIL import Image

    path = tmp_path / "image_reward.py"
    path.write_text(IMAGE_REWARD)
    url, _ = served(f"{path}:redness", {"weight": 2.0})
    images = [Image.new("RGB", (4, 3), (255, 0, 0)), Image.new("RGB", (5, 5), (10, 200, 7)),
              Image.linear_gradient("L").convert("RGB").resize((8, 8))]
    prompts = ["red", "green", "gray"]
    local = score_batch(load_reward(f"{path}:redness", weight=2.0), images, name="local", prompts=prompts)
    # By hand: pure red -> 2 * 255/255 = 2; (10 - 200)/255 * 2; gray has r == g -> 0.
    assert local == pytest.approx([2.0, 2 * -190 / 255, 0.0], abs=1e-12)
    remote = score_batch(load_reward(url), images, name=url, prompts=prompts)
    assert remote == local  # PNG is lossless: the very same pixels are scored


def test_reward_error_on_the_server_reaches_the_run(served, tmp_path):
    path = tmp_path / "image_reward.py"
    path.write_text(IMAGE_REWARD)
    url, _ = served(f"{path}:picky")
    with pytest.raises(RewardError, match=r"answered HTTP 500: reward .*picky' raised ZeroDivisionError.* on sample 1 "
                                          r"\(prompt 'bad prompt'\)"):
        score_batch(load_reward(url), ["a", "b"], name=url, prompts=["fine", "bad prompt"])


def test_stopped_server_gives_a_clear_error_within_the_timeout(served):
    url, server = served("gsm8k")
    server.shutdown()
    server.server_close()
    fn = load_reward(url, timeout=1.0, retries=2, backoff=0.05)
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"reward server {url} is unreachable: 3 attempt\(s\) with a 1s timeout failed.*"
                                          r"Is `unirl serve-reward` running there\?"):
        score_batch(fn, ["#### 1"], name=url, prompts=["q"], answer=["1"])
    assert time.monotonic() - start < 3 * 1.0 + 0.05 + 0.1 + 1.0


def test_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections into the backlog, never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        fn = load_reward(url, timeout=0.3, retries=1, backoff=0.0)
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"unreachable: 2 attempt\(s\) with a 0.3s timeout failed, the last with .*timed out"):
            fn(["x"], prompts=["q"])
        assert time.monotonic() - start < 2 * 0.3 + 1.0
    finally:
        listener.close()


class _Garbage(BaseHTTPRequestHandler):
    body = b""  # set per test

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = type(self).body
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>I am not a reward server</html>", r"answered garbage \(not JSON\): b'<html>I am not"),
        (b'{"result": [1.0]}', r'answered garbage: expected \{"scores": \[...\]\}, got \{"result": \[1.0\]\}'),
        (b"[1.0, 2.0]", r"answered garbage: expected a JSON object"),
        (b'{"scores": [1.0, 2.0, 3.0]}', r"answered 3 scores for 2 samples"),
        (b'{"scores": [1.0, "high"]}', r"returned 'high' for sample 1 \(prompt 'q1'\)"),
    ],
)
def test_garbage_answer_is_a_clear_error(body, message):
    handler = type("Handler", (_Garbage,), {"body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RewardError, match=message):
            score_batch(load_reward(url, retries=0), ["a", "b"], name=url, prompts=["q0", "q1"])
    finally:
        server.shutdown()
        server.server_close()


def test_bad_requests_and_settings(served):
    url, _ = served("gsm8k")
    with pytest.raises(RewardError, match="answered HTTP 400: malformed request: KeyError: 'samples'"):
        RemoteReward(url)._request("POST", "/score", json.dumps({"prompts": []}).encode())
    with pytest.raises(RewardError, match="column 'answer' cannot be sent as JSON"):
        RemoteReward(url)(["a"], prompts=["q"], answer=[object()])
    with pytest.raises(RewardError, match="has no parameter 'timout'. Did you mean 'timeout'"):
        load_reward(url, timout=3)
    with pytest.raises(RewardError, match="timeout must be > 0"):
        load_reward(url, timeout=0)


def test_health_and_unknown_paths(served):
    url, _ = served("gsm8k")
    client = RemoteReward(url)
    assert client._request("GET", "/health", None) == {
        "status": "ok", "queued": 0, "scoring": 0, "batches": 0, "answered": 0,
        "max_batch": 256, "max_wait_ms": 2.0, "max_queue": 1024}
    assert client(["#### 3", "#### 4"], prompts=["q", "q"], answer=["3", "3"]) == [1.0, 0.0]
    health = client._request("GET", "/health/", None)
    assert (health["batches"], health["answered"]) == (1, 1)
    assert client._request("GET", "/info/", None)["name"] == "gsm8k"
    with pytest.raises(RewardError, match=r"answered HTTP 404: no such path '/nope'; use GET /info, GET /health or POST /score"):
        client._request("GET", "/nope", None)
    with pytest.raises(RewardError, match=r"answered HTTP 404: no such path '/info'; use POST /score"):
        client._request("POST", "/info", b"{}")
    with pytest.raises(RewardError, match=r"answered HTTP 400: malformed request: JSONDecodeError"):
        client._request("POST", "/score", b"{not json")


def test_serve_command_reports_bad_names(capsys):
    from unirl.cli import main

    assert main(["serve-reward", "gsm9k", "--port", "0"]) == 1
    assert "unknown reward 'gsm9k'. Did you mean 'gsm8k'?" in capsys.readouterr().err
    assert main(["serve-reward", "gsm8k", "--kwargs", "[1]"]) == 2
    assert main(["serve-reward", "gsm8k", "--port", "0", "--max-batch", "0"]) == 1
    assert "max_batch and max_queue must be >= 1" in capsys.readouterr().err
