"""The readable GRPO step (``unirl/core/readable_step.py``) equals the trainer's loss and gradient on one
micro-batch of the tiny text model: the same rollout, advantages, old and reference log-probs, the
trainer's ``micro_loss`` against the plain-tensor function, with and without the KL penalty."""

from __future__ import annotations

import pytest
import torch

from unirl.cli import load_run_config
from unirl.core.readable_step import grpo_step_loss
from unirl.text.env import TextEnvironment
from unirl.trainer.loop import Trainer
from unirl.trainer.update import micro_loss, mini_denominator


def _trainer(tmp_path, kl: float, clip_high: float) -> Trainer:
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.mini_batch_size=8",
        "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false", "algo.loss_agg=token-mean",
        f"algo.kl_coef={kl}", f"algo.clip_high={clip_high}", "algo.kl_clamp=null", "algo.tis_cap=null",
        "optim.max_grad_norm=null", "optim.lr=1e-2", "model.share_prompt=false",
    ], output_dir=str(tmp_path / f"run-{kl}-{clip_high}"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("kl,clip_high", [(0.0, 0.2), (0.1, 0.28)])
def test_readable_step_equals_the_trainers_loss_and_gradient(tmp_path, tiny_lm_dir, kl, clip_high):
    trainer = _trainer(tmp_path, kl, clip_high)
    try:
        env, model = trainer.env, trainer.env.model
        rollout = env.rollout(env.next_prompts(0), 4)
        rewards, _ = env.score(rollout)
        rewards = rewards + torch.linspace(0, 1, len(rollout))  # groups that vary whatever the tiny model wrote
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)  # two mini-batches: the old log-probs are recomputed here
        # Move the policy off the old one, so the ratios are not all 1 and the clip can act.
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.device))
        micro = env.trim_padding(rollout.select(torch.arange(8)))  # one micro-batch
        loss, _, _ = micro_loss(trainer, model, micro, mini_denominator(trainer, micro))
        loss.backward()
        expected_grads = _grads(model)

        out = env.score_actions(model, micro)
        device = out["logp"].device  # the trainer's (a GPU's on CUDA); the rollout's tensors are on the CPU
        ref_logp = micro.ref["logp"].to(device) if kl > 0 else None
        readable = grpo_step_loss(out["logp"], micro.old_logp.to(device), ref_logp, micro.rewards.to(device),
                                  micro.group_ids.to(device), out["mask"], clip_low=trainer.algo.clip_low,
                                  clip_high=clip_high, kl_coef=kl)
        readable.backward()
        got_grads = _grads(model)
        torch.testing.assert_close(readable, loss.to(device), rtol=1e-5, atol=1e-6)
        assert max(g.abs().max().item() for g in expected_grads) > 1e-5  # a gradient that can differ
        for got, expected in zip(got_grads, expected_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    finally:
        trainer.env.close()
