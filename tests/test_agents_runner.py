"""The episode runner (unirl/agents/runner.py) with a scripted engine and a character tokenizer: turns and
observations laid out with loss-mask holes and each turn's reward on its last token, the limits, a
group's first turn as one request, environments that raise, hang, answer wrongly or await I/O (one line
each, counted, never a hung run, every episode closed, also when the run stops); the rollout, its
figures and the trainer's per-turn token rewards built from it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from unirl.agents import Episode, EpisodeError, Step, load_environment, register_environment
from unirl.agents.episodes import chat_observation, episode_metrics, traces_to_rollout
from unirl.agents.protocol import ENVIRONMENTS
from unirl.agents.runner import run_episodes
from unirl.rollout.engine import Generation

EOS = 0


class CharTokenizer:
    pad_token_id = 1
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 1 or not skip_special_tokens)

    def get_vocab(self):
        return {chr(i): i for i in range(2, 0x250)}


class ScriptedEngine:
    """Answers each context with ``script(context_text)`` ("$" at the end: EOS), cut at ``max_new_tokens``;
    every token's log-prob is -0.25. Records each call's (rows, n)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, *, n, max_new_tokens, temperature, top_p=1.0, top_k=-1, greedy=False, stop=None):
        self.calls.append((len(prompt_ids), n))
        out = []
        for ids in prompt_ids:
            out.append([self._one("".join(chr(i) for i in ids), max_new_tokens) for _ in range(n)])
        return out

    def _one(self, context, max_new_tokens):
        text = self.script(context)
        tokens = [ord(c) for c in text.rstrip("$")] + ([EOS] if text.endswith("$") else [])
        tokens = tokens[:max_new_tokens]
        return Generation(tokens, [-0.25] * len(tokens), text, finished=bool(tokens) and tokens[-1] == EOS)


class Counter(Episode):
    """Counts to a target: the policy says a number, the environment answers "n=<count>"; each turn earns
    ``per_turn``, reaching the target ``bonus`` and ends the episode. Records close() calls."""

    closed: list = []

    def __init__(self, row, *, per_turn: float = 0.5, bonus: float = 1.0):
        self.target, self.count, self.per_turn, self.bonus = row["target"], 0, per_turn, bonus

    def reset(self):
        return f"to {self.target}:"

    def step(self, action):
        self.count += 1
        if self.count == self.target:
            return Step(reward=self.per_turn + self.bonus, done=True)
        return Step(observation=f"n={self.count};", reward=self.per_turn)

    def close(self):
        Counter.closed.append(self.target)


def say_x(context):
    return "x$"


def play(make, rows, engine=None, **kw):
    kw = {"n": 1, "max_turns": 4, "max_new_tokens": 8, "max_total_tokens": None, "temperature": 1.0,
          "step_timeout_s": 5.0, **kw}
    return run_episodes(engine or ScriptedEngine(say_x), CharTokenizer(), make, rows,
                        encode=lambda text: [ord(c) for c in text], **kw)


@pytest.fixture(autouse=True)
def _fresh():
    Counter.closed = []


def test_turns_observations_and_rewards_laid_out():
    trace = play(Counter, [{"prompt": "p", "target": 3}])[0][0]
    # prompt "to 3:"; turns "x" EOS, observations "n=1;" and "n=2;" between them; done on the third.
    assert trace.prompt_ids == [ord(c) for c in "to 3:"]
    x = [ord("x"), EOS]
    assert trace.ids == x + [ord(c) for c in "n=1;"] + x + [ord(c) for c in "n=2;"] + x
    assert trace.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert trace.logprobs == [-0.25, -0.25] + [0.0] * 4 + [-0.25, -0.25] + [0.0] * 4 + [-0.25, -0.25]
    assert trace.turn_ends == [1, 7, 13] and trace.turn_rewards == [0.5, 0.5, 1.5]
    assert (trace.turns, trace.done, trace.truncated, trace.episode_return) == (3, True, False, 2.5)
    assert Counter.closed == [3]


