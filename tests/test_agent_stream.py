"""Rollouts that never wait on I/O and sessions recorded token for token, without a model: the turn batcher's
two modes (lock-step waits for every episode; eager sends what is ready, the engine in a thread, so a fast
environment's episode finishes while a slow one still waits), weight versions stamped per token and
spanning an update, the staleness bound per token (hand-checked), a streamed source's batch, and a
session's calls chained into one masked trajectory or cut where the tokens do not chain."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from test_agents_runner import EOS, CharTokenizer, ScriptedEngine

from unirl.agents import Episode, Step
from unirl.agents.runner import players
from unirl.core import token_staleness_metrics, within_staleness
from unirl.rollout.batcher import TurnBatcher
from unirl.rollout.sessions import Call, chain
from unirl.rollout.stream import FinishedGroups, StreamSource, VersionedEngine


class Slow(Episode):
    """Three turns; each step awaits the row's latency (an environment's I/O)."""

    finished: list = []

    def __init__(self, row):
        self.name, self.latency, self.turns = row["name"], row["latency"], 0

    def reset(self):
        return f"{self.name}:"

    async def step(self, action):
        await asyncio.sleep(self.latency)
        self.turns += 1
        if self.turns == 3:
            Slow.finished.append(self.name)
            return Step(reward=1.0, done=True)
        return Step(observation=";")


def _play(engine, rows, *, eager):
    play = players(engine, CharTokenizer(), Slow, encode=lambda text: [ord(c) for c in text], max_turns=4,
                   max_new_tokens=4, max_total_tokens=None, temperature=1.0, step_timeout_s=5.0)

    async def main():
        batcher = TurnBatcher(engine, play.sampling, live=len(rows), eager=eager)
        play.start(batcher)
        return await asyncio.gather(*[play.play(i, row) for i, row in enumerate(rows)]), batcher

    return asyncio.run(main())


@pytest.mark.parametrize("eager", [False, True])
def test_eager_batches_send_what_is_ready_and_lock_step_waits_for_everyone(eager):
    Slow.finished = []
    engine = ScriptedEngine(lambda context: "x$")
    rows = [{"prompt": "p", "name": "fast", "latency": 0.0}, {"prompt": "p", "name": "slow", "latency": 0.4}]
    traces, batcher = _play(engine, rows, eager=eager)
    assert all(t.turns == 3 and t.done for t in traces)
    if eager:  # the fast episode plays its three turns while the slow one waits on its first step
        assert Slow.finished == ["fast", "slow"]
        assert [rows for rows, _ in engine.calls].count(1) >= 3, engine.calls
    else:  # every turn waits for both episodes: three calls of both requests
        assert engine.calls == [(2, 1)] * 3
    assert batcher.requests == 6


class Counting(ScriptedEngine):
    """A scripted engine that publishes a new weight version (through the versioned engine wrapping it)
    after its second call, as a trainer does between two generations."""

    def __init__(self):
        super().__init__(lambda context: "x$")
        self.tokenizer = CharTokenizer()
        self.versioned = None

    def generate(self, prompt_ids, **kw):
        out = super().generate(prompt_ids, **kw)
        if len(self.calls) == 2:
            self.versioned.publish(None, 7)  # the engine already holds them (a shared policy)
        return out


def test_tokens_keep_the_version_that_sampled_them_across_an_update():
    Slow.finished = []
    engine = Counting()
    versioned = engine.versioned = VersionedEngine(engine, 5)
    traces, _ = _play(versioned, [{"prompt": "p", "name": "a", "latency": 0.0}], eager=True)
    trace = traces[0]
    x = [ord("x"), EOS]
    assert trace.ids == x + [ord(";")] + x + [ord(";")] + x
    # turns 1 and 2 sampled by version 5, the third after the update by 7; observations -1
    assert trace.versions == [5, 5, -1, 5, 5, -1, 7, 7]


def test_the_staleness_bound_per_token_by_hand():
    versions = torch.tensor([[3, 3, -1, 4, 4], [5, 5, 5, -1, -1]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]])
    kept = within_staleness(versions, mask, oldest=4)
    assert kept.tolist() == [[False, False, False, True, True], [True, True, True, False, False]]
    figures = token_staleness_metrics(versions, mask, current=5, kept=kept)
    # behind: 2, 2, 1, 1 | 0, 0, 0 over 7 trained tokens
    assert figures["staleness_token_mean"].item() == pytest.approx(6 / 7)
    assert figures["staleness_token_max"].item() == 2
    assert figures["stale_token_frac"].item() == pytest.approx(2 / 7)


class ListFeed:
    """A feed whose groups are rollouts given by the test."""

    def __init__(self, items):
        self.items, self.stopped = items, False

    def start(self, groups, first_batch, may_start):
        self.may_start = may_start
        for order, item in enumerate(self.items):
            groups.put(order, item)

    def to_rollout(self, items):
        from unirl.env import Rollout

        return Rollout(tensors={"response_mask": torch.cat([i["mask"] for i in items])},
                       token_version=torch.cat([i["versions"] for i in items]),
                       group_ids=torch.arange(len(items)), prompts=["p"] * len(items), samples=["s"] * len(items))

    def waiting(self, finished, needed, waited_s):
        return f"only {finished} of {needed}"

    def metrics(self):
        return {}

    def stop(self):
        self.stopped = True


def test_a_streamed_batch_is_stamped_bounded_and_scored():
    items = [{"mask": torch.tensor([[1.0, 1.0, 0.0, 1.0]]), "versions": torch.tensor([[2, 2, -1, 3]])},
             {"mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]), "versions": torch.tensor([[3, 3, 3, -1]])}]
    feed = ListFeed(items)
    engine = VersionedEngine(ScriptedEngine(lambda c: "x$"), 0)
    source = StreamSource(feed, engine, max_staleness=1, prompts_per_step=2,
                          score=lambda r: (torch.ones(len(r)), {"reward/mean": 1.0}),
                          snapshot=lambda steps: None, sync=lambda: None, wait_s=1.0)
    source.start(step=2, optimizer_steps=3)  # the run (resumed) at step 2, 3 optimizer steps
    assert feed.may_start(3) and not feed.may_start(4)  # at most k + 1 prompt batches at once
    batch, _ = source.get(step=3, optimizer_steps=4)  # step 3 may train tokens of step 2's weights (3) or later
    r = batch.rollout
    assert r.policy_version.tolist() == [2, 3]  # each sample's oldest trained token
    assert r.tensors["response_mask"].tolist() == [[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]]  # version 2: too old
    metrics = source.step_metrics(batch, 4, 0.0)
    assert metrics["rollout/stale_token_frac"] == pytest.approx(2 / 6)
    assert metrics["rollout/staleness_max"] == 2
    source.after_update(5)
    assert engine._next == (None, 5)  # the next generation loads it
    with pytest.raises(TimeoutError, match="only 0 of 2"):
        source.get(step=4, optimizer_steps=5)
    source.close()
    assert feed.stopped


def test_k0_pauses_generation_from_the_batch_to_the_update():
    feed = ListFeed([{"mask": torch.ones(1, 2), "versions": torch.zeros(1, 2, dtype=torch.long)}])
    engine = VersionedEngine(ScriptedEngine(lambda c: "x$"), 0)
    synced = []
    source = StreamSource(feed, engine, max_staleness=0, prompts_per_step=1, score=lambda r: (torch.ones(len(r)), {}),
                          snapshot=None, sync=lambda: synced.append(1))
    source.start(0, 0)
    source.get(0, 0)
    done = threading.Event()
    threading.Thread(target=lambda: (engine.generate([[5]], n=1, max_new_tokens=2, temperature=1.0), done.set()),
                     daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # held while the trainer updates
    source.after_update(1)
    assert done.wait(5) and synced == [1] and engine.version == 1


def test_finished_groups_come_oldest_first_and_a_feed_failure_is_raised():
    groups = FinishedGroups()
    for order in (3, 1, 2):
        groups.put(order, order)
    assert groups.take(2, 1.0, str) == [1, 2]
    groups.fail(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        groups.take(2, 1.0, str)


def _call(prompt, response, version=0, finished=True):
    return Call(prompt, response, [-0.5] * len(response), version, finished)


def test_calls_that_extend_each_other_become_one_masked_trajectory():
    first = _call([10, 11], [20, EOS], version=3)
    second = _call([10, 11, 20, EOS, 30, 31], [21, EOS], version=4)  # the observation 30 31 after the completion
    (traj,), finished, breaks = chain([first, second])
    assert traj.prompt_ids == [10, 11]
    assert traj.ids == [20, EOS, 30, 31, 21, EOS]
    assert traj.loss_mask == [1, 1, 0, 0, 1, 1]
    assert traj.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert traj.versions == [3, 3, -1, -1, 4, 4]
    assert finished == [True] and breaks == 0


@pytest.mark.parametrize("second_prompt", [
    [10, 11, 20, 30, 31],  # the agent dropped the EOS its text never showed
    [10, 12, 20, EOS, 30],  # it rewrote its history
    [10, 11],  # it sent a shorter context (a fresh start)
])
def test_a_call_that_does_not_chain_starts_a_new_trajectory(second_prompt):
    trajectories, finished, breaks = chain([_call([10, 11], [20, EOS]), _call(second_prompt, [21], finished=False)])
    assert breaks == 1 and [t.prompt_ids for t in trajectories] == [[10, 11], second_prompt]
    assert trajectories[1].ids == [21] and trajectories[1].loss_mask == [1] and finished == [True, False]


class _CharEngine(ScriptedEngine):
    """A scripted engine with the character tokenizer, as the agent endpoint reads ``engine.tokenizer``."""

    def __init__(self, script):
        super().__init__(script)
        self.tokenizer = CharTokenizer()

    def generate(self, prompt_ids, *, seed=None, **kw):  # the Engine protocol's seed (the script ignores it)
        return super().generate(prompt_ids, **kw)


def test_the_agent_endpoint_records_sessions_and_refuses_what_it_should(tmp_path, monkeypatch):
    import httpx

    from unirl.config.schema import AgentEndpointConfig
    from unirl.rollout.sessions import TOKEN_ENV, SessionFeed

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match="needs|token"):  # beyond loopback only with a token
        SessionFeed(AgentEndpointConfig(port=0, host="0.0.0.0"), None, model_name="m", group_size=2, max_tokens=4,
                    reads_reward=True)
    engine = VersionedEngine(_CharEngine(lambda context: "ab$"), 3)
    feed = SessionFeed(AgentEndpointConfig(port=0, max_open_sessions=2, max_calls_per_session=2), engine,
                       model_name="m", group_size=2, max_tokens=4, reads_reward=True, output_dir=str(tmp_path))
    groups = FinishedGroups()
    feed.start(groups, 0, lambda b: True)
    try:
        url = json.loads((tmp_path / "agent_endpoint.json").read_text())["url"]
        http = httpx.Client(base_url=url, timeout=10)

        def call(prompt, user="s1", **kw):
            return http.post("/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4, "user": user,
                                                   "return_token_ids": True, **kw})

        first = call("hi")
        assert first.status_code == 200, first.text
        choice = first.json()["choices"][0]
        assert choice["token_ids"] == [ord("a"), ord("b"), EOS] and choice["finish_reason"] == "stop"
        # the second call shows the first completion (its EOS written back) and the environment's answer "!"
        second = call([ord(c) for c in "hi"] + choice["token_ids"] + [ord("!")])
        assert second.status_code == 200, second.text
        assert call("x", user="s2").status_code == 200  # a second session, s1 still open
        assert call("y", user="s3").status_code == 429  # max_open_sessions=2
        assert call("z").status_code == 400  # s1 made its max_calls_per_session=2
        assert call("hi", user="s2", max_tokens=5).status_code == 400  # over max_tokens
        assert http.post("/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200  # unrecorded
        assert http.post("/sessions/nope/reward", json={"reward": 1.0}).status_code == 404
        assert http.post("/sessions/s1/reward", json={"reward": True}).status_code == 400
        assert http.post("/sessions/s1/reward", json={"reward": 1.0, "group": "g"}).status_code == 200
        assert len(groups) == 0  # one session of the group of two
        assert http.post("/sessions/s1/reward", json={"reward": 1.0}).status_code == 404  # ended
        assert call("q", user="s2").status_code == 200  # does not extend "x" + its completion: a new trajectory
        assert http.post("/sessions/s2/reward", json={"reward": 0.0, "group": "g"}).status_code == 200
        (items,) = groups.take(1, 1.0, str)
        rollout = feed.to_rollout([items])
        metrics = feed.metrics()
    finally:
        feed.stop()
    ab = [ord("a"), ord("b"), EOS]
    # s1: "hi" -> ab<EOS>, "!" shown, ab<EOS>: one trajectory; s2: "x" -> ab<EOS>, then "q" cut off as a second
    assert rollout.tensors["response_ids"].shape[0] == 3 and rollout.columns["session_reward"] == [1.0, 0.0, 0.0]
    assert rollout.tensors["response_ids"][0, :7].tolist() == ab + [ord("!")] + ab
    assert rollout.tensors["response_mask"][0, :7].tolist() == [1, 1, 1, 0, 1, 1, 1]
    assert rollout.token_version[0, :7].tolist() == [3, 3, 3, -1, 3, 3, 3]
    assert rollout.group_ids.tolist() == [0, 0, 0]
    assert metrics["agent/prefix_breaks"] == 1 and metrics["agent/unrecorded_calls"] == 1
