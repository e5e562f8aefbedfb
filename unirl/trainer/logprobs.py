"""The old and reference log-probs stage: ``Environment.score_actions`` over the rollout, micro-batch by
micro-batch, without gradients; and the rollout's figures (engine-vs-trainer gap ...) from them.

Shapes: N samples, T tokens or trained steps.
"""

from __future__ import annotations

import torch

from unirl.env import Rollout
from unirl.trainer.context import RunState, StepContext
from unirl.trainer.micro_batches import scatter_rows


@torch.no_grad()
def old_and_reference(ctx: StepContext, state: RunState, rollout: Rollout) -> dict[str, float]:
    """PPO's old log-probs (recomputed by the trainer unless the sampler's are the policy's), the
    reference outputs for the KL and the distillation teacher's log-probs, stored as ``rollout.old_logp``,
    ``rollout.old`` (the KL in the reward), ``rollout.ref`` and ``rollout.teacher_logp``.

    On-policy (one mini-batch, one epoch) the trainer does not recompute them here: the update's own
    forward runs on the same weights, so its detached log-probs are the old ones (TRL skips this pass
    the same way); the update then stores them and logs ``rollout/*`` from them."""
    env, model = ctx.env, ctx.env.model
    metrics = {}
    if len(rollout) == 0:  # every sample dropped (algo.drop_zero_adv)
        return metrics
    old = None
    if env.actions.recompute_old_logprobs:
        if ctx.on_policy():
            rollout.old_logp = None  # a stale copy would be used instead of the first forward's
        else:
            old = score_all(ctx, model, rollout)
            rollout.old_logp = old["logp"]
            metrics.update(rollout_metrics(ctx, rollout))
    if state.kl_ctrl is not None:
        # The KL in the reward compares the old policy's outputs with the reference's (diffusion: the
        # means of its steps, scored here unless the sampler kept them: ``Actions.sampled_outputs``).
        old = env.actions.sampled_outputs(rollout) if old is None else old
        old = score_all(ctx, model, rollout) if old is None else old
        rollout.old = dict(old)
    if ctx.algo.kl_coef > 0 or state.kl_ctrl is not None:
        with env.models.reference() as ref:
            ref_out = score_all(ctx, ref, rollout)
        rollout.ref = {k: v for k, v in ref_out.items() if k != "mask"}
    if ctx.distill is not None:  # the teacher scores the sampled tokens as the reference does
        with env.models.teacher() as teacher:
            rollout.teacher_logp = score_all(ctx, teacher, rollout)["logp"]
    return metrics


def rollout_metrics(ctx: StepContext, rollout: Rollout) -> dict[str, float]:
    """The environment's rollout figures (engine-vs-trainer log-prob gap ...) from ``old_logp``, over
    the global batch."""
    backend = ctx.backend
    if backend.num_processes > 1:
        rollout = rollout.map_tensors(lambda name, v: backend.gather_rows(v),
                                      group_ids=backend.gather_rows(rollout.group_ids), prompts=[], samples=[], columns={})
    return ctx.env.sampler.rollout_metrics(rollout)


def score_all(ctx: StepContext, model, rollout: Rollout) -> dict[str, torch.Tensor]:
    """``env.score_actions`` over the whole rollout, micro-batch by micro-batch (each trimmed to its own
    longest sample), returned in rollout order on CPU, right-padded with zeros to the full width."""
    env, parts = ctx.env, []
    for idx in ctx.micro_batches(rollout):
        out = env.actions.score_actions(model, env.actions.trim_padding(rollout.select(idx)))
        parts.append((idx, {k: v.detach().cpu() for k, v in out.items() if v is not None}))  # no mask: all trained
    width = env.actions.loss_mask(rollout).shape[1]  # [N, T]: the rollout's T, whatever the parts' widths
    return {k: scatter_rows([(idx, out[k]) for idx, out in parts], len(rollout), width) for k in parts[0][1]}
