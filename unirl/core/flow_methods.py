"""The math of the faster diffusion RL methods, as functions over tensors and registered policy losses.

* **AWM**, Advantage Weighted Matching (Xue et al., 2025, https://arxiv.org/abs/2509.25050; Flow-Factory
  ``src/flow_factory/trainers/awm.py``, commit a0b2bc5): on DiffusionNFT's data path (clean samples
  noised afresh), the flow-matching error is the policy's log-likelihood,
  ``log p = -w(t) mean((v(x_t) - (eps - x0))^2)`` (``matching_log_prob``, Flow-Factory's
  ``compute_weighted_log_prob``), trained by the clipped ratio loss ``clipped`` over it: at ratio 1 its
  gradient is the paper's advantage-weighted matching, ``A w(t) grad ||v - (eps - x0)||^2``.
* **DGPO**, Direct Group Preference Optimization (Luo et al., 2025, https://arxiv.org/abs/2510.08425;
  Flow-Factory ``src/flow_factory/trainers/dgpo.py``, commit a0b2bc5), the loss ``dgpo``: the denoising
  score-matching error ``dsm = mean((v - (eps - x0))^2)`` against the reference's ``ref_dsm``, a group's
  preference ``sigmoid(sum_i A_i beta (dsm_i - ref_dsm_i) / G)`` (detached) weighting
  ``A_i dsm_i``: a DPO over the whole group instead of pairs (``dgpo_group_weights``). ``dsm`` moving
  past the old policy's by more than the clip range in the advantage's direction is detached (PPO-style
  DSM clipping, ``clip_dsm``).
* **TempFlow-GRPO** (He et al., 2025, https://arxiv.org/abs/2508.04324; its code
  ``Shredded-Pork/TempFlow-GRPO`` ``scripts/train_sd3_pr.py``, commit e66824e, and Tencent UniRL
  ``unirl/algorithms/tempflowgrpo.py``, commit 5e3dfd8), the loss ``tempflow``: FlowGRPO's clipped loss
  of each trained step scaled by ``weight_scale * s``, the step's std (noise-aware weighting: the steps
  that move the image most weigh most). Its per-step credit is in its rollout (``unirl/diffusion/tempflow.py``).

Shapes: n samples, T' trained steps or noise levels of the piece, latents ``[*latent]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unirl.core.losses import aggregate, clipped_policy_loss
from unirl.core.policy_losses import LossInputs, LossSettings, register_policy_loss

#: AWM's weightings of the matching error by the noise level t (Flow-Factory's ``awm_weighting``).
AWM_WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")


def matching_log_prob(velocity: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, *, weighting: str = "uniform",
                      ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's log-likelihood [n] of a noised sample: ``-mean((v - u)^2)`` over the latent (``u = eps - x0``,
    ``target``), weighted by the noise level ``t = sigma`` [n] as ``weighting`` says: ``uniform`` (none),
    ``t``, ``t**2``, ``huber`` (``-(sqrt(mse + 1e-10) - 1e-5) t``) or ``ghuber``
    (``-((mse + 1e-10)^p - 1e-10^p) t / p``). Computed in float64 as Flow-Factory computes it, returned
    in float32; gradients flow through ``velocity``."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}")
    v, u = velocity.double(), target.detach().double()
    log_prob = -(v - u).square().mean(dim=tuple(range(1, v.ndim)))  # [n]
    t = sigma.double().reshape(-1)
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t ** 2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=log_prob.dtype, device=log_prob.device)
        log_prob = -(torch.pow(-log_prob + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power
    return log_prob.float()


def dsm_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean((v - u)^2)`` [n] over the latent: the denoising score-matching error of velocity [n, *latent]
    against the flow-matching target ``u = eps - x0``."""
    v = velocity.float()
    return (v - target.detach().float()).square().flatten(1).mean(dim=1)


def dgpo_group_weights(dsm: torch.Tensor, ref_dsm: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
                       beta: float) -> torch.Tensor:
    """DGPO's per-sample weight [n], detached: ``sigmoid(sum_{i in g} A_i beta (dsm_i - ref_dsm_i) / |g|)`` of
    the sample's group g (``group_ids`` [n]; every member of a group must be in the batch). A group whose
    good samples already fit better than the reference's (and bad ones worse) gets a weight near 0: DPO's
    ``sigmoid(-margin)``."""
    groups, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    per_sample = advantages.float() * beta * (dsm.detach() - ref_dsm.detach()) / counts[index].to(dsm.dtype)  # [n]
    sums = torch.zeros(len(groups), dtype=per_sample.dtype, device=per_sample.device).index_add_(0, index, per_sample)
    return torch.sigmoid(sums)[index].detach()


