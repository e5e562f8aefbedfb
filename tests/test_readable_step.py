"""The readable GRPO step (``unirl/readable_step.py``) equals the trainer's step on the tiny text model: the same
rollout and rewards, the trainer's whole step (advantages, old and reference log-probs, two micro-batches of
backward, clipping, AdamW) against the plain function on a copy of the same weights: loss, gradient and the
new weights. And with the policy moved off the one that sampled (ratios away from 1, so the clip acts), the
trainer's micro-batch loss and gradient against the function's."""

from __future__ import annotations

import copy

import pytest
import torch

from unirl.cli import load_run_config
from unirl.readable_step import grpo_step
from unirl.text.env import TextEnvironment
from unirl.trainer.loop import Trainer
from unirl.trainer.optim import build_optimizer
from unirl.trainer.update import micro_loss, mini_denominator


def _trainer(tmp_path, kl: float, clip_high: float, mini: int) -> Trainer:
    cfg = load_run_config("text", "tiny", [
        "rollout.engine=hf", "trainer.prompts_per_step=4", "trainer.group_size=4", f"trainer.mini_batch_size={mini}",
        "trainer.micro_batch_size=8", "trainer.eval_every=0", "trainer.progress=false", "algo.loss_agg=token-mean",
        f"algo.kl_coef={kl}", f"algo.clip_high={clip_high}", "algo.kl_clamp=null", "algo.tis_cap=null",
        "optim.max_grad_norm=1.0", "optim.lr=1e-2", "model.share_prompt=false", "model.logprob_chunk_size=null",
        # Adam's first step moves a weight by lr * g / (|g| + eps): at eps 1e-8 a gradient of ~1e-8 (a few of
        # the tiny model's) turns a rounding-level difference in summation order into 1e-5 of weight (CI: one of 16384). At 1e-6,
        # which both optimizers use, the compared weights are as well-conditioned as the compared gradients.
        "optim.eps=1e-6",
    ], output_dir=str(tmp_path / f"run-{kl}-{clip_high}-{mini}"))
    trainer = Trainer.from_config(TextEnvironment(cfg), cfg)
    trainer.setup()
    return trainer


def _batch(rollout, **extra) -> dict[str, torch.Tensor]:
    t = rollout.tensors
    return {"prompt_ids": t["prompt_ids"], "prompt_mask": t["prompt_mask"], "response_ids": t["response_ids"],
            "response_mask": t["response_mask"], "rewards": rollout.rewards, "group_ids": rollout.group_ids, **extra}


def _scored(trainer):
    env = trainer.env
    rollout = env.sampler.rollout(env.prompts.next(0), 4)
    rewards, _ = env.scorer.score(rollout)
    return rollout, rewards + torch.linspace(0, 1, len(rollout))  # groups that vary whatever the tiny model wrote


@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_the_readable_step_is_the_trainers_first_step(tmp_path, tiny_lm_dir, kl):
    trainer = _trainer(tmp_path, kl, 0.28, mini=16)  # one mini-batch, one epoch: the step is on-policy
    try:
        model = trainer.env.model
        initial, policy = copy.deepcopy(model), copy.deepcopy(model)
        reference = copy.deepcopy(trainer.env.ref) if kl > 0 else None
        optimizer = build_optimizer(policy, trainer.optim_cfg)
        rollout, rewards = _scored(trainer)
        grads = {}

        def recorded(module, name, step):  # the gradient at the optimizer step
            def wrapped(*args, **kwargs):
                grads[name] = [p.grad.detach().clone() for p in module.parameters() if p.requires_grad]
                return step(*args, **kwargs)
            return wrapped

        trainer.backend.clip_and_step = recorded(model, "trainer", trainer.backend.clip_and_step)
        optimizer.step = recorded(policy, "readable", optimizer.step)
        figures = trainer.learn(rollout, rewards)[1]
        readable = grpo_step(policy, reference, optimizer, _batch(rollout), micro_batch_size=8, clip_high=0.28,
                             kl_coef=kl, max_grad_norm=1.0)
        assert readable["loss/total"] == pytest.approx(figures["loss/total"], rel=1e-5, abs=1e-7)
        assert readable["grad_norm"] == pytest.approx(figures["actor/grad_norm"], rel=1e-4)
        if kl > 0:
            assert readable["loss/kl"] == pytest.approx(figures["loss/kl"], rel=1e-4, abs=1e-9)
        assert max(g.abs().max().item() for g in grads["trainer"]) > 1e-5  # a gradient that can differ
        for got, expected in zip(grads["readable"], grads["trainer"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        # The same new weights, and they did move (lr 1e-2: Adam's first step moves each weight by ~lr).
        for p, q, before in zip(model.parameters(), policy.parameters(), initial.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)
        assert max((p - b).abs().max().item() for p, b in zip(model.parameters(), initial.parameters())) > 1e-3
    finally:
        trainer.env.close()


@pytest.mark.parametrize("kl,clip_high", [(0.0, 0.2), (0.1, 0.28)])
def test_off_policy_the_readable_loss_and_gradient_are_the_trainers(tmp_path, tiny_lm_dir, kl, clip_high):
    trainer = _trainer(tmp_path, kl, clip_high, mini=8)  # two mini-batches: the old log-probs are recomputed
    try:
        env, model = trainer.env, trainer.env.model
        rollout, rewards = _scored(trainer)
        trainer.advantages(rollout, rewards)
        trainer.old_and_reference(rollout)
        # Move the policy off the old one, so the ratios are not all 1 and the clip can act.
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.device))
        micro = env.actions.trim_padding(rollout.select(torch.arange(8)))  # one micro-batch
        loss, _, _ = micro_loss(trainer.ctx, model, micro, mini_denominator(trainer.ctx, micro))
        loss.backward()
        expected = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        policy = copy.deepcopy(model)
        lr0 = torch.optim.SGD(policy.parameters(), lr=0.0)  # a step that changes nothing: only the gradient is read
        grads = {}
        step = lr0.step
        lr0.step = lambda: (grads.update(g=[p.grad.clone() for p in policy.parameters() if p.requires_grad]), step())[1]
        readable = grpo_step(policy, env.ref if kl > 0 else None, lr0, _batch(micro, old_logp=micro.old_logp),
                             micro_batch_size=8, clip_high=clip_high, kl_coef=kl, max_grad_norm=None)
        assert readable["loss/total"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        for got, want in zip(grads["g"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    finally:
        trainer.env.close()
