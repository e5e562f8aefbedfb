"""The seam between the diffusion environment and its algorithm: a registered rollout mode (``algorithm:``).

The diffusion algorithms share the environment's setup, prompts, rewards, reference, EMA, held-out
evaluation and saving (``unirl/diffusion/env.py``); they differ in what a rollout keeps and in the
forward of what it kept. Each is a ``RolloutMode`` registered by name in ``ROLLOUT_MODES``
(``@register_rollout_mode("name")``); ``algorithm:`` names one, checked where the config loads
(``resolve_algorithm`` in ``unirl/diffusion/modes.py``, which imports the shipped modes), and
``DiffusionEnvironment`` builds it once and hands these to it, never branching on the algorithm itself:

* ``rollout``: sample and keep what training needs (FlowGRPO: the SDE steps and their log-probs,
  ``unirl/diffusion/flowgrpo.py``; DiffusionNFT: clean latents and noise levels, ``unirl/diffusion/nft.py``);
* ``score_actions``, ``loss_mask``, ``column_slices``, ``kl``: the forward of the stored samples, what
  the run's policy loss (a registered name, ``unirl.core.policy_losses``) reads;
* ``setup``, ``scored``, ``after_optimizer_step``, ``checkpoint_objects``: the mode's own state (NFT's old policy,
  GARDO's gate and reference).

A mode declares its default ``policy_loss`` and what its forward ``offers``; a loss declares what it
``reads`` (``PolicyLoss.reads``), so a loss the mode cannot feed is refused where the config loads,
naming both. A mode's own knobs are a frozen dataclass it registers (``settings=``), filled from the
config's ``mode_args`` (as a loss's from ``algo.loss_args``). A new method is a registered mode (and,
if it has one, a registered loss): no branch in the environment or the trainer.

Shapes: B prompts, G group size, N = B*G, T trained steps or noise levels, latents ``[*latent]``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from unirl.env import Actions, Rollout
from unirl.registry import Registry, build_settings as build_registered_settings


class RolloutMode(Actions, ABC):
    """One algorithm's rollout and forward for ``env``, the ``DiffusionEnvironment`` that owns it (its
    family, pipeline, encoders, schedules and reward queue are the mode's tools). It is the environment's
    ``actions`` (``unirl.env.Actions``): the forward of the samples it kept."""

    #: The registered policy loss this mode's rollouts train with (None: the ratio loss of ``algo``).
    policy_loss: str | None = None
    #: What ``score_actions`` can return besides ``mask``: a loss that reads more is refused at config load.
    offers: frozenset[str] = frozenset()
    #: Whether the trainer recomputes the old log-probs (``Actions.recompute_old_logprobs``): False where the
    #: trainer samples, so the sampler's log-probs are the policy's own (FlowGRPO), or there are none (NFT).
    recompute_old_logprobs: bool = False
    #: Whether the mode's sampler can keep the policy's step means (``sampling.sampler_old_means``).
    keeps_sampler_means: bool = False
    #: The mode's own settings (a frozen dataclass, from ``mode_args``); set by ``register_rollout_mode``.
    settings: type | None = None

    def __init__(self, env):
        from unirl.core.policy_losses import POLICY_LOSSES

        self.env = env
        self.args = build_settings(env.cfg.algorithm, type(self).settings, env.cfg.mode_args)
        #: The run's registered policy loss (what it reads decides what the forward returns).
        self.loss = POLICY_LOSSES.get(env.cfg.policy_loss_name())

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse, with the setting to change, what this mode cannot run (``cfg`` a ``DiffusionConfig``)."""

    def setup(self) -> None:
        """After the environment's setup: what the mode adds to it."""

    @abstractmethod
    def rollout(self, rows: list[dict], group_size: int) -> tuple[Rollout, list, dict[str, float]]:
        """Sample G per row; returns the rollout, its chunks' queued rewards (``env.sampler.decode_and_queue``)
        and the mode's rollout figures. Called by ``env.sampler.rollout`` with gradients off."""

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

    def scored(self, rollout: Rollout, rewards: torch.Tensor) -> None:
        """Once the rollout's rewards [N] are in (its ``score/<name>`` components in ``rollout.tensors``): what
        the mode derives from them for its update (GARDO's gate)."""

    def after_optimizer_step(self, optimizer_steps: int) -> None:
        """After each optimizer step, after the environment's EMA."""

    def checkpoint_objects(self) -> dict:
        """The mode's stateful objects by name, saved after the environment's."""
        return {}


ROLLOUT_MODES: Registry[type[RolloutMode]] = Registry("algorithm (diffusion rollout mode)")


def register_rollout_mode(name: str, *, settings: type | None = None) -> Callable[[type[RolloutMode]], type[RolloutMode]]:
    """Register a ``RolloutMode`` subclass as ``algorithm: name`` (a duplicate name is an error), with
    ``settings`` the frozen dataclass of its own knobs (``mode_args``)."""
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"register_rollout_mode({name!r}): settings must be a dataclass type, got {settings!r}")

    def decorator(cls: type[RolloutMode]) -> type[RolloutMode]:
        cls.settings = settings
        ROLLOUT_MODES.add(name, cls)
        return cls

    return decorator


def build_settings(name: str, cls: type | None, given: dict[str, Any] | None) -> Any:
    """The settings instance (of the dataclass ``cls``, None for a mode without settings) of the rollout mode
    ``name`` from ``given`` (``mode_args``), as ``build_loss_args`` builds a loss's: an unknown key, or keys
    for a mode without settings, is a ``ValueError`` naming ``mode_args.<key>`` and the mode's valid keys."""
    return build_registered_settings(cls, given, key="mode_args", owner=f"algorithm {name!r}", name=name)