@dataclass(frozen=True)
class DgpoArgs:
    """DGPO's loss settings (``algo.loss_args`` with ``algorithm: dgpo``). Defaults are Flow-Factory's
    ``DGPOTrainingArguments`` (its SD3.5 PickScore example sets ``dpo_beta: 10``)."""

    #: The group preference's temperature (``dpo_beta``).
    beta: float = 100.0
    #: Detach the DSM error of a sample whose ratio to the old policy's, ``exp(old_dsm - dsm)``, left the
    #: clip range (``algo.clip_low`` / ``clip_high``) in its advantage's direction (``clip_dsm``).
    clip_dsm: bool = True
    #: Weight of ``mean((v - v_ref)^2)`` in the loss (``kl_beta``, 0 in Flow-Factory's DGPO).
    kl_coef: float = 0.0

    def __post_init__(self):
        for name, positive in (("beta", True), ("kl_coef", False)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or (
                    value <= 0 if positive else value < 0):
                raise ValueError(f"{name} must be {'>' if positive else '>='} 0, got {value!r}")


@register_policy_loss("dgpo", settings=DgpoArgs, reads_logprobs=False,
                      reads=("velocity", "ref_velocity", "old_velocity", "target", "group"))
def dgpo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DGPO's group-preference loss at each of the piece's noise levels (module docstring), aggregated
    with ``loss_agg``. ``forward``: ``velocity``, ``ref_velocity``, ``old_velocity``, ``target``
    [n, T', *latent], ``group`` [n]; ``advantages`` per sample [n]."""
    f, s, args = inputs.forward, settings, settings.args or DgpoArgs()
    adv = inputs.advantages.float()
    losses, figures = [], {"loss/policy": [], "loss/dsm": [], "loss/dgpo_weight": [], "loss/dsm_clip_frac": []}
    for j in range(f["velocity"].shape[1]):
        v, u = f["velocity"][:, j], f["target"][:, j]
        dsm = dsm_error(v, u)  # [n]
        clipped = torch.zeros_like(dsm, dtype=torch.bool)
        if args.clip_dsm:
            ratio = torch.exp(dsm_error(f["old_velocity"][:, j], u) - dsm.detach())
            clipped = torch.where(adv > 0, ratio > 1 + s.clip_high, ratio < 1 - s.clip_low)
            dsm = torch.where(clipped, dsm.detach(), dsm)
        weight = dgpo_group_weights(dsm, dsm_error(f["ref_velocity"][:, j], u), adv, f["group"], args.beta)
        loss = weight * adv * dsm  # [n]
        figures["loss/policy"].append(loss.detach())
        if args.kl_coef > 0:
            loss = loss + args.kl_coef * dsm_error(v, f["ref_velocity"][:, j])
        losses.append(loss)
        for name, value in (("loss/dsm", dsm), ("loss/dgpo_weight", weight), ("loss/dsm_clip_frac", clipped.float())):
            figures[name].append(value.detach())
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    total = aggregate(torch.stack(losses, dim=1), inputs.mask, s.loss_agg, **agg)
    return total, {k: aggregate(torch.stack(v, dim=1), inputs.mask, s.loss_agg, **agg) for k, v in figures.items()}


@dataclass(frozen=True)
class TempflowArgs:
    """TempFlow-GRPO's noise-aware weight (``algo.loss_args`` with ``algorithm: tempflow``)."""

    #: Each step's clipped loss is multiplied by ``weight_scale`` times the step's std (its code's 2.25;
    #: Tencent UniRL's ``weight_scale``).
    weight_scale: float = 2.25

    def __post_init__(self):
        if not isinstance(self.weight_scale, (int, float)) or isinstance(self.weight_scale, bool) or not self.weight_scale > 0:
            raise ValueError(f"weight_scale must be > 0, got {self.weight_scale!r}")


@register_policy_loss("tempflow", settings=TempflowArgs, reads=("std",))
def tempflow_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """FlowGRPO's clipped ratio loss with each step's term weighted by ``weight_scale * std`` (module
    docstring): the rollout-correction weights' slot of ``clipped_policy_loss`` carries the weight."""
    s, args = settings, settings.args or TempflowArgs()
    weight = args.weight_scale * inputs.forward["std"].float()  # [n, T']
    if inputs.weights is not None:
        weight = weight * inputs.weights
    loss, _ = clipped_policy_loss(inputs.forward["logp"], inputs.old_logp, inputs.advantages, inputs.mask,
                                  clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip, agg=s.loss_agg,
                                  weights=weight.detach(), denominator=inputs.denominator, seq_lengths=inputs.seq_lengths,
                                  with_metrics=False)
    agg = dict(denominator=inputs.denominator, seq_lengths=inputs.seq_lengths)
    return loss, {"loss/policy": loss.detach(), "loss/tempflow_weight": aggregate(weight.detach(), inputs.mask,
                                                                                  s.loss_agg, **agg)}
