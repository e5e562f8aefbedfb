"""Registered policy losses: one signature, so the trainer calls the configured one and never branches
on the algorithm (verl's ``register_policy_loss`` in ``verl/trainer/ppo/core_algos.py`` is the model).

A policy loss is a function ``loss(inputs: LossInputs, settings: LossSettings) -> (loss, figures)``:

* ``inputs``: what one micro-batch (or one column piece of it, [n, T']) brings: the environment's
  forward of the stored actions (``Environment.score_actions``: ``logp`` and ``mask`` for a
  likelihood-ratio loss, DiffusionNFT's velocities for its loss), the old log-probs, the advantages,
  the rollout-correction weights and the aggregation's normaliser;
* ``settings``: the numbers of ``algo`` (and ``nft``) that losses read, checked where the config loads;
* returns the 0-dim loss share (gradients flow) and its detached figures (``loss/policy`` at least,
  ``loss/<name>`` shares that add up over pieces).

``PolicyLoss`` wraps the function with what the trainer must know about it without knowing its name:
whether it reads log-probs (the ratio losses; then the old log-probs are needed and the ratio figures
are logged) and whether it needs whole sequences (GSPO: no column pieces).

To add a loss: write the function in one file, decorate it with
``@register_policy_loss("name", reads_logprobs=..., whole_sequences=...)`` and import the file before
the run (``unirl.core`` imports the shipped ones). ``tests/test_policy_losses.py`` adds one and trains a
step with it; ``docs/architecture.md`` says how.

Shapes: n samples of the micro-batch, T' the columns of the piece (tokens or trained denoising steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from unirl.core.losses import aggregate, clipped_policy_loss
from unirl.core.nft import nft_loss, velocity_kl
from unirl.registry import Registry


@dataclass(frozen=True)
class LossSettings:
    """The numbers a policy loss reads (plain values, no config object): ``algo``'s clip range, dual
    clip, aggregation mode, and DiffusionNFT's ``nft`` block where it applies."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    nft_beta: float = 1.0  # DiffusionNFT's implicit-policy step
    nft_adv_clip: float = 5.0  # DiffusionNFT's A_max
    nft_kl_coef: float = 0.0  # DiffusionNFT's velocity pull to the reference


@dataclass
class LossInputs:
    """One micro-batch's (or one column piece's) inputs of a policy loss.

    ``forward``: ``Environment.score_actions``'s outputs for the piece (``logp`` [n, T'] with gradients,
    ``mask`` [n, T'] or None; DiffusionNFT: velocities [n, T', *latent]). ``old_logp`` [n, T'] (None for a
    loss that reads no log-probs), ``advantages`` [n, T'] (ratio losses) or [n] (per sample),
    ``weights`` [n, T'] rollout-correction weights or None, ``denominator`` and ``seq_lengths`` the
    aggregation's normaliser (``unirl.core.losses.aggregate``)."""

    forward: dict[str, torch.Tensor]
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    denominator: torch.Tensor | float | None = None
    seq_lengths: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        return self.forward.get("mask")


LossFn = Callable[[LossInputs, LossSettings], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss and what the trainer must know about it (module docstring)."""

    fn: LossFn
    reads_logprobs: bool = True
    whole_sequences: bool = False
    #: For the ratio figures (``policy_loss_metrics``): the ratio level, token or sequence.
    level: str = field(default="token")


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str, *, reads_logprobs: bool = True, whole_sequences: bool = False,
                         level: str = "token") -> Callable[[LossFn], LossFn]:
    """Register ``fn`` as the policy loss ``name`` (a duplicate name is an error)."""

    def decorator(fn: LossFn) -> LossFn:
        POLICY_LOSSES.add(name, PolicyLoss(fn, reads_logprobs=reads_logprobs, whole_sequences=whole_sequences,
                                           level=level))
        return fn

    return decorator


def _clipped(inputs: LossInputs, s: LossSettings, level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, _ = clipped_policy_loss(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask,
                                  clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip, level=level,
                                  agg=s.loss_agg, weights=inputs.weights, denominator=inputs.denominator,
                                  seq_lengths=inputs.seq_lengths, with_metrics=False)
    return loss, {"loss/policy": loss.detach()}


@register_policy_loss("clipped")
def clipped_ratio_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped ratio per token, with DAPO's clip-higher and dual clip (``clipped_policy_loss``)."""
    return _clipped(inputs, settings, "token")


@register_policy_loss("gspo", whole_sequences=True, level="sequence")
def gspo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level ratio (https://arxiv.org/abs/2507.18071; ``clipped_policy_loss``'s
    ``level="sequence"``): needs whole sequences, so the trainer does not cut it into column pieces."""
    return _clipped(inputs, settings, "sequence")


@register_policy_loss("nft", reads_logprobs=False)
def diffusion_nft_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's loss (``unirl.core.nft.nft_loss``) at each of the piece's noise levels, plus
    ``nft_kl_coef`` times the velocity gap to the reference, aggregated with ``loss_agg``.

    ``forward`` holds ``velocity``, ``old_velocity`` (and ``ref_velocity`` with a KL), ``clean``
    [n, *latent], ``noisy`` [n, T', *latent] and ``sigma`` [n, T']; ``advantages`` are per sample [n]."""
    f, s = inputs.forward, settings
    losses, figures = [], {"loss/policy": [], "loss/old_deviation": []}
    if s.nft_kl_coef > 0:
        figures["loss/kl"] = []
    for j in range(f["sigma"].shape[1]):
        v = f["velocity"][:, j]  # [n, *latent]
        policy, figs = nft_loss(v, f["old_velocity"][:, j], f["clean"], f["noisy"][:, j], f["sigma"][:, j],
                                inputs.advantages, beta=s.nft_beta, adv_clip=s.nft_adv_clip)  # [n]
        loss = policy
        figures["loss/policy"].append(policy.detach())
        figures["loss/old_deviation"].append(figs["old_deviation"])
        if s.nft_kl_coef > 0:
            kl = velocity_kl(v, f["ref_velocity"][:, j])  # [n]
            loss = loss + s.nft_kl_coef * kl
            figures["loss/kl"].append(kl.detach())
        losses.append(loss)
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    per_position = torch.stack(losses, dim=1)  # [n, T']
    total = aggregate(per_position, inputs.mask, s.loss_agg, **agg)
    shares = {name: aggregate(torch.stack(v, dim=1), inputs.mask, s.loss_agg, **agg) for name, v in figures.items()}
    return total, shares
