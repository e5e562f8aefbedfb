"""The seam between the diffusion environment and its algorithm: a rollout mode (``algorithm:``).

FlowGRPO and DiffusionNFT share the environment's setup, prompts, rewards, reference, EMA, held-out
evaluation and saving (``unirl/diffusion/env.py``); they differ in what a rollout keeps and in the
forward of what it kept. ``DiffusionEnvironment`` builds the mode of ``cfg.algorithm`` once
(``ROLLOUT_MODES`` in ``env.py``) and hands these to it, never branching on the algorithm itself:

* ``rollout``: sample and keep what training needs (FlowGRPO: the SDE steps and their log-probs,
  ``unirl/diffusion/flowgrpo.py``; DiffusionNFT: clean latents and noise levels, ``unirl/diffusion/nft.py``);
* ``score_actions``, ``loss_mask``, ``column_slices``, ``kl``: the forward of the stored samples, what
  the mode's ``policy_loss`` (a registered name, ``unirl.core.policy_losses``) reads;
* ``setup``, ``after_optimizer_step``, ``checkpoint_objects``: the mode's own state (NFT's old policy).

Shapes: B prompts, G group size, N = B*G, T trained steps or noise levels, latents ``[*latent]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from unirl.env import Actions, Rollout


class RolloutMode(Actions, ABC):
    """One algorithm's rollout and forward for ``env``, the ``DiffusionEnvironment`` that owns it (its
    family, pipeline, encoders, schedules and reward queue are the mode's tools). It is the environment's
    ``actions`` (``unirl.env.Actions``): the forward of the samples it kept."""

    #: The registered policy loss this mode's rollouts train with (None: the ratio loss of ``algo``).
    policy_loss: str | None = None
    #: The trainer samples: the sampler's log-probs are the policy's.
    recompute_old_logprobs = False

    def __init__(self, env):
        self.env = env

    def setup(self) -> None:
        """After the environment's setup: what the mode adds to it."""

    @abstractmethod
    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        """Sample G per row; returns the rollout, its chunks' queued rewards (``env.sampler.decode_and_queue``)
        and the mode's rollout figures. Called by ``env.rollout`` with gradients off."""

    @abstractmethod
    def score_actions(self, model, batch: Rollout, columns: slice = slice(None)) -> dict[str, torch.Tensor]:
        """``Environment.score_actions`` for this mode's rollouts."""

    @abstractmethod
    def loss_mask(self, batch: Rollout) -> torch.Tensor:
        """[n, T] trained positions (``Environment.loss_mask``)."""

    @abstractmethod
    def column_slices(self, batch: Rollout) -> list[slice]:
        """The pieces of T the update backpropagates one after another (``Environment.column_slices``)."""

    @abstractmethod
    def kl(self, current: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> torch.Tensor:
        """[n, T] KL penalty to the reference (``Environment.kl``)."""

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        """After each optimizer step, after the environment's EMA."""

    def checkpoint_objects(self) -> dict:
        """The mode's stateful objects by name, saved after the environment's."""
        return {}
