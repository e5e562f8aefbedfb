"""What a stage of a training step receives besides the batch: the ``StepContext`` (fixed once the run is set
up: the environment's parts, the backend, the settings, the trained models' optimizers) and the ``RunState``
(what changes as the run goes: the step, the optimizer steps, the KL coefficient). A stage never sees the
``Trainer``; the trainer builds both and hands them to the step plan (``unirl.trainer.plan``).

Shapes: N samples of this process, T tokens or trained steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from unirl.config.schema import AlgoConfig, OptimConfig, TrainerConfig
from unirl.core.policy_losses import LossSettings, PolicyLoss
from unirl.env import Environment, Rollout
from unirl.trainer.micro_batches import num_mini_batches, plan_micro_batches, split_to_count


@dataclass
class RunState:
    """The run's counters, saved in each checkpoint's ``loop.json``: ``step`` (training steps done),
    ``optimizer_steps`` (the policy's optimizer steps so far; ``Rollout.policy_version`` counts them) and
    ``kl_ctrl`` (the KL-in-the-reward controller, whose ``value`` is the coefficient; None without it)."""

    step: int = 0
    optimizer_steps: int = 0
    kl_ctrl: Any = None


@dataclass
class StepContext:
    """The parts a stage uses, fixed for the run (``Trainer.setup`` builds it)."""

    env: Environment
    backend: Any  # unirl.trainer.backends.Backend
    algo: AlgoConfig
    cfg: TrainerConfig
    optim: OptimConfig
    policy_loss: PolicyLoss | None
    loss_settings: LossSettings
    #: The PPO ratio's anchor is the engine's log-probs (``source.bypass_mode``, resolved by the source).
    bypass_mode: bool = False
    #: On-policy distillation's settings (text's ``distill`` block) when a teacher is set, else None.
    distill: Any = None
    #: The policy's optimizer and schedule; PPO's critic (``unirl.trainer.critic.Critic``) or None.
    optimizer: Any = None
    scheduler: Any = None
    critic: Any = None
    #: The run's batch source (``unirl.rollout.sources``): the ``publish`` stage hands it the new weights.
    source: Any = None

    @property
    def accelerator(self):
        return self.backend.accelerator

    @property
    def model(self) -> torch.nn.Module:
        return self.env.model

    def num_mini_batches(self) -> int:
        return num_mini_batches(self.cfg.prompts_per_step, self.cfg.group_size, self.cfg.mini_batch_size)

    def on_policy(self) -> bool:
        """Whether every forward of the update sees the weights that the old log-probs belong to: one
        mini-batch and one epoch, so the only optimizer step comes after all of them. (Not when the KL
        is in the reward or distilling: the rewards or advantages need the old log-probs before the update.)"""
        return (self.cfg.ppo_epochs == 1 and self.num_mini_batches() == 1 and not self.algo.use_kl_in_reward
                and self.distill is None)

    def micro_batches(self, batch: Rollout) -> list[torch.Tensor]:
        """The micro-batches of ``batch`` as index tensors (``plan_micro_batches``): ``micro_batch_size``
        samples each, or packed by ``trainer.micro_batch_tokens`` over ``env.sample_tokens`` and then
        padded only to their own longest (``env.trim_padding``). With several processes every one runs
        as many micro-batches as the busiest, as FSDP's collective forwards need."""
        budget = self.cfg.micro_batch_tokens
        lengths = None if budget is None else self.env.actions.sample_tokens(batch)  # [n]
        chunks = plan_micro_batches(len(batch), micro_batch_size=self.cfg.micro_batch_size, lengths=lengths,
                                    token_budget=budget)
        backend = self.backend
        if budget is not None and backend.num_processes > 1:
            count = torch.tensor([len(chunks)], device=backend.device)
            chunks = split_to_count(chunks, int(self.accelerator.reduce(count, reduction="max")))
        return [torch.tensor(c, dtype=torch.long) for c in chunks]
