"""RewardSet: weighted combination, None handling, both aggregation orders, per-reward logging, and
scoring in a worker pool (and with an ``async`` reward) giving exactly the synchronous rewards."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from unirl.rewards.registry import RewardError
from unirl.config.schema import RewardConfig
from unirl.reward_set import RewardSet, concat_components

# Two rewards with known values over four samples in two groups (samples 0-1 answer prompt 0,
# samples 2-3 answer prompt 1). "b" does not apply to sample 0.
A = {"s0": 1.0, "s1": 0.0, "s2": 1.0, "s3": 1.0}
B = {"s0": None, "s1": 2.0, "s2": 4.0, "s3": 0.0}
SAMPLES = ["s0", "s1", "s2", "s3"]
PROMPTS = ["p0", "p0", "p1", "p1"]
GROUPS = torch.tensor([0, 0, 1, 1])

REWARD_FILE = f"""
import asyncio, threading
A = {A!r}
B = {B!r}
THREADS = []

def a(samples, **kwargs):
    return [A[s] for s in samples]

def b(samples, **kwargs):
    THREADS.append(threading.current_thread().name)
    return [B[s] for s in samples]

async def b_async(samples, *, delay=0.0, **kwargs):
    await asyncio.sleep(delay)
    return [B[s] for s in samples]

def echo_column(samples, *, level, prompts, **kwargs):
    return [float(x) for x in level]
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "two_rewards.py"
    path.write_text(REWARD_FILE)
    return path


def make(reward_file, names_weights, **kwargs) -> RewardSet:
    return RewardSet([RewardConfig(name=f"{reward_file}:{n}", weight=w) for n, w in names_weights], **kwargs)


def test_sum_then_normalize_weights_and_none(reward_file):
    rs = make(reward_file, [("a", 1.0), ("b", 0.5)])
    total, metrics = rs(SAMPLES, prompts=PROMPTS, columns={}, group_ids=GROUPS)
    # total = 1 * a + 0.5 * b, with b's None adding nothing: [1 + 0, 0 + 1, 1 + 2, 1 + 0]
    assert total.tolist() == [1.0, 1.0, 3.0, 1.0]
    # Means over the samples each reward applies to: a over 4, b over its 3 (2 + 4 + 0) / 3.
    assert metrics == {"reward/a": 0.75, "reward/b": 2.0}


def test_normalize_then_sum_by_hand(reward_file):
    rs = make(reward_file, [("a", 1.0), ("b", 0.5)], aggregation="normalize_then_sum")
    total, metrics = rs(SAMPLES, prompts=PROMPTS, columns={}, group_ids=GROUPS)
    # a, group 0: [1, 0], mean 0.5, unbiased std sqrt(0.25 + 0.25) = 1/sqrt(2) -> [+1/sqrt2, -1/sqrt2]
    #    group 1: [1, 1], std 0 -> [0, 0]
    # b, group 0: applies to sample 1 only, a group of one -> 0 (and sample 0 gets nothing)
    #    group 1: [4, 0], mean 2, std sqrt(4 + 4) = 2 sqrt2 -> [+1/sqrt2, -1/sqrt2]
    r = 1 / math.sqrt(2)
    expected = torch.tensor([r, -r, 0.5 * r, -0.5 * r])
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)
    assert metrics == {"reward/a": 0.75, "reward/b": 2.0}  # logged raw, whatever the aggregation


def test_components_mark_none_as_nan_and_pass_columns(reward_file):
    rs = make(reward_file, [("b", 1.0), ("echo_column", 1.0)])
    comp = rs.components(SAMPLES, prompts=PROMPTS, columns={"level": [3, 1, 4, 1]})
    assert math.isnan(comp["b"][0]) and comp["b"][1:].tolist() == [2.0, 4.0, 0.0]
    assert comp["echo_column"].tolist() == [3.0, 1.0, 4.0, 1.0]


