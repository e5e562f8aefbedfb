"""Environments from the ecosystem through unirl's adapters, against the real packages (no mocks of them):
an OpenEnv server (openenv-core's app under uvicorn, started here) played by the episode runner, a dead
server counted as errors, and the tiny game trained through it step for step as the native walk trains;
a verifiers taskset's tasks scored by their rewards, and the tiny model trained through it step for step
as with unirl's own reward; gymnasium's FrozenLake (discrete actions, ANSI text) and a gymnasium
environment with text actions."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_agents_runner import CharTokenizer, ScriptedEngine
from unirl.agents import load_environment
from unirl.agents.runner import run_episodes

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("openenv", reason="openenv-core is in the agents extra (make setup installs it)")
pytest.importorskip("gymnasium", reason="gymnasium is in the agents extra (make setup installs it)")
pytest.importorskip("verifiers", reason="verifiers is in the agents extra (make setup installs it)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def walk_server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"  # a file: a pipe nobody reads fills and stalls it
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "openenv_walk_server.py"), str(port)], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120  # "ready" once uvicorn listens (openenv-core imports in ~5 s)
        while "ready" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "ready" in log.read_text(), log.read_text()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()  # uvicorn waits for open sessions to close: killed after a grace period
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def walker(context: str) -> str:
    """The right move from the last "at X goal Y" of the context."""
    cell, goal = map(int, re.findall(r"at (\d) goal (\d)", context)[-1])
    return ("r" if goal > cell else "l") + "$"


def play(make, rows, engine, **kw):
    kw = {"n": 1, "max_turns": 6, "max_new_tokens": 4, "max_total_tokens": None, "temperature": 1.0,
          "step_timeout_s": 20.0, **kw}
    return run_episodes(engine, CharTokenizer(), make, rows, encode=lambda text: [ord(c) for c in text], **kw)


OPENENV_WALK = {"action_key": "move", "observation_key": "text", "reset_keys": ["start", "goal"], "show_prompt": False}


def test_openenv_sessions_are_episodes(walk_server, capsys):
    make = load_environment("openenv", {"base_url": walk_server, **OPENENV_WALK})
    rows = [{"prompt": "p", "start": s, "goal": g} for s, g in ((3, 6), (8, 5), (0, 1), (9, 7))]
    groups = play(make, rows, ScriptedEngine(walker), n=4)  # 16 sessions at once, each its own state
    assert [[(t.turns, t.done, t.episode_return) for t in g] for g in groups] == \
        [[(turns, True, 1.0)] * 4 for turns in (3, 3, 1, 2)]
    trace = groups[0][0]
    assert CharTokenizer().decode(trace.prompt_ids) == "at 3 goal 6\n"
    assert CharTokenizer().decode(trace.ids, skip_special_tokens=True) == "rat 4 goal 6\nrat 5 goal 6\nr"
    # No server there: each episode is one line and an error, the run goes on.
    dead = load_environment("openenv", {"base_url": f"http://127.0.0.1:{_free_port()}", **OPENENV_WALK,
                                        "connect_timeout_s": 2.0})
    traces = play(dead, rows[:2], ScriptedEngine(walker))
    assert all(g[0].error is not None and "reset() raised ConnectionError" in g[0].error for g in traces)
    assert len([line for line in capsys.readouterr().err.splitlines() if "ended at turn 0" in line]) == 2


def _train(run: Path, *overrides: str, config: str = "tiny_game") -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", config, "--output-dir",
                           str(run), "trainer.progress=false", "trainer.total_steps=2", "trainer.eval_every=0",
                           "trainer.save_every=0", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line]


@pytest.mark.slow
def test_the_tiny_game_trains_through_openenv_as_through_the_native_walk(walk_server, tmp_path):
    kwargs = json.dumps({"base_url": walk_server, **OPENENV_WALK})
    over = _train(tmp_path / "openenv", "rollout.environment.name=openenv", f"rollout.environment.kwargs={kwargs}")
    native = _train(tmp_path / "native")
    # The same game behind HTTP: the same prompts, observations, samples and updates, step for step.
    for key in ("reward/mean", "env/turns_mean", "loss/policy", "actor/grad_norm"):
        assert [r[key] for r in over] == pytest.approx([r[key] for r in native], rel=1e-5, abs=1e-6), key
    assert all(r["env/errors"] == 0 for r in over)


def test_verifiers_tasks_are_scored_by_their_rewards():
    import asyncio

    from unirl.agents.adapters.verifiers import taskset_rows

    rows = taskset_rows("vf_addition_taskset")
    assert len(rows) == 64 and rows[0] == {"prompt": "3+3=?", "task_index": 0}
    make = load_environment("verifiers", {"taskset": "vf_addition_taskset"})
    episode = make(rows[0])
    assert episode.reset() == "3+3=?"
    right, wrong = asyncio.run(episode.step("#### 6")), asyncio.run(make(rows[0]).step("#### 7 or so"))
    assert (right.reward, right.done, right.info) == (1.0, True, {"correct": 1.0, "metric/length": 6.0})
    assert (wrong.reward, wrong.info["correct"]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="a row needs 'task_index', 0..63"):
        make({"prompt": "3+3=?"})


@pytest.mark.slow
def test_the_tiny_model_trains_through_a_verifiers_taskset_as_with_its_own_reward(tmp_path):
    from unirl.agents.adapters.verifiers import taskset_rows

    rows = tmp_path / "rows.jsonl"  # the taskset's tasks, with the gold for unirl's own gsm8k reward
    rows.write_text("".join(json.dumps({**r, "answer": str(eval(r["prompt"][:-2]))}) + "\n"
                            for r in taskset_rows("vf_addition_taskset")))
    common = ["rollout.engine=hf", f"data.train={rows}", "data.test=null"]
    through = _train(tmp_path / "verifiers", *common, "rollout.environment.name=verifiers",
                     'rollout.environment.kwargs={"taskset": "vf_addition_taskset"}', "rewards=[episode_return]",
                     config="tiny")
    own = _train(tmp_path / "own", *common, config="tiny")
    for key in ("reward/mean", "loss/policy", "actor/grad_norm", "rollout/truncated_frac"):
        assert [r[key] for r in through] == pytest.approx([r[key] for r in own], rel=1e-5, abs=1e-6), key
    assert all(r["env/errors"] == 0 and r["env/turns_mean"] == 1.0 for r in through)


def test_gymnasium_frozen_lake_through_text():
    make = load_environment("gym", {"env_id": "FrozenLake-v1",
                                    "env_kwargs": {"is_slippery": False, "render_mode": "ansi"}})
    path = iter("22111" "x" "2")  # right, right, down x3, an invalid turn, right: the goal of the 4x4 map
    engine = ScriptedEngine(lambda context: next(path) + "$")
    trace = play(make, [{"prompt": "Reach G. 0 left 1 down 2 right 3 up.\n", "seed": 0}], engine, max_turns=8)[0][0]
    assert (trace.turns, trace.done, trace.turn_rewards) == (7, True, [0, 0, 0, 0, 0, 0, 1.0])
    text = CharTokenizer().decode(trace.ids, skip_special_tokens=True)
    assert "invalid action 'x'" in text and "(Down)" in text
    assert CharTokenizer().decode(trace.prompt_ids).startswith("Reach G.")


def test_gymnasium_text_actions():
    import gymnasium

    gymnasium.register(id="unirl-test/Shout-v0", entry_point=f"{__name__}:Shout")
    make = load_environment("gym", {"env_id": "unirl-test/Shout-v0"})
    trace = play(make, [{"prompt": "", "seed": 0}], ScriptedEngine(lambda context: "hello$"), max_new_tokens=8)[0][0]
    assert (trace.turns, trace.done, trace.turn_rewards) == (2, True, [0.0, 1.0])
    assert CharTokenizer().decode(trace.ids, skip_special_tokens=True) == "hellosay it againhello"
    with pytest.raises(ValueError, match="action space is Box"):
        load_environment("gym", {"env_id": "MountainCarContinuous-v0"})({"prompt": ""})


try:
    import gymnasium as _gym

    class Shout(_gym.Env):
        """Say anything twice (text actions and observations)."""

        action_space = _gym.spaces.Text(max_length=32)
        observation_space = _gym.spaces.Text(max_length=32, charset="abcdefghijklmnopqrstuvwxyz ")

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.said = 0
            return "say something", {}

        def step(self, action):
            self.said += 1
            return "say it again", float(self.said == 2), self.said == 2, False, {}
except ImportError:  # pragma: no cover - skipped above
    pass
