"""What ``serve-reward`` does with concurrent requests, without a server: ``score_requests`` joins them
into one call and gives each what scoring it alone gives (errors too), and ``BatchQueue`` cuts
batches by size and time, hands each item its own outcome and refuses items beyond ``max_queue``."""

from __future__ import annotations

import asyncio

import pytest

from unirl.rewards.batching import BatchQueue, QueueFull
from unirl.rewards.registry import RewardError
from unirl.rewards.scoring import score_batch, score_requests


def counting_reward():
    """A per-sample reward (length of the sample plus its answer) that records each call's batch size."""
    calls = []

    def reward(samples, *, prompts, answer, **kwargs):
        calls.append(len(samples))
        if "boom" in samples:
            raise ValueError("boom")
        return [len(s) + float(a) for s, a in zip(samples, answer)]

    return reward, calls


def request(samples, prompts, answers):
    return list(samples), {"prompts": list(prompts), "answer": list(answers)}


def test_joined_requests_get_their_own_scores_from_one_call():
    reward, calls = counting_reward()
    requests = [request(["a", "bb"], ["p0", "p1"], ["1", "2"]), request(["ccc"], ["p2"], ["0.5"]),
                request(["dddd", "", "e"], ["p3", "p4", "p5"], ["0", "0", "10"])]
    outcomes = score_requests(reward, requests, name="r")
    # By hand: len + answer.
    assert outcomes == [[2.0, 4.0], [3.5], [4.0, 0.0, 11.0]]
    assert calls == [6]  # one call over the 6 samples
    calls.clear()
    assert outcomes == [score_batch(reward, s, name="r", **c) for s, c in requests]
    assert calls == [2, 1, 3]


def test_a_failing_request_gets_the_message_it_gets_alone_and_the_others_their_scores():
    reward, calls = counting_reward()
    requests = [request(["a"], ["p0"], ["1"]), request(["ok", "boom"], ["fine", "bad prompt"], ["0", "0"]),
                request(["zz"], ["p3"], ["1"])]
    outcomes = score_requests(reward, requests, name="r")
    assert outcomes[0] == [2.0] and outcomes[2] == [3.0]
    assert isinstance(outcomes[1], RewardError)
    # Sample 1 of its own request, not sample 2 of the joined call.
    assert str(outcomes[1]) == ("reward 'r' raised ValueError: boom on sample 1 (prompt 'bad prompt') "
                                "(found by re-scoring the batch of 2 one sample at a time)")
    # The joined call (4 samples) raised; then each request alone: 1; 2 (raises), then 1, 1 to locate; 1.
    assert calls == [4, 1, 2, 1, 1, 1]
    with pytest.raises(RewardError) as alone:
        score_batch(reward, requests[1][0], name="r", **requests[1][1])
    assert str(alone.value) == str(outcomes[1])


def test_bad_scores_from_a_joined_call_are_reported_per_request():
    def nan_for_x(samples, **kwargs):
        return [float("nan") if s == "x" else 1.0 for s in samples]

    outcomes = score_requests(nan_for_x, [(["a"], {"prompts": ["p"]}), (["b", "x"], {"prompts": ["q", "r"]})], name="n")
    assert outcomes[0] == [1.0]
    assert str(outcomes[1]) == "reward 'n' returned nan for sample 1 (prompt 'r'); scores must be finite"


def test_requests_with_other_columns_or_ragged_ones_are_not_joined():
    reward, calls = counting_reward()
    requests = [request(["a"], ["p"], ["1"]), (["b"], {"answer": ["2"]}), request(["c"], ["p"], ["3"]),
                (["d", "e"], {"prompts": ["p", "q"], "answer": ["1"]})]  # a ragged column: scored alone, fails alone
    outcomes = score_requests(lambda s, **kw: reward(s, **{"prompts": None, **kw}), requests, name="r")
    assert outcomes[:3] == [[2.0], [3.0], [4.0]]
    assert str(outcomes[3]) == "reward 'r': column 'answer' has 1 values for 2 samples"
    assert calls == [2, 1]  # requests 0 and 2 joined; request 1 alone; request 3 never reached the reward


def run(coroutine):
    return asyncio.run(coroutine)


def test_batch_queue_cuts_batches_by_size_and_gives_each_item_its_outcome():
    calls = []

    def call(items):
        calls.append(list(items))
        return [ValueError(f"bad {x}") if x == "bad" else x.upper() for x in items]

    async def main():
        queue = BatchQueue(call, size=len, max_batch=4, max_wait=0.05, max_queue=10)
        queue.start()
        items = ["a", "bb", "c", "dd", "bad", "e"]
        outcomes = await asyncio.gather(*(queue.submit(x) for x in items), return_exceptions=True)
        stats = queue.stats()
        await queue.stop()
        return outcomes, stats

    outcomes, stats = run(main())
    assert outcomes[:4] == ["A", "BB", "C", "DD"] and outcomes[5] == "E"
    assert isinstance(outcomes[4], ValueError) and str(outcomes[4]) == "bad bad"
    # Sizes 1 2 1 | 2 (+3 would pass 4) | 3 1: the oldest items that fit, in arrival order.
    assert calls == [["a", "bb", "c"], ["dd"], ["bad", "e"]]
    assert stats == {"queued": 0, "scoring": 0, "batches": 3, "answered": 6}


def test_batch_queue_waits_max_wait_for_company_then_calls_anyway():
    calls = []

    async def main():
        queue = BatchQueue(lambda items: calls.append(len(items)) or list(items), max_batch=8, max_wait=0.2, max_queue=10)
        queue.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = asyncio.ensure_future(queue.submit(1))
        await asyncio.sleep(0.05)
        second = await queue.submit(2)  # joins the first's batch: it arrived within 0.2 s
        waited = loop.time() - t0
        await queue.stop()
        return await first, second, waited

    first, second, waited = run(main())
    assert (first, second) == (1, 2) and calls == [2]
    assert 0.19 <= waited < 1.0  # taken when the oldest had waited max_wait, not sooner


def test_batch_queue_refuses_beyond_max_queue():
    release = None

    def call(items):
        release.wait(10)
        return list(items)

    async def main():
        nonlocal release
        import threading

        release = threading.Event()
        queue = BatchQueue(call, max_batch=1, max_wait=0, max_queue=2)
        queue.start()
        held = asyncio.ensure_future(queue.submit("held"))  # taken by the worker, blocked in call
        while queue.stats()["scoring"] != 1:
            await asyncio.sleep(0.001)
        waiting = [asyncio.ensure_future(queue.submit(x)) for x in ("w1", "w2")]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match=r"2 request\(s\) waiting already \(max_queue=2\)"):
            await queue.submit("one too many")
        release.set()
        out = [await held] + [await w for w in waiting]
        await queue.stop()
        return out

    assert run(main()) == ["held", "w1", "w2"]


def test_batch_queue_settings_are_checked():
    with pytest.raises(ValueError, match="max_batch and max_queue must be >= 1"):
        BatchQueue(list, max_batch=0)
    with pytest.raises(ValueError, match="max_wait >= 0"):
        BatchQueue(list, max_wait=-1)
