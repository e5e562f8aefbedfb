"""What every batch source hands the step (``Batch``, made by ``produced``) and the engine a source samples
with when it runs beside the update (``own_engine``): shared by ``unirl.rollout.sources`` and
``unirl.rollout.stream``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unirl.env import Rollout


@dataclass
class Batch:
    """One scored batch from a source, as the rollout and score stages give it."""

    rollout: Rollout
    rewards: torch.Tensor  # [N]
    reward_metrics: dict[str, float]
    filter_metrics: dict[str, float] | None  # dynamic sampling's filter/* figures
    version: int  # the training steps of the weights that sampled it
    optimizer_steps: int  # the optimizer steps of those weights (Rollout.policy_version)
    times: dict[str, float] = field(default_factory=dict)  # seconds of its stages, when the step waited for them


def produced(out: tuple, version: int, optimizer_steps: int, times: dict[str, float] | None = None) -> Batch:
    """``produce``'s ``(rollout, rewards, reward_metrics, filter_metrics)`` as a ``Batch`` whose samples are
    stamped with the optimizer steps of the weights that sampled them (``Rollout.policy_version`` [N])."""
    rollout, rewards, reward_metrics, filter_metrics = out
    rollout.policy_version = torch.full((len(rollout),), optimizer_steps, dtype=torch.long)  # [N]
    return Batch(rollout, rewards, reward_metrics, filter_metrics, version, optimizer_steps, times or {})


def own_engine(sampler, env) -> None:
    """Give ``sampler`` an engine with weights of its own when its engine samples from the trainer's live policy
    (the transformers engine): a copy the trainer's updates do not touch, loaded by published versions."""
    if sampler.engine.shares_policy:
        import dataclasses

        from unirl.rollout.engines import build_engine

        live = sampler.engine
        ctx = sampler.engine_context(env.model_path)
        sampler.engine = build_engine(sampler.engine_name, dataclasses.replace(ctx, own_weights=True))
        live.close()
