"""``unirl serve-reward`` under load, as a real subprocess: 8 clients x 50 requests all answered with
exactly the local scores, concurrent requests joined into far fewer reward calls, and a full queue
answered 503 at once (then served once there is room). The load client is the one
benchmarks/reward_server_load.py times."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from unirl.rewards.registry import RewardError
from unirl.rewards.remote import RemoteReward

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reward_server_load", REPO / "benchmarks" / "reward_server_load.py")
load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load)


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return json.loads(response.read())


def test_eight_clients_fifty_requests_each_all_equal_to_local_scoring_in_fewer_calls(tmp_path):
    spec = load.write_reward(tmp_path)
    log = tmp_path / "calls.log"
    kwargs = {"call_ms": 1.0, "log": str(log)}
    expected = load.local_scores(spec, {"call_ms": 0.0}, clients=8, requests=50, samples=4)
    # A wait long enough that the 8 clients' requests meet, however busy this machine is.
    with load.serving(spec, json.dumps(kwargs), ["--max-wait-ms", "20"]) as url:
        result = load.run_load(url, clients=8, requests=50, samples=4)
        health = _health(url)

    assert result["errors"] == {}
    assert len(result["answers"]) == 8 * 50  # none lost
    unequal = [key for key, scores in expected.items() if result["answers"][key] != scores]
    assert unequal == [], f"{len(unequal)} answers differ from local scoring, e.g. {unequal[:3]}"
    # The reward's own record of its calls: every sample scored exactly once, in joined calls.
    sizes = [int(x) for x in log.read_text().split()]
    assert sum(sizes) == 8 * 50 * 4
    assert len(sizes) <= 200, f"{len(sizes)} reward calls for 400 requests: concurrent requests were not joined"
    assert max(sizes) > 4
    assert (health["answered"], health["batches"], health["queued"], health["scoring"]) == (400, len(sizes), 0, 0)
    summary = load.summary(result)
    assert summary["requests_per_s"] > 0 and summary["p50_ms"] <= summary["p99_ms"]


GATED = '''
import os, time

def gated(samples, *, gate, **kwargs):
    """Waits until the file ``gate`` exists (30 s at most), then scores each sample by its length."""
    end = time.monotonic() + 30
    while not os.path.exists(gate) and time.monotonic() < end:
        time.sleep(0.01)
    return [float(len(s)) for s in samples]
'''


def _wait_for(url: str, key: str, value: int) -> dict:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        health = _health(url)
        if health[key] == value:
            return health
        time.sleep(0.01)
    raise AssertionError(f"/health never showed {key}={value}: {health}")


def test_a_full_queue_is_answered_503_at_once_and_a_retrying_client_gets_through(tmp_path):
    (tmp_path / "gated.py").write_text(GATED)
    gate = tmp_path / "open"
    kwargs = json.dumps({"gate": str(gate)})
    args = ["--max-queue", "1", "--max-batch", "1", "--max-wait-ms", "0"]
    with load.serving(f"{tmp_path / 'gated.py'}:gated", kwargs, args) as url:
        answers = {}

        def send(key, samples, **client):
            answers[key] = RemoteReward(url, timeout=30, **client)(samples, prompts=["p"] * len(samples))

        first = threading.Thread(target=send, args=("first", ["a"]))
        first.start()
        _wait_for(url, "scoring", 1)  # the worker holds "first" (behind the gate)
        second = threading.Thread(target=send, args=("second", ["bb"]))
        second.start()
        _wait_for(url, "queued", 1)  # "second" waits: the queue is full

        # One more: 503 at once, with the reason, raw and through the client (which retries 503).
        request = urllib.request.Request(url + "/score", data=json.dumps({"samples": ["c"]}).encode(), method="POST")
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as raw:
            urllib.request.urlopen(request, timeout=10)
        assert raw.value.code == 503 and time.monotonic() - start < 5
        assert json.loads(raw.value.read())["error"] == (
            "reward server busy: 1 request(s) waiting already (max_queue=1); try again later "
            "(or serve with a larger --max-queue)")
        with pytest.raises(RewardError, match=r"did not score the batch in 1 attempt\(s\); the last was answered "
                                              r"HTTP 503: reward server busy"):
            RemoteReward(url, retries=0)(["c"], prompts=["p"])

        retrying = threading.Thread(target=send, args=("retrying", ["dddd"]), kwargs={"retries": 20, "backoff": 0.05})
        retrying.start()
        time.sleep(0.3)  # it is refused and backs off while the queue is full
        gate.touch()
        for thread in (first, second, retrying):
            thread.join(timeout=30)
        assert answers == {"first": [1.0], "second": [2.0], "retrying": [4.0]}
        health = _health(url)
        assert (health["queued"], health["scoring"], health["max_queue"], health["max_batch"]) == (0, 0, 1, 1)