def test_limits_end_episodes_truncated():
    # max_turns: still counting after 2 turns; the second turn's step still earns its reward.
    t = play(Counter, [{"prompt": "p", "target": 5}], max_turns=2)[0][0]
    assert (t.turns, t.done, t.truncated, t.turn_rewards) == (2, False, True, [0.5, 0.5])
    # a turn cut at max_new_tokens (no EOS) is stepped, then ends the episode.
    t = play(Counter, [{"prompt": "p", "target": 5}], engine=ScriptedEngine(lambda c: "xyz$"), max_new_tokens=2)[0][0]
    assert (t.ids, t.turns, t.truncated, t.turn_rewards) == ([ord("x"), ord("y")], 1, True, [0.5])
    # max_total_tokens: prompt 5 + turn 2 + observation 4 + turn 2 = 13; a limit of 12 cuts the second turn.
    t = play(Counter, [{"prompt": "p", "target": 5}], max_total_tokens=12)[0][0]
    assert len(t.prompt_ids) + len(t.ids) == 12 and t.truncated and t.turns == 2
    assert Counter.closed == [5, 5, 5]


def test_a_group_shares_its_first_request_and_rows_make_their_episodes():
    engine = ScriptedEngine(say_x)
    groups = play(Counter, [{"prompt": "p", "target": 1}, {"prompt": "q", "target": 2}], engine=engine, n=3)
    assert [[t.turns for t in g] for g in groups] == [[1, 1, 1], [2, 2, 2]]
    # one request per row with n=3; then the 3 still playing, whose contexts the script made equal: one with n=3
    assert engine.calls == [(2, 3), (1, 3)]
    counter = iter(range(100))
    engine = ScriptedEngine(lambda context: f"{next(counter)}$")  # every sample its own text
    play(Counter, [{"prompt": "p", "target": 1}, {"prompt": "q", "target": 2}], engine=engine, n=3)
    assert engine.calls == [(2, 3), (3, 1)]  # contexts that differ are requests of their own


class Flaky(Counter):
    """Row "mode" picks how it misbehaves on its second step."""

    def step(self, action):
        mode = self.mode
        if self.count == 1:
            if mode == "raise":
                raise RuntimeError("the simulator crashed")
            if mode == "hang":
                time.sleep(30)
            if mode == "tuple":
                return ("obs", 1.0, False, False)
            if mode == "nan":
                return Step(reward=float("nan"))
        return super().step(action)

    def __init__(self, row, **kw):
        super().__init__(row, **kw)
        self.mode = row["mode"]


@pytest.mark.parametrize("mode,what", [("raise", "step() of turn 2 raised RuntimeError: the simulator crashed"),
                                       ("hang", "step() of turn 2 timed out after 0.5 s"),
                                       ("tuple", "turn 2: step() returned a tuple, not a unirl.agents.Step"),
                                       ("nan", "returned the reward nan")])
def test_a_failing_environment_ends_its_episode_only(capsys, mode, what):
    start = time.monotonic()
    groups = play(Flaky, [{"prompt": "p", "target": 3, "mode": mode}, {"prompt": "q", "target": 3, "mode": "ok"}],
                  n=2, step_timeout_s=0.5)
    assert time.monotonic() - start < 10  # the hung step does not hold the run
    bad, good = groups
    assert all(t.error is not None and what in t.error and t.truncated and t.turns == 2 for t in bad), bad[0].error
    assert all(t.error is None and t.done and t.episode_return == 2.5 for t in good)
    assert [t.timed_out for t in bad] == [mode == "hang"] * 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "ended at turn 2" in line]
    assert len(lines) == 2 and "episode 0 (prompt 'p')" in lines[0] and what in lines[0]
    assert sorted(Counter.closed) == [3, 3, 3, 3]  # every episode closed, the failed ones too
    # In the rollout the failed episodes leave the loss, and are counted.
    rollout = traces_to_rollout([{"prompt": "p"}, {"prompt": "q"}], groups, CharTokenizer(), turn_discount=1.0)
    assert rollout.tensors["response_mask"][:2].sum() == 0 and rollout.tensors["response_mask"][2:].sum() > 0
    figures = episode_metrics(rollout.tensors)
    assert figures["env/errors"] == 2 and figures["env/timeouts"] == (2 if mode == "hang" else 0)


class Broken(Counter):
    def reset(self):
        raise KeyError("no such level")

    def close(self):
        Counter.closed.append("broken")
        raise OSError("already gone")


