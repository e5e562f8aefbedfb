"""What a run does when something fails around its steps, on the tiny text model in-process.

A failing final evaluation loses no trained step: the finished run is saved first and the error
says where the checkpoint is.
"""

from __future__ import annotations

import pytest

from unirl.rewards.registry import RewardError
from unirl.cli import load_run_config
from unirl.config import config_to_dict
from unirl.trainer.loop import Trainer
from unirl.text.env import TextEnvironment

SMALL = ["rollout.engine=hf", "rollout.max_new_tokens=8", "trainer.prompts_per_step=2", "trainer.group_size=4",
         "trainer.mini_batch_size=8", "trainer.micro_batch_size=8", "trainer.progress=false", "trainer.total_steps=2"]


def _trainer(tmp_path, *overrides: str) -> Trainer:
    cfg = load_run_config("text", "tiny", [*SMALL, *overrides], output_dir=str(tmp_path / "run"))
    return Trainer(TextEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer, run_dir=cfg.output_dir,
                   config_dict=config_to_dict(cfg))


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
