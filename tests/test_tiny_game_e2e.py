"""``configs/text/tiny_game.yaml`` end to end through the CLI: GRPO on the walk game's episode returns makes
the warm-started tiny model reach its goal more often in fewer turns (a stateful environment over
several turns, observations masked); the per-turn path (a reward every turn, discounted over turns)
trains PPO's critic and REINFORCE++; and episodes go through DAPO's dynamic sampling and overlong
penalty, asynchronous rollouts and on-policy distillation. The model's build (~30 s) happens once (UNIRL_CACHE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _train(run: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "unirl.cli", "train", "text", "--config", "tiny_game", "--output-dir",
                           str(run), "trainer.progress=false", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tiny_game_reward_rises_over_turns(tmp_path):
    logged = _train(tmp_path / "run", "trainer.total_steps=12", "trainer.eval_every=12", "trainer.save_every=12")
    rows = [r for r in logged if "reward/mean" in r]
    assert len(rows) == 12

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:2], rows[-2:]
    reward = (mean("reward/mean", first), mean("reward/mean", last))
    turns = (mean("env/turns_mean", first), mean("env/turns_mean", last))
    assert reward[1] >= reward[0] + 0.3, f"reward/mean: first 2 steps {reward[0]:.2f}, last 2 {reward[1]:.2f}"
    assert turns[1] < turns[0], f"env/turns_mean: first 2 steps {turns[0]:.2f}, last 2 {turns[1]:.2f}"
    assert all(r["env/errors"] == 0 and r["env/timeouts"] == 0 and r["rollout/observation_tokens_mean"] > 0
               for r in rows)
    evals = [r for r in logged if "eval/accuracy" in r]
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"], evals
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert any("goal" in s["response"] for s in samples)  # greedy episodes of several turns, observations shown


@pytest.mark.parametrize("estimator", ["gae", "reinforce++"])
def test_per_turn_rewards_train_the_token_estimators(tmp_path, estimator):
    logged = _train(tmp_path / estimator, "trainer.total_steps=2", "trainer.eval_every=0", "trainer.save_every=0",
                    f"algo.adv_estimator={estimator}", "rollout.environment.kwargs.step_reward=-0.1",
                    "rollout.environment.turn_discount=0.9")
    rows = [r for r in logged if "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/return_mean"] < 1.0 and r["adv/abs_mean"] > 0 for r in rows)
    if estimator == "gae":
        assert all("critic/vf_loss" in r for r in rows), sorted(rows[0])


@pytest.mark.parametrize("feature,overrides", [
    ("dapo", ["algo.filter_groups.enabled=true", "algo.filter_groups.metric=episode_return", "overlong.buffer=2"]),
    ("async", ["source.max_staleness=1"]),
    ("distill", ["distill.teacher=tiny_teacher", "distill.mode=added"]),  # the tiny teacher shares the tokenizer
])
def test_episodes_with(tmp_path, feature, overrides):
    logged = _train(tmp_path / feature, "trainer.total_steps=2", "trainer.eval_every=0", "trainer.save_every=0",
                    *overrides)
    rows = [r for r in logged if "reward/mean" in r]
    assert len(rows) == 2 and all(r["env/errors"] == 0 and r["env/turns_mean"] > 1 for r in rows)
    figure = {"dapo": "filter/kept_groups", "async": "rollout/staleness_mean", "distill": "distill/reverse_kl"}[feature]
    assert all(figure in r for r in rows), sorted(rows[0])


def test_episodes_in_flight_at_a_checkpoint_resume_exactly(tmp_path):
    """The resume rule for episodes (docs/agents.md): a step's episodes all end before its update, so a
    checkpoint never holds a half-played episode; with asynchronous rollouts the batches played ahead (episodes
    of later prompts, played with older weights) are finished first and saved whole with the checkpoint, and the
    resumed run trains on exactly them. SIGTERM during step 2 of 4 at source.max_staleness=1, then resume: steps
    3 and 4 give the uninterrupted run's figures."""
    from stage_helpers import sigterm_after  # tests/stage_helpers.py

    from unirl.cli import load_run_config
    from unirl.text.env import TextEnvironment
    from unirl.trainer.loop import Preempted, Trainer

    args = ["trainer.total_steps=4", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=16",
            "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.save_every=0", "trainer.progress=false",
            "source.max_staleness=1"]

    def trainer(name: str, *extra: str) -> Trainer:
        cfg = load_run_config("text", "tiny_game", [*args, *extra], output_dir=str(tmp_path / name))
        return Trainer.from_config(TextEnvironment(cfg), cfg)

    def figures(rows):  # what the run's math gives: wall-clock figures (time/, perf/, the env's latency) left out
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and k != "env/step_latency_s"}
                for r in rows]

    whole = figures(trainer("whole").train())
    stopped = trainer("split")
    sigterm_after(stopped, 2)
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 2"):
        stopped.train()
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step_000002" / "trainer_state" / "source.json").read_text())
    assert [item["batch"] for item in saved["batches"]] == [2]  # batch 2's episodes, played to their end
    resumed = figures(trainer("split", "trainer.resume=true").train())
    assert all(r["env/turns_mean"] > 1 for r in resumed)
    assert resumed == whole[2:]