def test_reset_and_close_failures(capsys):
    trace = play(Broken, [{"prompt": "level 7", "target": 2}])[0][0]
    assert trace.prompt_ids == [ord(c) for c in "level 7"] and trace.ids == [] and trace.turns == 0
    assert "reset() raised KeyError" in trace.error and "close() raised OSError: already gone" in trace.close_error
    assert Counter.closed == ["broken"]
    err = capsys.readouterr().err
    assert "ended at turn 0: reset() raised KeyError" in err and "close() raised OSError" in err


class Slow(Counter):
    """Awaits 0.2 s of "I/O" in each step."""

    async def step(self, action):
        await asyncio.sleep(0.2)
        return super().step(action)


def test_async_environments_wait_together():
    start = time.monotonic()
    groups = play(Slow, [{"prompt": "p", "target": 2}] * 8, n=4)  # 32 episodes, 2 steps of 0.2 s each
    elapsed = time.monotonic() - start
    assert all(t.done and t.episode_return == 2.0 for g in groups for t in g)
    assert elapsed < 2.0, f"32 episodes x 2 steps of 0.2 s took {elapsed:.1f} s: the steps did not overlap"


class Exploding:
    def generate(self, *a, **k):
        raise RuntimeError("CUDA out of memory")


def test_the_engine_failing_stops_the_run_and_closes_every_episode():
    with pytest.raises(RuntimeError, match="out of memory"):
        play(Counter, [{"prompt": "p", "target": 2}, {"prompt": "q", "target": 3}], engine=Exploding(), n=2)
    assert sorted(Counter.closed) == [2, 2, 3, 3]


def test_the_runner_works_inside_a_running_event_loop():
    async def caller():
        return play(Counter, [{"prompt": "p", "target": 2}])

    assert asyncio.run(caller())[0][0].done


def test_loading_environments():
    make = load_environment("walk", {"goal_reward": 2.0})
    episode = make({"start": 3, "goal": 4})
    assert episode.reset() == "at 3 goal 4\n" and episode.step("r") == Step(reward=2.0, done=True)
    with pytest.raises(EpisodeError, match="has no parameter 'goal_rewrd'.*Did you mean 'goal_reward'"):
        load_environment("walk", {"goal_rewrd": 2.0})
    with pytest.raises(EpisodeError, match="unknown environment 'wlak'.*Did you mean 'walk'"):
        load_environment("wlak")
    with pytest.raises(EpisodeError, match="made a dict without reset and step"):
        load_environment(f"{__name__}:_not_an_episode")({"prompt": "p"})
    assert load_environment(f"{__name__}:Counter", {"bonus": 3.0})({"target": 1}).step("x").reward == 3.5


def _not_an_episode(row):
    return dict(row)


def test_the_walk_in_words_for_an_instruct_model():
    """The words style (configs/text/smollm2_game.yaml): an answer naming one direction moves, one naming both or
    neither wastes the turn; a row's ``cells`` sets the line (its ends hold); train and test rows are disjoint."""
    from unirl.agents.tiny_game_task import words_rows

    episode = load_environment("walk", {"style": "words"})({"start": 18, "goal": 16, "cells": 20})
    assert episode.reset() == ("Position 18, target 16. Left goes down, right goes up. To reach the target, should "
                               "I go left or right? Reply with one word.")
    assert episode.step("To reach the target, you should go Left.").observation.startswith("Position 17, target 16.")
    for wasted in ("left or right?", "Go up.", "l"):  # both, neither, the terse style's move
        assert episode.step(wasted).observation.startswith("Position 17,")
    assert episode.step("RIGHT").observation.startswith("Position 18,")
    assert episode.step("right").observation.startswith("Position 19,")
    assert episode.step("right").observation.startswith("Position 19,")  # the line's end holds
    assert load_environment("walk", {"style": "words"})({"start": 1, "goal": 0}).step("left") == Step(reward=1.0,
                                                                                                      done=True)
    train, test = words_rows("train"), words_rows("test")
    pairs = lambda rows: {(r["start"], r["goal"]) for r in rows}  # noqa: E731
    assert len(train) + len(test) == 108 and len(test) == 32 and not pairs(train) & pairs(test)
    assert all(0 < abs(r["start"] - r["goal"]) <= 3 and r["prompt"] == load_environment("walk", {"style": "words"})(
        r).reset() for r in train + test)
    tight = load_environment("walk", {"style": "words", "slack": 1})({"start": 5, "goal": 3, "cells": 20})
    assert not tight.step("right").truncated and not tight.step("left").truncated  # 2 + 1 turns: one more
    assert tight.step("left") == Step(reward=0.0, truncated=True)
    exact = load_environment("walk", {"slack": 0})({"start": 5, "goal": 3})  # 2 turns: every move must be right
    assert not exact.step("l").truncated and exact.step("r") == Step(reward=0.0, truncated=True)
    with pytest.raises(ValueError, match="style is one of terse, words; got 'word'"):
        load_environment("walk", {"style": "word"})({"start": 1, "goal": 0})
    with pytest.raises(ValueError, match="a row needs 'goal', a cell 0..9; got 12"):
        load_environment("walk")({"start": 1, "goal": 12})


