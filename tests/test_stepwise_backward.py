"""Diffusion backpropagates one trained step at a time (FlowGRPO's order) and gets the same gradient.

The loop evaluates and backpropagates each piece of ``Environment.column_slices`` in turn, so only
one denoising step's graph is alive at a time. The accumulated gradient and the logged loss must equal
those of evaluating all trained steps at once (the previous behaviour), for every loss aggregation
mode, with the KL term on and the policy away from its reference and its sampling policy.
"""

from __future__ import annotations

import pytest
import torch

from unirl.cli import load_run_config
from unirl.config import config_to_dict
from unirl.core import AGG_MODES
from unirl.diffusion.env import DiffusionEnvironment
from unirl.trainer.loop import Trainer
from unirl.trainer.update import micro_backward, mini_denominator


@pytest.fixture(scope="module")
def trainer_and_batch(tmp_path_factory):
    cfg = load_run_config("diffusion", "tiny", [
        "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.mini_batch_size=8", "trainer.micro_batch_size=8",
        "trainer.eval_every=0", "trainer.progress=false", "trainer.reward_workers=0", "algo.kl_coef=0.05",
        "ema.enabled=false", "optim.lr=1e-2",
    ], output_dir=str(tmp_path_factory.mktemp("stepwise") / "run"))
    trainer = Trainer(DiffusionEnvironment(cfg), algo=cfg.algo, optim=cfg.optim, trainer=cfg.trainer,
                      run_dir=cfg.output_dir, config_dict=config_to_dict(cfg))
    trainer.setup()
    rollout = trainer.env.sampler.rollout(trainer.env.prompts.next(0), 4)
    rewards = torch.linspace(0, 1, len(rollout))
    trainer.advantages(rollout, rewards)
    trainer.old_and_reference(rollout)
    trainer.update(rollout)  # move the policy away from the reference and the sampler
    yield trainer, rollout
    trainer.env.close()


def _grads(trainer, rollout, agg: str, whole: bool):
    trainer.algo.loss_agg = agg
    env = trainer.env
    if whole:
        env.column_slices = lambda batch: [slice(None)]
    try:
        trainer.optimizer.zero_grad(set_to_none=True)
        denominator = mini_denominator(trainer, rollout)
        metrics = micro_backward(trainer, env.model, rollout, denominator, sync=True)
        grads = [p.grad.detach().clone() for p in env.model.parameters() if p.requires_grad]
    finally:
        env.__dict__.pop("column_slices", None)
        trainer.optimizer.zero_grad(set_to_none=True)
    return grads, metrics


@pytest.mark.parametrize("agg", AGG_MODES)
def test_stepwise_backward_gives_the_whole_gradient(trainer_and_batch, agg):
    trainer, rollout = trainer_and_batch
    assert len(trainer.env.actions.column_slices(rollout)) == rollout.old_logp.shape[1] == 8
    stepwise, m_steps = _grads(trainer, rollout, agg, whole=False)
    whole, m_whole = _grads(trainer, rollout, agg, whole=True)
    assert m_whole["loss/kl"] > 0 and abs(m_whole["actor/ratio_max"] - 1) > 1e-6  # off-policy, off-reference
    # The per-token terms are O(1) (advantages, ratios) and summed in float32 in a different order:
    # the sums agree to float32 rounding of such terms.
    for name in ("loss/total", "loss/policy", "loss/kl"):
        assert m_steps[name] == pytest.approx(m_whole[name], rel=1e-5, abs=1e-6), name
    # The ratio figures are computed once over the micro-batch from the pieces' log-probs: the same
    # figures, up to the float32 rounding of the log-probs' forward in pieces.
    assert {k for k in m_steps if k.startswith("actor/")} == {k for k in m_whole if k.startswith("actor/")}
    for name in (k for k in m_whole if k.startswith("actor/")):
        assert m_steps[name] == pytest.approx(m_whole[name], rel=1e-5, abs=1e-6), name
    scale = max(g.abs().max() for g in whole)
    assert scale > 0
    for a, b in zip(stepwise, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(scale))