def test_reward_that_never_applies_logs_nan_and_adds_nothing(tmp_path):
    path = tmp_path / "never.py"
    path.write_text("def never(samples, **kw):\n    return [None] * len(samples)\n"
                    "def one(samples, **kw):\n    return [1.0] * len(samples)\n")
    rs = RewardSet([RewardConfig(f"{path}:never", 3.0), RewardConfig(f"{path}:one", 2.0)], aggregation="normalize_then_sum")
    total, metrics = rs(SAMPLES, prompts=PROMPTS, columns={}, group_ids=GROUPS)
    assert total.tolist() == [0.0] * 4  # "one" is constant in each group -> 0 after normalising
    assert math.isnan(metrics["reward/never"]) and metrics["reward/one"] == 1.0


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_worker_pool_and_async_give_the_synchronous_rewards(reward_file, aggregation):
    sync = make(reward_file, [("a", 1.0), ("b", 0.5)], aggregation=aggregation)
    expected_total, expected_metrics = sync(SAMPLES, prompts=PROMPTS, columns={}, group_ids=GROUPS)

    with make(reward_file, [("a", 1.0), ("b_async", 0.5)], aggregation=aggregation, workers=2) as pooled:
        # Two chunks in flight at once, as an environment does while it samples the next chunk.
        futures = [pooled.submit(SAMPLES[i:i + 2], prompts=PROMPTS[i:i + 2], columns={}) for i in (0, 2)]
        comp = concat_components([f.result(timeout=30) for f in futures])
    total, metrics = pooled.combine(comp, GROUPS)
    assert torch.equal(total, expected_total)
    assert metrics == {"reward/a": expected_metrics["reward/a"], "reward/b_async": expected_metrics["reward/b"]}


def test_submit_runs_in_worker_threads(reward_file):
    import sys

    rs = make(reward_file, [("b", 1.0)], workers=2)
    rs.submit(SAMPLES, prompts=PROMPTS, columns={}).result(timeout=30)
    rs.close()
    module = sys.modules[rs.fns[0].__module__]  # this test's own copy of the file
    assert module.THREADS and all(t.startswith("unirl-reward") for t in module.THREADS)
    assert threading.current_thread().name not in module.THREADS


def test_async_reward_inside_a_running_event_loop(reward_file):
    import asyncio

    rs = make(reward_file, [("b_async", 1.0)])

    async def main():  # a notebook-like caller that already runs a loop
        return rs.components(SAMPLES, prompts=PROMPTS, columns={})

    comp = asyncio.run(main())
    assert comp["b_async"][1:].tolist() == [2.0, 4.0, 0.0]


def test_reward_error_surfaces_through_the_future(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("def boom(samples, **kw):\n    return [1.0 / (s != 's2') for s in samples]\n")
    with RewardSet([RewardConfig(f"{path}:boom")], workers=1) as rs:
        future = rs.submit(SAMPLES, prompts=PROMPTS, columns={})
        with pytest.raises(RewardError, match=r"reward '.*boom.py:boom' raised ZeroDivisionError: .* on sample 2 \(prompt 'p1'\)"):
            future.result(timeout=30)
    inline = RewardSet([RewardConfig(f"{path}:boom")]).submit(SAMPLES, prompts=PROMPTS, columns={})
    with pytest.raises(RewardError, match="on sample 2"):
        inline.result()


def test_validation(reward_file):
    with pytest.raises(ValueError, match="the list is empty"):
        RewardSet([])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        make(reward_file, [("a", 1.0)], aggregation="mean")
    with pytest.raises(ValueError, match="weight must be a finite number, got nan"):
        make(reward_file, [("a", math.nan)])
    with pytest.raises(ValueError, match="listed twice"):
        make(reward_file, [("a", 1.0), ("a", 2.0)])
    with pytest.raises(ValueError, match="workers must be >= 0"):
        make(reward_file, [("a", 1.0)], workers=-1)
    rs = make(reward_file, [("a", 1.0)])
    with pytest.raises(ValueError, match="4 samples but 3 prompts"):
        rs.components(SAMPLES, prompts=PROMPTS[:3], columns={})
    with pytest.raises(ValueError, match="expected 3 scores, got shape"):
        rs.combine({"a": torch.zeros(4)}, torch.tensor([0, 0, 1]))
