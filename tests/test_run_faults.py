"""What a run does when something fails around its steps, on the tiny text model in-process.

A failing final evaluation loses no trained step: the finished run is saved first and the error
says where the checkpoint is.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from unirl.rewards.registry import RewardError
from unirl.cli import load_run_config
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment

SMALL = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.group_size=4",
         "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.progress=false", "trainer.total_steps=2"]


def _trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = load_run_config("text", "tiny", [*SMALL, *overrides], output_dir=str(tmp_path / "run"))
    return Trainer.from_config(TextEnvironment(cfg), cfg)


@pytest.mark.parametrize("error", [RewardError("reward 'flaky' raised on sample 0: no network"),
                                   RuntimeError("out of memory in evaluation")])
def test_a_failing_final_evaluation_keeps_the_trained_steps(tmp_path, tiny_lm_dir, error):
    trainer = _trainer(tmp_path, "trainer.eval_every=2", "trainer.save_every=0")
    real = trainer.env.evaluation

    def evaluation(step, run_dir):
        if step > 0:  # the evaluation at step 0 runs; the one after the last step fails
            raise error
        return real(step, run_dir)

    trainer.env.evaluation = evaluation
    with pytest.raises(type(error)) as info:
        trainer.train()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (checkpoint / "trainer_state" / "loop.json").exists()  # both trained steps are kept
    said = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert f"evaluation at step 2" in said and f"the last checkpoint is {checkpoint}" in said


PPO_SMALL = ["rollout.engine=hf", "rollout.max_new_tokens=6", "trainer.prompts_per_step=8", "trainer.mini_batch_size=8",
             "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false"]


def test_non_finite_values_stop_the_run_with_one_line_and_keep_the_last_good_checkpoint(tmp_path, tiny_lm_dir, capsys):
    """A critic learning rate of 1e30 (issue 37): its first update throws the value head's weights to
    ~1e30, and from step 2 the values, the advantages and the losses are NaN or inf. Two such steps
    (trainer.max_nonfinite_steps=2) stop the run naming the figure; no checkpoint is written from the
    first non-finite step on."""
    from unirl.trainer.nonfinite import NonFiniteError

    cfg = load_run_config("text", "tiny_ppo", [*PPO_SMALL, "critic.optim.lr=1e30", "trainer.total_steps=6",
                                               "trainer.save_every=1", "trainer.keep_checkpoints=null",
                                               "trainer.max_nonfinite_steps=2"], output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in rows if not all(math.isfinite(r[k]) for k in r if k.startswith(("loss/", "critic/vf")))]
    first = bad[0]
    assert bad == [first, first + 1] and rows[-1]["step"] == first + 1  # stopped at the second one in a row
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"step {first + 1}: ") and "trainer.max_nonfinite_steps=2" in message
    assert re.search(r"(loss/\w+|critic/\w+|adv/\w+) is (nan|inf|-inf)", message), message
    saved = sorted(int(p.name.removeprefix("step_")) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == list(range(1, first)), saved  # every finite step's checkpoint, none after
    assert f"the last checkpoint is {tmp_path / 'run' / 'checkpoints' / f'step_{first - 1:06d}'}" in message
    assert f"step {first}: not checkpointed: " in capsys.readouterr().out


def test_the_zero_advantage_streak_survives_a_resume(tmp_path, tiny_lm_dir, capsys):
    """``adv/zero_adv_steps`` counts the steps in a row whose every advantage was 0 (a reward that is always 0
    here); it travels in loop.json, so a run resumed after 3 such steps counts 4, 5 and warns at 5 as an
    uninterrupted run does (it restarted at 0 and the 5-in-a-row warning could never come)."""
    reward = tmp_path / "zero.py"
    reward.write_text("def reward(samples, **kwargs):\n    return [0.0] * len(samples)\n")
    common = [f"rewards=[{{name: {reward}:reward}}]", "trainer.save_every=1", "trainer.eval_every=0"]
    first = _trainer(tmp_path, *common, "trainer.total_steps=3")
    first.train()
    first.env.close()
    resumed = _trainer(tmp_path, *common, "trainer.total_steps=5", "trainer.resume=true")
    resumed.train()
    resumed.env.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["adv/zero_adv_steps"] for r in rows] == [1, 2, 3, 4, 5]
    assert "step 5: every advantage has been 0 for 5 steps in a row" in capsys.readouterr().out