def test_registering_an_environment():
    try:
        register_environment("counter_for_test")(Counter)
        assert ENVIRONMENTS.info["counter_for_test"].description.startswith("Counts to a target")
        with pytest.raises(ValueError, match="already registered"):
            register_environment("counter_for_test")(Flaky)
    finally:
        ENVIRONMENTS.remove("counter_for_test")
        ENVIRONMENTS.info.pop("counter_for_test", None)


def test_rollout_tensors_and_per_turn_token_rewards():
    """The trainer's token rewards (``unirl.trainer.advantages._token_rewards``) of a rollout of episodes,
    by hand: one Counter episode to 3 (rewards 0.5, 0.5, 1.5 on tokens 1, 7, 13), turn discount 0.5."""
    from unirl.trainer.advantages import _token_rewards

    groups = play(Counter, [{"prompt": "p", "target": 3, "answer": "x"}])
    rollout = traces_to_rollout([{"prompt": "p", "target": 3}], groups, CharTokenizer(), turn_discount=0.5)
    t = rollout.tensors
    assert t["turn_ends"][0].nonzero().flatten().tolist() == [1, 7, 13]
    assert rollout.columns["episode_return"] == [2.5] and rollout.columns["target"] == [3]
    assert rollout.samples == ["xn=1;xn=2;x"] and rollout.prompts == ["to 3:"]
    mask = t["response_mask"].bool()
    R = torch.tensor([2.5])  # the reward set's: episode_return
    # G_3 = 1.5, G_2 = 0.5 + 0.5 * 1.5 = 1.25, G_1 = 0.5 + 0.5 * 1.25 = 1.125
    for estimator, expected in (("reinforce++", {1: 1.125, 7: 1.25, 13: 1.5}),  # G_k
                                ("gae", {1: 1.125 - 1.25, 7: 1.25 - 1.5, 13: 1.5})):  # G_k - G_{k+1}
        ctx, state = SimpleNamespace(algo=SimpleNamespace(adv_estimator=estimator)), SimpleNamespace(kl_ctrl=None)
        scores, _, _ = _token_rewards(ctx, state, rollout, R, mask)
        want = torch.zeros_like(scores)
        for i, v in expected.items():
            want[0, i] = v
        torch.testing.assert_close(scores, want, rtol=0, atol=1e-6)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_observations_continue_the_template():
    tok = SimpleNamespace(eos_token="<|im_end|>", chat_template=CHATML)

    def apply_chat_template(messages, tokenize, add_generation_prompt):
        from jinja2 import Template

        return Template(CHATML).render(messages=messages, add_generation_prompt=add_generation_prompt)

    tok.apply_chat_template = apply_chat_template
    wrap = chat_observation(tok)
    assert wrap("at 4", True) == "\n<|im_start|>user\nat 4<|im_end|>\n<|im_start|>assistant\n"
    assert wrap("at 4", False) == "<|im_end|>\n<|im_start|>user\nat 4<|im_end|>\n<|im_start|>assistant\n"


def test_no_thread_is_left_behind_by_a_finished_run():
    before = set(threading.enumerate())  # a hung step's daemon thread of an earlier test may still sleep
    play(Counter, [{"prompt": "p", "target": 2}] * 4, n=2)
    time.sleep(0.1)
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
